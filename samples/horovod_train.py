"""A Horovod-style PyTorch training script, run by mpigpu: only the import differs from horovod.torch.

    mpiexec -n 4 python -m mpigpu.run samples/horovod_train.py     # was: horovodrun -np 4 python train.py

It does what every Horovod script does: init, pin the GPU to the local rank, broadcast rank 0's
parameters and optimizer state (each rank builds its model with a different seed on purpose),
wrap the optimizer in DistributedOptimizer, and average a metric with hvd.allreduce. At the end it
checks that every rank holds the same parameters, and that the loss fell, and prints PASS or FAIL.
"""

from __future__ import annotations

import argparse
import sys

import torch

import mpigpu.horovod.torch as hvd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)

    hvd.init()
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda:
        # pin one GPU per process; the modulo keeps it valid where the launcher shows each rank only its
        # own GPU (Intel MPI's GPU pinning), where Horovod's plain set_device(hvd.local_rank()) fails
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    # a synthetic regression task; each rank takes its own shard, as a DistributedSampler would
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(1024, 16, generator=g)
    targets = inputs @ torch.randn(16, 4, generator=g) + 0.1 * torch.randn(1024, 4, generator=g)
    shard = slice(hvd.rank(), None, hvd.size())
    inputs, targets = inputs[shard].to(device), targets[shard].to(device)

    torch.manual_seed(1234 + hvd.rank())  # different initial weights per rank: the broadcast fixes that
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)  # lr scaled by size

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression, op=hvd.Average
    )

    losses = []
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=device)
        for start in range(0, inputs.shape[0], args.batch_size):
            x, y = inputs[start : start + args.batch_size], targets[start : start + args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach() * x.shape[0]
        epoch_loss = hvd.allreduce(total / inputs.shape[0], name="avg_loss").item()  # the metric, averaged
        losses.append(epoch_loss)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {epoch_loss:.6f}", flush=True)

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    everyone = hvd.allgather(flat[None, :])
    same = bool((everyone == everyone[0]).all())
    ok = same and losses[-1] < losses[0]
    if hvd.rank() == 0:
        print(f"parameters identical on every rank: {same}")
        print(f"# {'PASS' if ok else 'FAIL'} ({hvd.size()} ranks, {'cuda' if use_cuda else 'cpu'})", flush=True)
    hvd.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
