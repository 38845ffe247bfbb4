"""``mpiexec -n N python -m mpigpu.bench.synthetic``: images per second of a torchvision model trained on
synthetic data with DistributedDataParallel, torch.distributed started from MPI (NCCL on GPUs, gloo on the
host). It is the DDP side of issue 37's comparison with Horovod's synthetic benchmark run unchanged on
mpigpu's Horovod layer (scripts/hvd_synthetic.py runs both, alternately, and compares them).

It measures what that benchmark measures, the same way: ``torchvision.models.<--model>()`` in float32 on
each rank's GPU (cudnn.benchmark on), one fixed random batch of --batch-size 3 x 224 x 224 images per rank
with random labels of 1000 classes, SGD with learning rate 0.01 x ranks; a step is zero_grad, forward,
cross-entropy, backward, step. After --num-warmup-batches steps come --num-iters iterations of
--num-batches-per-iter steps, each iteration timed on the host clock alone (no device synchronisation:
within an iteration the host may run ahead of the GPU by what the launch queue holds, as there).

Rank 0 prints a ``#`` header, then the lines both benchmarks print, which the driver parses:
``Iter #i: X img/sec per GPU`` for each iteration, ``Img/sec per GPU: M +-C`` (the mean over iterations
and 1.96 population standard deviations) and ``Total img/sec on N GPU(s): N*M +-N*C``. On the host
(--no-cuda, or no GPU) they say CPU. Exit status 2 when torchvision or the model cannot be had.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from mpigpu.cli import Parser, header_lines, nonneg_int, parse_command, positive_int, prog, refuse

__all__ = ["build_parser", "main", "summary_lines", "torchvision_model"]

IMAGE_SIZE = 224
CLASSES = 1000
LR_PER_RANK = 0.01
CONFIDENCE = 1.96  # the +- figure: 1.96 population standard deviations of the iterations' img/sec


def build_parser() -> Parser:
    parser = Parser(
        prog=prog("mpigpu.bench.synthetic"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="resnet50", help="a model of torchvision.models (default resnet50)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per rank and step (default 32)")
    parser.add_argument("--num-warmup-batches", type=nonneg_int, default=10, help="untimed steps first (default 10)")
    parser.add_argument("--num-batches-per-iter", type=positive_int, default=10,
                        help="steps per timed iteration (default 10)")  # fmt: skip
    parser.add_argument("--num-iters", type=positive_int, default=10, help="timed iterations (default 10)")
    parser.add_argument("--no-cuda", action="store_true", help="train on the host (gloo) even where a GPU is")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="DDP's fp16_compress_hook: gradients travel as float16 (default: float32)")  # fmt: skip
    return parser


def torchvision_model(name: str) -> tuple[Callable[[], Any] | None, str]:
    """(the constructor ``torchvision.models.<name>``, torchvision's version), or (None, why not)."""
    try:
        torchvision = importlib.import_module("torchvision")
        models = importlib.import_module("torchvision.models")
    except ImportError as exc:
        return None, (f"--model {name} is built by torchvision.models, and torchvision cannot be imported here "
                      f"({exc}): pip install torchvision (the build that matches your torch)")  # fmt: skip
    constructor = getattr(models, name, None)
    if not callable(constructor):
        return None, f"torchvision.models has no model {name!r} (torchvision {torchvision.__version__})"
    return constructor, str(torchvision.__version__)


def summary_lines(img_secs: list[float], ranks: int, device: str) -> list[str]:
    """The closing lines: the mean img/sec per device over the iterations +- 1.96 population standard
    deviations, and the same for all ranks together."""
    mean = statistics.fmean(img_secs)
    conf = CONFIDENCE * statistics.pstdev(img_secs)
    return [
        f"Img/sec per {device}: {mean:.1f} +-{conf:.1f}",
        f"Total img/sec on {ranks} {device}(s): {ranks * mean:.1f} +-{ranks * conf:.1f}",
    ]


def _timed(step: Callable[[], None], count: int) -> float:
    """Host seconds for ``count`` calls of ``step``."""
    begin = time.perf_counter()
    for _ in range(count):
        step()
    return time.perf_counter() - begin


def run(args: argparse.Namespace) -> int:
    from mpigpu.bench.models import init_torch_distributed
    from mpigpu.calls.reduce import select_device
    from mpigpu.core._mpi import world
    from mpigpu.runtime.context import Context

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    constructor, about = torchvision_model(args.model)
    problems = [p for p in comm.allgather(None if constructor else about) if p]
    if problems:  # every rank alike: one rank that lacks the model refuses the job
        return refuse("mpigpu.bench.synthetic", problems[0], rank)
    assert constructor is not None

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    gpu = None if args.no_cuda else select_device(comm)
    on_gpu = all(comm.allgather(gpu is not None and torch.cuda.is_available()))
    device = torch.device("cuda", gpu.index) if on_gpu and gpu is not None else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    header = header_lines(Context.get(comm))
    init_torch_distributed(comm, "nccl" if on_gpu else "gloo")
    try:
        model = constructor().to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if on_gpu else None)
        if args.fp16_allreduce:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR_PER_RANK * size)
        images = torch.randn(args.batch_size, 3, IMAGE_SIZE, IMAGE_SIZE).to(device)
        labels = torch.randint(0, CLASSES, (args.batch_size,)).to(device)

        def step() -> None:
            optimizer.zero_grad()
            F.cross_entropy(ddp(images), labels).backward()
            optimizer.step()

        kind = "GPU" if on_gpu else "CPU"
        wire = "float16 (fp16_compress_hook)" if args.fp16_allreduce else "float32"
        say = print if rank == 0 else (lambda *_: None)
        say("\n".join(header))
        say(f"# DDP, torch.distributed {dist.get_backend()} (torch {torch.__version__}), gradients in {wire}; "
            f"torchvision {about} {args.model}, float32, batch {args.batch_size} per {kind}, "
            f"{size} {kind}(s)")  # fmt: skip
        say(f"# {args.num_warmup_batches} warm-up batches, then {args.num_iters} iterations of "
            f"{args.num_batches_per_iter} batches, each timed on the host clock")  # fmt: skip
        _timed(step, args.num_warmup_batches)
        img_secs = []
        for index in range(args.num_iters):
            img_sec = args.batch_size * args.num_batches_per_iter / _timed(step, args.num_batches_per_iter)
            say(f"Iter #{index}: {img_sec:.1f} img/sec per {kind}")
            img_secs.append(img_sec)
        say("\n".join(summary_lines(img_secs, size, kind)))
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_command(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
