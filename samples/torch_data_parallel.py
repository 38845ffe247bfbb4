"""Data-parallel training of a small PyTorch model, with mpigpu averaging the gradients.

    mpiexec -n 4 python samples/torch_data_parallel.py              # train; print the loss
    mpiexec -n 4 python samples/torch_data_parallel.py --check-ddp  # and compare with PyTorch DDP

Every rank builds the same model (same seed) and trains it on its own shard of a synthetic data set.
mpigpu's BackwardAverager averages the gradients while backward() runs, bucket by bucket, like
DistributedDataParallel. With --check-ddp a second copy of the model is trained with
torch.nn.parallel.DistributedDataParallel (gloo on CPU, NCCL on GPU) on the same data, and the
parameters of the two are compared after the last step.

Tolerance of the check: max |p_mpigpu - p_ddp| <= 1e-5 * max |p|. Each rank computes the same
gradients in both copies; only the averaging rounds differently (mpigpu sums and then divides by
the number of ranks, DDP divides first and sums in gloo's or NCCL's order), a few float32 ulps per
step. Twenty SGD steps with momentum keep that near 1e-7 relative; a real fault (a bucket missed or
sent twice, a stale gradient, a wrong scale) moves parameters by 1e-3 or more.
"""

from __future__ import annotations

import argparse
import gc
import socket
import sys
from typing import Any

import numpy as np


def build_model(seed: int, device: Any) -> Any:
    """The same small MLP on every rank (same seed -> same initial weights)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 4),
    )
    return model.to(device)


def shard(rank: int, nranks: int, batch: int, device: Any) -> tuple[Any, Any]:
    """This rank's rows of a fixed synthetic regression set (a sine of a linear map, so there is
    something to learn). Every rank generates the same global set and takes its own rows."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(batch * nranks, 16, generator=gen)
    y = torch.sin(x @ torch.linspace(-1, 1, 16 * 4).reshape(16, 4))
    rows = slice(rank * batch, (rank + 1) * batch)
    return x[rows].to(device), y[rows].to(device)


def train(model: Any, optimizer: Any, args: argparse.Namespace, rank: int, nranks: int, device: Any) -> list[float]:
    """Run ``args.steps`` SGD steps on this rank's shard; return the loss of each step."""
    import torch

    x, y = shard(rank, nranks, args.batch, device)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # with mpigpu, buckets are averaged while this runs
        optimizer.step()  # with mpigpu, waits for the averages first
        losses.append(float(loss.detach()))
    return losses


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ddp_parameters(args: argparse.Namespace, comm: Any, device: Any) -> list[Any]:
    """Train the same model with DistributedDataParallel; return its parameters."""
    import torch
    import torch.distributed as dist

    rank, nranks = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nranks)
    try:
        model = build_model(args.seed, device)
        ids = [device.index] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        train(ddp, optimizer, args, rank, nranks, device)
        # DDP goes first, while the process group is still registered: a gloo group destroyed inside
        # DDP's destructor can deadlock there (seen with PyTorch 2.13 on CPU).
        del ddp, optimizer
        gc.collect()
        return [p.detach().clone() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    import mpigpu
    from mpigpu import BackwardAverager

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    gpu = mpigpu.select_device() if args.device != "cpu" else None
    if args.device == "gpu" and gpu is None:
        raise SystemExit("--device gpu: no GPU visible")
    device = torch.device("cuda", gpu.index) if gpu is not None else torch.device("cpu")
    if rank == 0:
        print(f"# {nranks} ranks, {device}, {args.steps} steps, {args.batch} samples per rank")

    # 1. The model, the optimizer, and mpigpu averaging the gradients during backward().
    model = build_model(args.seed, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    averager = BackwardAverager(model, optimizer=optimizer, bucket_bytes=args.bucket_bytes)
    if rank == 0:
        print(f"# {len(averager.buckets)} buckets: {[b['arrays'] for b in averager.buckets]} parameters each")
    if args.no_average:  # testing aid: the checks below must then fail
        averager.close()

    # 2. Train. optimizer.step() first waits for the averages (the optimizer= hook).
    losses = train(model, optimizer, args, rank, nranks, device)
    mean_losses = mpigpu.allreduce(np.array(losses, dtype=np.float64))  # average loss over ranks, per step
    if rank == 0:
        print(f"# loss: first step {mean_losses[0]:.5f}, last step {mean_losses[-1]:.5f}")
    ok = mean_losses[-1] < mean_losses[0]

    # 3. Every rank must hold bit-identical parameters.
    mine = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).numpy()
    identical = all(comm.allgather(np.array_equal(mine, comm.bcast(mine, root=0))))
    ok &= identical
    if rank == 0:
        print(f"# parameters identical on every rank: {identical}")

    # 4. Optionally: the same training under DistributedDataParallel must give the same parameters.
    if args.check_ddp:
        reference = ddp_parameters(args, comm, device)
        scale = max(float(p.abs().max()) for p in reference)
        diff = max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), reference, strict=True))
        diff = max(comm.allgather(diff))
        within = diff <= 1e-5 * scale
        ok &= within
        if rank == 0:
            print(f"# DDP check: max |mpigpu - DDP| = {diff:.3e}, max |p| = {scale:.3f}, "
                  f"tolerance 1e-5 * max |p| = {1e-5 * scale:.3e}: {'PASS' if within else 'FAIL'}")  # fmt: skip
    averager.close()
    if rank == 0:
        print("# PASS" if ok else "# FAIL")
    return 0 if ok else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="SGD steps (default 20)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="model seed (default 0)")
    parser.add_argument(
        "--bucket-bytes", default="8K", help="bucket cap; small, so this small model has several (default 8K)"
    )
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto", help="default: GPU if present")
    parser.add_argument("--check-ddp", action="store_true", help="compare with DistributedDataParallel")
    parser.add_argument("--no-average", action="store_true", help=argparse.SUPPRESS)  # testing aid
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse(argv))


if __name__ == "__main__":
    import mpigpu

    mpigpu.install_abort_handler()  # an uncaught error on one rank ends every rank
    sys.exit(main())
