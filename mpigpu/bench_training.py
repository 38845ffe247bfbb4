"""``mpiexec -n N python -m mpigpu.bench_training``: gradient averaging the way training does it.

1. Fusion, on a ResNet-50-shaped gradient list (161 float32 tensors, 25,557,032 parameters): the
   Averager (packing copies; and with the gradients living in its buckets) against one allreduce
   per tensor and against one flat allreduce of the same bytes.
2. Overlap (needs PyTorch): how much of the communication BackwardAverager hides behind backward()
   in a multi-layer perceptron, from three timings: backward alone, backward then averaging, and
   backward with the averaging started by hooks.
3. ``--accuracy``: float16 and bfloat16 compression against float32 averaging, on the same
   gradient list filled with Gaussian values whose scale differs per tensor (1e-6 .. 1e-1).

Times are per training step, mean over ``--iters`` after ``--warmup``, slowest rank.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpigpu.cli import (
    Parser,
    header_lines,
    nonneg_int,
    now,
    parse_command,
    positive_int,
    prog,
    refuse,
    versions,
    write_json,
)

__all__ = ["RESNET50_PARAMETERS", "main", "resnet50_shapes"]

RESNET50_PARAMETERS = 25_557_032


def resnet50_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50, in model order (161 tensors). ``scale`` < 1
    shrinks every tensor's first dimension (at least 1) for quick runs."""
    shapes: list[tuple[int, ...]] = []

    def conv_bn(out: int, inp: int, k: int) -> None:
        shapes.extend([(out, inp, k, k), (out,), (out,)])  # conv weight, batch-norm weight and bias

    conv_bn(64, 3, 7)
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            conv_bn(planes, inplanes, 1)
            conv_bn(planes, planes, 3)
            conv_bn(planes * 4, planes, 1)
            if block == 0:
                conv_bn(planes * 4, inplanes, 1)  # the downsample branch
            inplanes = planes * 4
    shapes.extend([(1000, 2048), (1000,)])
    if scale != 1.0:
        shapes = [(max(1, round(s[0] * scale)), *s[1:]) for s in shapes]
    return shapes


# -- timing ---------------------------------------------------------------------------------------
def _step_time(step: Callable[[], Any], args: argparse.Namespace, comm: Any, sync: Callable[[], Any]) -> float:
    """Mean seconds per call of ``step`` on the slowest rank (device work included)."""
    for _ in range(args.warmup):
        step()
    sync()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        step()
    sync()
    elapsed = (time.perf_counter() - start) / args.iters
    return max(comm.allgather(elapsed))


def _arrays(shapes: list[tuple[int, ...]], on_gpu: bool, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    if not on_gpu:
        return host
    from mpigpu._cuda import cupy

    return [cupy().asarray(a) for a in host]


def measure_fusion(args: argparse.Namespace, ctx: Any, on_gpu: bool, sync: Callable[[], Any]) -> dict[str, Any]:
    """Per-tensor allreduces, one flat allreduce, and the Averager, on the ResNet-50 shapes."""
    from mpigpu.api import allreduce
    from mpigpu.averager import Averager

    comm, backend = ctx.comm, args.backend
    shapes = resnet50_shapes(args.scale)
    arrays = _arrays(shapes, on_gpu, ctx.rank)
    count = sum(int(np.prod(s)) for s in shapes)
    flat = _arrays([(count,)], on_gpu, ctx.rank)[0]
    times: dict[str, float] = {}
    times["per_tensor"] = _step_time(lambda: [allreduce(a, backend=backend) for a in arrays], args, comm, sync)
    times["flat"] = _step_time(lambda: allreduce(flat, backend=backend), args, comm, sync)
    copying = Averager(arrays, bucket_bytes=args.bucket_bytes, backend=backend)
    times["averager_copy"] = _step_time(copying, args, comm, sync)
    viewing = Averager(_arrays(shapes, on_gpu, ctx.rank), bucket_bytes=args.bucket_bytes, backend=backend)
    viewing.bucket_views()  # the gradients live in the buckets: nothing to pack
    times["averager_views"] = _step_time(viewing, args, comm, sync)
    for kind in ("float16", "bfloat16"):
        compressed = Averager(arrays, bucket_bytes=args.bucket_bytes, compression=kind, backend=backend)
        times[f"averager_{kind}"] = _step_time(compressed, args, comm, sync)
        compressed.close()
    for averager in (copying, viewing):
        averager.close()
    return {
        "tensors": len(shapes),
        "parameters": count,
        "bucket_bytes": args.bucket_bytes,
        "buckets": len(copying.buckets),
        "seconds": times,
        "speedup_vs_per_tensor": times["per_tensor"] / times["averager_copy"],
        "speedup_vs_per_tensor_views": times["per_tensor"] / times["averager_views"],
        "speed_vs_flat": times["flat"] / times["averager_copy"],
        "speed_vs_flat_views": times["flat"] / times["averager_views"],
    }


def measure_overlap(args: argparse.Namespace, ctx: Any, on_gpu: bool, sync: Callable[[], Any]) -> dict[str, Any]:
    """Backward alone, backward then averaging, backward with hook-started averaging (PyTorch)."""
    import torch

    from mpigpu.averager import Averager
    from mpigpu.integrations.torch import BackwardAverager

    comm = ctx.comm
    device = torch.device("cuda", ctx.gpu.index) if on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(args.depth):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    x = torch.randn(args.batch, args.width, device=device)

    def backward() -> None:
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    plain = Averager(model.parameters(), bucket_bytes=args.overlap_bucket_bytes, backend=args.backend)

    def backward_then_average() -> None:
        backward()
        plain()

    hooked = BackwardAverager(model, bucket_bytes=args.overlap_bucket_bytes, backend=args.backend)

    def backward_overlapped() -> None:
        backward()
        hooked.finish()

    with hooked.no_sync():  # the hooks stay idle while the first two are timed
        t_backward = _step_time(backward, args, comm, sync)
        t_sequential = _step_time(backward_then_average, args, comm, sync)
    plain.close()
    t_overlapped = _step_time(backward_overlapped, args, comm, sync)
    hooked.close()
    communication = t_sequential - t_backward
    hidden = (t_sequential - t_overlapped) / communication if communication > 0 else float("nan")
    return {
        "model": f"MLP {args.depth} x Linear({args.width}, {args.width}), batch {args.batch}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "buckets": len(hooked.buckets),
        "seconds": {"backward": t_backward, "backward_then_average": t_sequential, "overlapped": t_overlapped},
        "communication_s": communication,
        "hidden_fraction": hidden,
    }


def measure_accuracy(args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    """Compressed averaging against float32 averaging and a float64 reference, on the host."""
    from mpigpu.api import allreduce
    from mpigpu.averager import Averager

    shapes = resnet50_shapes(args.scale)
    rng = np.random.default_rng(100 + ctx.rank)
    scales = np.random.default_rng(1).uniform(-6, -1, len(shapes))  # the same per-tensor scale on every rank
    grads = [(rng.standard_normal(s) * 10**e).astype(np.float32) for s, e in zip(shapes, scales, strict=True)]
    reference = [allreduce(g.astype(np.float64), "avg", backend="cpu") for g in grads]
    report: dict[str, Any] = {"gradient_scales": "N(0,1) * 10**u, u uniform in [-6, -1] per tensor"}
    for kind in (None, "float16", "bfloat16"):
        values = [g.copy() for g in grads]
        Averager(values, compression=kind, bucket_bytes=args.bucket_bytes).__call__()
        worst, num, den = 0.0, 0.0, 0.0
        for got, ref in zip(values, reference, strict=True):
            err = got.astype(np.float64) - ref
            worst = max(worst, float(np.abs(err).max() / max(np.abs(ref).max(), 1e-300)))
            num += float(np.square(err).sum())
            den += float(np.square(ref).sum())
        report[kind or "float32"] = {"max_rel_error_per_tensor": worst, "rel_l2_error": (num / den) ** 0.5}
    return report


# -- the command ----------------------------------------------------------------------------------
def build_parser() -> Parser:
    parser = Parser(
        prog=prog("mpigpu.bench_training"),
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto", help="default: GPU if present")
    parser.add_argument("--backend", default="auto", help="backend for every allreduce (default auto)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the ResNet-50 tensors (default 1 = full)")
    parser.add_argument("--bucket-bytes", default="128M", help="Averager bucket cap (default 128M)")
    parser.add_argument("--overlap-bucket-bytes", default="25M", help="bucket cap for the overlap test (25M)")
    parser.add_argument("--width", type=positive_int, default=4096, help="overlap MLP width (default 4096)")
    parser.add_argument("--depth", type=positive_int, default=8, help="overlap MLP layers (default 8)")
    parser.add_argument("--batch", type=positive_int, default=1024, help="overlap MLP batch (default 1024)")
    parser.add_argument("--skip", choices=["fusion", "overlap"], action="append", default=[], help="skip a part")
    parser.add_argument("--accuracy", action="store_true", help="also measure compression accuracy (host)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    return parser


def _print_report(results: dict[str, Any]) -> None:
    fusion = results.get("fusion")
    if fusion:
        t = fusion["seconds"]
        print(f"# fusion: {fusion['tensors']} float32 tensors, {fusion['parameters']} parameters, "
              f"{fusion['buckets']} bucket(s) of <= {fusion['bucket_bytes']}")  # fmt: skip
        for name, seconds in t.items():
            print(f"  {name:<20} {seconds * 1e3:10.3f} ms per step")
        print(f"  Averager vs one allreduce per tensor: {fusion['speedup_vs_per_tensor']:.1f}x faster "
              f"({fusion['speedup_vs_per_tensor_views']:.1f}x with bucket views; target >= 10x)")  # fmt: skip
        print(f"  Averager vs one flat allreduce: {fusion['speed_vs_flat']:.2f}x its speed "
              f"({fusion['speed_vs_flat_views']:.2f}x with bucket views; target >= 0.9x)")  # fmt: skip
    overlap = results.get("overlap")
    if overlap:
        t = overlap["seconds"]
        print(f"# overlap: {overlap['model']}, {overlap['parameters']} parameters, {overlap['buckets']} buckets")
        for name, seconds in t.items():
            print(f"  {name:<22} {seconds * 1e3:10.3f} ms per step")
        print(f"  communication {overlap['communication_s'] * 1e3:.3f} ms per step; hidden behind backward(): "
              f"{overlap['hidden_fraction'] * 100:.0f}%")  # fmt: skip
    accuracy = results.get("accuracy")
    if accuracy:
        print(f"# compression accuracy against a float64 average ({accuracy['gradient_scales']})")
        for kind in ("float32", "float16", "bfloat16"):
            a = accuracy[kind]
            print(f"  {kind:<9} max relative error per tensor {a['max_rel_error_per_tensor']:.3e}, "
                  f"relative L2 error {a['rel_l2_error']:.3e}")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from mpigpu._mpi import world
    from mpigpu.config import parse_count
    from mpigpu.context import Context
    from mpigpu.errors import InvalidArgument
    from mpigpu.harness import placements

    args.bucket_bytes = parse_count(args.bucket_bytes, what="--bucket-bytes")
    args.overlap_bucket_bytes = parse_count(args.overlap_bucket_bytes, what="--overlap-bucket-bytes")
    ctx = Context.get(world())
    try:
        on_gpu = placements(ctx, args.device, auto_both=False) == [True]
    except InvalidArgument as exc:  # every rank alike: the GPUs are agreed at start-up
        return refuse("mpigpu.bench_training", exc, ctx.rank)
    sync: Callable[[], Any] = ctx.activate_gpu().sync if on_gpu else (lambda: None)
    lines = header_lines(ctx)
    if ctx.rank == 0:
        print("\n".join(lines))
        print(f"# {'GPU' if on_gpu else 'host'} memory, backend {args.backend}, {args.iters} steps after {args.warmup}")
        sys.stdout.flush()
    results: dict[str, Any] = {}
    if "fusion" not in args.skip:
        results["fusion"] = measure_fusion(args, ctx, on_gpu, sync)
    if "overlap" not in args.skip:
        try:
            import torch  # noqa: F401
        except ImportError:
            results["overlap"] = None
            if ctx.rank == 0:
                print("# overlap: skipped, PyTorch is not installed")
        else:
            results["overlap"] = measure_overlap(args, ctx, on_gpu, sync)
    if args.accuracy:
        results["accuracy"] = measure_accuracy(args, ctx)
    if ctx.rank == 0:
        _print_report(results)
        if args.json is not None:
            document = {"header": lines, "ranks": ctx.size, "placement": "gpu" if on_gpu else "host",
                        "backend": args.backend, "versions": versions(), "date": now(), **results}  # fmt: skip
            write_json(args.json, document)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_command(build_parser(), argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
