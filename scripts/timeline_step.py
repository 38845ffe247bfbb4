"""A few training steps with BackwardAverager under MPIGPU_TIMELINE: the timeline's job for gpu-check and CI.

    MPIGPU_TIMELINE=tl mpirun -np 2 python scripts/timeline_step.py --model resnet50 --steps 6
    python -m mpigpu.timeline check tl && python -m mpigpu.timeline merge tl
    python -m mpigpu.timeline plot tl -o step.png

On a GPU: the model as mpigpu.bench.training builds it (ResNet-50: torchvision's, channels_last, 64 x 3 x
224 x 224 per rank, bf16 autocast, SGD with momentum), BackwardAverager with its defaults (DDP's buckets).
On the host: the MLP, the cpu backend. Every rank prints its loss at the end (the ranks agree: the
parameters are averaged) and the number of buckets.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50", choices=["mlp", "resnet50", "gpt2"])
    parser.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    parser.add_argument("--batch", type=int, default=None, help="samples per rank (default: the bench's)")
    args = parser.parse_args(argv)
    if not os.environ.get("MPIGPU_TIMELINE"):
        sys.stderr.write("timeline_step.py: set MPIGPU_TIMELINE=<directory> (the timeline is what this job is for)\n")
        return 2

    import torch

    import mpigpu
    from mpigpu.bench.models import build
    from mpigpu.core._mpi import world

    comm = world()
    gpu = mpigpu.select_device() if args.device != "cpu" else None
    if args.device == "gpu" and gpu is None:
        sys.stderr.write("timeline_step.py: no GPU visible (use --device cpu)\n")
        return 2
    device = torch.device("cuda", gpu.index) if gpu is not None else torch.device("cpu")
    if gpu is not None:
        torch.cuda.set_device(device)
    options = argparse.Namespace(batch=args.batch, width=4096 if gpu else 256, depth=8, image_size=224, seq_len=512,
                                 seed=0, deterministic=False)  # fmt: skip
    made = build(args.model, options, device, comm.Get_rank())
    model = made.module
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    averager = mpigpu.BackwardAverager(model, optimizer=optimizer)
    try:
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=False)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu is not None):
                loss = made.loss(model, made.inputs)
            loss.backward()
            optimizer.step()
        if gpu is not None:
            torch.cuda.synchronize()
        # one write per rank: the ranks' lines do not interleave
        sys.stdout.write(f"rank {comm.Get_rank()}: {args.model}, {args.steps} steps, {len(averager.buckets)} "
                         f"buckets, last loss {float(loss.detach()):.4f}\n")  # fmt: skip
    finally:
        averager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
