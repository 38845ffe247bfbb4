"""``mpiexec -n N python -m mpigpu.bench.training``: gradient averaging the way training does it.

1. Fusion, on a ResNet-50-shaped gradient list (161 float32 tensors, 25,557,032 parameters): the
   Averager (packing copies; and with the gradients living in its buckets) against one allreduce
   per tensor and against one flat allreduce of the same bytes (mean per step, slowest rank).
2. Training step (PyTorch), ``--model mlp|resnet50|gpt2``: forward, backward, averaging and SGD
   with momentum (bf16 autocast on a GPU), with no communication, with DistributedDataParallel (NCCL
   on GPUs, gloo on the host) as the anchor (trained twice: the second run's difference to the
   first is DDP's own run-to-run noise), with BackwardAverager, with the Averager after backward,
   and with mpigpu.horovod's DistributedOptimizer; every row from the same parameters, data and
   seeds, all alive at once and interleaved round by round. Median ms per step over the rounds and
   their spread (slowest rank), the cost over no communication, the fraction of the communication
   BackwardAverager hides behind backward(), and the largest parameter difference to DDP after the
   steps (exit status 1 if an mpigpu row is outside --tolerance and larger than DDP's noise; with
   ``--deterministic``, deterministic kernels and a bitwise check). On a GPU, also every step on the GPU's
   clock, each method paired with no communication round by round (``gpu_overhead_s``: mpigpu.bench.gpu_clock).
3. ``--accuracy``: float16 and bfloat16 compression against float32 averaging, on the same
   gradient list filled with Gaussian values whose scale differs per tensor (1e-6 .. 1e-1).

ResNet-50 needs torchvision, GPT-2 transformers (both built from a seed, no downloads): a model
named in --model that cannot be built is refused (exit status 2), one in ``--model all`` is skipped.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mpigpu.bench.gpu_clock import StepClock, gpu_figures, gpu_lines, paired_overhead, spread
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
    from mpigpu.core._cuda import cupy

    return [cupy().asarray(a) for a in host]


def measure_fusion(args: argparse.Namespace, ctx: Any, on_gpu: bool, sync: Callable[[], Any]) -> dict[str, Any]:
    """Per-tensor allreduces, one flat allreduce, and the Averager, on the ResNet-50 shapes."""
    from mpigpu.calls.reduce import allreduce
    from mpigpu.training.averager import Averager

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


# the table's order; "ddp_repeat" trains DDP a second time: its difference to the first is DDP's own run-to-run noise
ROWS = ("none", "ddp", "ddp_repeat", "backward_averager", "averager_after", "distributed_optimizer")
_AVERAGING = ("backward_averager", "averager_after", "distributed_optimizer")  # mpigpu's rows, verified


def _largest_difference(params: list[Any], reference: list[Any]) -> float:
    """max |p - q| over all parameters (inf if any is not finite)."""
    import torch

    worst = 0.0
    for p, q in zip(params, reference, strict=True):
        d = (p.detach().float() - q.float()).abs().max()
        if not bool(torch.isfinite(d)):
            return math.inf
        worst = max(worst, float(d))
    return worst


class _Row:
    """One configuration of the table, alive for the whole measurement: its own copy of the model, its
    optimizer, its wrapper or averager, and its own random state (so that interleaved with the others,
    its k-th step draws the dropout masks DDP's k-th step draws)."""

    def __init__(self, row: str, made: Any, args: argparse.Namespace, comm: Any, on_gpu: bool) -> None:
        import copy

        import torch

        from mpigpu.training.averager import Averager
        from mpigpu.training.torch import BackwardAverager

        self.name, self.on_gpu = row, on_gpu
        torch.manual_seed(args.seed + comm.Get_rank())  # dropout (GPT-2): the same masks in every row
        self._rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state() if on_gpu else None
        self.model = copy.deepcopy(made.module)
        wrapped = self.model
        if row in ("ddp", "ddp_repeat"):
            ids = [torch.cuda.current_device()] if on_gpu else None
            wrapped = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.hooked = self.after = None
        if row == "backward_averager":
            self.hooked = BackwardAverager(
                self.model, optimizer=optimizer, bucket_bytes=args.overlap_bucket_bytes, backend=args.backend
            )
        elif row == "averager_after":
            self.after = Averager(self.model, bucket_bytes=args.bucket_bytes, backend=args.backend)
        elif row == "distributed_optimizer":  # as a Horovod script writes it (hvd.init ran in _train_models)
            import mpigpu.horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=self.model.named_parameters())
            self.hooked = optimizer._hvd_overlap  # its BackwardAverager (op Average, one backward per step)
        self._wrapped, self._optimizer, self._made, self._set_to_none = wrapped, optimizer, made, args.set_to_none
        self.clock = StepClock() if on_gpu else None  # each step on the GPU's clock (mpigpu.bench.gpu_clock)
        self.gpu_steps: list[float] = []  # the last steps() call's, one per step

    @property
    def buckets(self) -> int:
        averaging = self.hooked or self.after
        return len(averaging.buckets) if averaging is not None else 0

    def _step(self) -> None:
        import torch

        self._optimizer.zero_grad(set_to_none=self._set_to_none)
        if self.clock is not None:
            self.clock.start()  # before the first forward kernel
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.on_gpu):
            loss = self._made.loss(self._wrapped, self._made.inputs)
        loss.backward()  # BackwardAverager: buckets are averaged while this runs
        if self.after is not None:
            self.after()
        self._optimizer.step()  # BackwardAverager: its finish() runs first (the optimizer hook)
        if self.clock is not None:
            self.clock.stop()  # after the optimizer's last kernel

    def steps(self, n: int) -> float:
        """Run ``n`` steps with this row's random state; seconds per step on this rank (CUDA events on the
        compute stream around the n steps, no host synchronisation between them; the host clock on CPU)."""
        import torch

        torch.set_rng_state(self._rng)
        if self._cuda_rng is not None:
            torch.cuda.set_rng_state(self._cuda_rng)
        if self.on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                self._step()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            assert self.clock is not None
            self.gpu_steps = self.clock.take()
        else:
            begin = time.perf_counter()
            for _ in range(n):
                self._step()
            seconds = time.perf_counter() - begin
        self._rng = torch.get_rng_state()
        if self._cuda_rng is not None:
            self._cuda_rng = torch.cuda.get_rng_state()
        return seconds / max(n, 1)

    def close(self) -> None:
        for averaging in (self.hooked, self.after):
            if averaging is not None:
                averaging.close()


def round_order(rows: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The rows in the order round ``round_index`` runs them: forward, then backward, alternately (ABC CBA
    ABC ...), so that no row always follows the same one or always runs first on a warming machine."""
    return rows if round_index % 2 == 0 else tuple(reversed(rows))


def _verdict(difference: float, tolerance: float, noise: float, deterministic: bool = False) -> str | None:
    """How an mpigpu row's largest difference to DDP passes, or None (it fails).

    --deterministic: "bitwise" (exactly DDP's parameters), and only while DDP trained twice is itself
    bitwise the same (otherwise determinism was not achieved and no row can be checked). Otherwise:
    "tolerance" (within --tolerance x max |p|) or "ddp_noise" (not larger than DDP's own difference
    between two identical runs: the model's backward is not deterministic, so no averaging can match
    DDP more closely)."""
    if deterministic:
        return "bitwise" if noise == 0 and difference == 0 else None
    if difference <= tolerance:
        return "tolerance"
    if difference <= noise:
        return "ddp_noise"
    return None


def _deterministic(args: argparse.Namespace) -> None:
    """--deterministic: deterministic kernels from here on (cuBLAS's workspace setting must precede its
    first handle, so this runs before the models are built). Attention runs as plain matrix products (the
    cuDNN, flash and memory-efficient attention kernels are not deterministic), and an op with no
    deterministic version raises, naming itself: the check is then never a matter of chance."""
    import os

    if not args.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except ImportError:
        return  # no training step: _models says so in one line
    for name in ("enable_cudnn_sdp", "enable_flash_sdp", "enable_mem_efficient_sdp"):
        switch = getattr(torch.backends.cuda, name, None)
        if switch is not None:
            switch(False)
    torch.use_deterministic_algorithms(True)


def measure_training(args: argparse.Namespace, ctx: Any, on_gpu: bool, name: str) -> dict[str, Any]:
    """One training step of model ``name`` (forward, backward, averaging, SGD with momentum; bf16
    autocast on a GPU) without communication, with DDP, with BackwardAverager, with the Averager after
    backward and with hvd.DistributedOptimizer: every row from the same parameters, on the same data,
    with the same seeds, all alive at once and interleaved: after each row's warm-up, ``--rounds`` rounds
    in which every row runs ``--iters`` steps, in alternating order (a shared machine's slow moments fall
    on every row alike). Per row: each round's seconds per step (slowest rank), their median and spread."""
    import torch

    from mpigpu.bench.models import build
    from mpigpu.training.torch import DDP_BUCKET_BYTES

    device = torch.device("cuda", ctx.gpu.index) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    comm = ctx.comm.Dup()  # the benchmark's own collectives never pair with mpigpu's
    rows: dict[str, _Row] = {}
    try:
        made = build(name, args, device, ctx.rank)
        for row in ROWS:
            rows[row] = _Row(row, made, args, comm, on_gpu)
        for row in ROWS:
            rows[row].steps(args.warmup)
        rounds: dict[str, list[float]] = {row: [] for row in ROWS}
        gpu_rounds: dict[str, list[float]] = {row: [] for row in ROWS}  # each step on the GPU's clock, the mean
        for index in range(args.rounds):
            for row in round_order(ROWS, index):
                comm.Barrier()
                seconds = rows[row].steps(args.iters)
                gpu = statistics.fmean(rows[row].gpu_steps) if on_gpu else 0.0
                slowest = [max(each) for each in zip(*comm.allgather((seconds, gpu)), strict=True)]
                rounds[row].append(slowest[0])  # the slowest rank's
                gpu_rounds[row].append(slowest[1])
        buckets = {row: rows[row].buckets for row in _AVERAGING}
        reference = [p.detach().clone() for p in rows["ddp"].model.parameters()]
        difference = {
            row: max(comm.allgather(_largest_difference(list(rows[row].model.parameters()), reference))) for row in ROWS
        }
        scale = max(comm.allgather(max(float(p.abs().max()) for p in reference)))
    finally:
        for each in rows.values():
            each.close()
        rows.clear()
        gc.collect()  # every row's model (and DDP, while its process group still exists) before the next model
        comm.Free()
    median = {row: statistics.median(rounds[row]) for row in ROWS}
    mean = {row: statistics.fmean(rounds[row]) for row in ROWS}
    paired = paired_overhead(rounds)
    overhead = {row: statistics.median(paired[row]) for row in ROWS}
    communication = overhead["averager_after"]
    hidden = (communication - overhead["backward_averager"]) / communication if communication > 0 else None
    tolerance = args.tolerance * scale
    noise = difference["ddp_repeat"]
    verdicts = {row: _verdict(difference[row], tolerance, noise, args.deterministic) for row in _AVERAGING}
    return {
        "model": name,
        "description": made.description,
        "parameters": sum(p.numel() for p in made.module.parameters() if p.requires_grad),
        "optimizer": f"SGD lr {args.lr} momentum 0.9, zero_grad(set_to_none={args.set_to_none})",
        "autocast": "bfloat16" if on_gpu else None,
        "deterministic": bool(args.deterministic),
        "ddp_backend": "nccl" if on_gpu else "gloo",
        "mpigpu_backend": args.backend,
        "steps": {
            "warmup": args.warmup,
            "rounds": args.rounds,
            "per_round": args.iters,
            "timed": args.rounds * args.iters,
            "order": "rows alternately forward and backward per round",
        },
        "buckets": buckets,
        "bucket_bytes": {
            "backward_averager": args.overlap_bucket_bytes,
            "averager_after": args.bucket_bytes,
            "distributed_optimizer": DDP_BUCKET_BYTES,
        },
        "seconds": median,  # per step: the median over rounds of each round's mean, slowest rank
        "mean_seconds": mean,
        "round_seconds": rounds,
        "spread_seconds": {row: spread(rounds[row]) for row in ROWS},
        "overhead_s": overhead,  # per step over no communication: the median over rounds of the paired difference
        "round_overhead_s": paired,
        "overhead_spread_s": {row: spread(paired[row]) for row in ROWS},
        "communication_s": communication,
        "hidden_fraction": hidden,
        **gpu_figures(gpu_rounds if on_gpu else None, "no GPU: the steps ran on the host's clock only"),
        "overhead_vs_ddp": {
            row: (overhead[row] / overhead["ddp"] if overhead["ddp"] > 0 else None) for row in _AVERAGING
        },
        "max_param_difference": difference,
        "param_scale": scale,
        "tolerance": tolerance,
        "ddp_noise": noise,  # max |p - p_DDP| of DDP trained again the same way
        "verified_by": verdicts,
        "verified": {row: verdicts[row] is not None for row in _AVERAGING},
    }


def measure_accuracy(args: argparse.Namespace, ctx: Any) -> dict[str, Any]:
    """Compressed averaging against float32 averaging and a float64 reference, on the host."""
    from mpigpu.calls.reduce import allreduce
    from mpigpu.training.averager import Averager

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
        prog=prog("mpigpu.bench.training"),
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:5]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto", help="default: GPU if present")
    parser.add_argument("--backend", default="auto", help="backend of mpigpu's allreduces (default auto)")
    parser.add_argument("--iters", type=positive_int, default=20,
                        help="timed steps (default 20): the fusion part's in all, the training step's per "
                        "round")  # fmt: skip
    parser.add_argument("--warmup", type=nonneg_int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--skip", choices=["fusion", "step"], action="append", default=[], help="skip a part")
    parser.add_argument("--accuracy", action="store_true", help="also measure compression accuracy (host)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    fusion = parser.add_argument_group("fusion (the ResNet-50 gradient list)")
    fusion.add_argument("--scale", type=float, default=1.0, help="shrink the ResNet-50 tensors (default 1 = full)")
    fusion.add_argument("--bucket-bytes", default="128M", help="Averager bucket cap, also for the step (128M)")
    step = parser.add_argument_group("training step")
    step.add_argument("--model", type=_model_list, default=None,
                      help="mlp, resnet50, gpt2, a comma list, or all (default mlp); an explicitly named model "
                      "that cannot be built here is refused (exit 2), 'all' skips it with one line")  # fmt: skip
    step.add_argument("--rounds", type=positive_int, default=5,
                      help="rounds of --iters steps per row, the rows interleaved, alternately forward and backward "
                      "(default 5): the median and spread over rounds are reported")  # fmt: skip
    step.add_argument("--overlap-bucket-bytes", default="25M", help="BackwardAverager bucket cap (default 25M)")
    step.add_argument("--width", type=positive_int, default=None, help="MLP width (default 4096 GPU, 256 host)")
    step.add_argument("--depth", type=positive_int, default=8, help="MLP layers (default 8)")
    step.add_argument("--batch", type=positive_int, default=None,
                      help="samples per rank (default: MLP 1024 GPU / 32 host, ResNet-50 64, GPT-2 8)")  # fmt: skip
    step.add_argument("--image-size", type=positive_int, default=224, help="ResNet-50 image side (default 224)")
    step.add_argument("--seq-len", type=positive_int, default=512, help="GPT-2 tokens per sample (default 512)")
    step.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9; default 0.01)")
    step.add_argument("--seed", type=nonneg_int, default=0, help="model and data seed (default 0)")
    step.add_argument("--set-to-none", action="store_true", help="zero_grad(set_to_none=True) (default: False)")
    step.add_argument("--tolerance", type=float, default=1e-5,
                      help="largest |p - p_DDP| allowed over max |p| (default 1e-5, the DDP test's); a larger "
                      "difference passes if DDP trained twice differs from itself at least as much")  # fmt: skip
    step.add_argument("--param-check", choices=("gate", "report"), default="gate",
                      help="gate (default): parameters outside the tolerance and DDP's run-to-run noise fail the "
                      "run; report: they are reported, not failed (a timing run with non-deterministic "
                      "kernels, whose check is a --deterministic run of the same model)")  # fmt: skip
    step.add_argument("--deterministic", action="store_true",
                      help="deterministic kernels (torch.use_deterministic_algorithms(True), "
                      "CUBLAS_WORKSPACE_CONFIG=:4096:8, attention as plain matrix products): an op with no "
                      "deterministic version raises; the check is then bitwise: every mpigpu row must end with "
                      "exactly DDP's parameters, and DDP trained twice with exactly its own")  # fmt: skip
    return parser


def _model_list(text: str) -> list[str]:
    """--model: ``all`` as it stands (its missing models are skipped), or a comma list of names."""
    from mpigpu.bench.models import MODELS

    names = [t.strip() for t in text.split(",") if t.strip()]
    for name in names:
        if name not in (*MODELS, "all") or (name == "all" and len(names) > 1):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODELS)}, a comma list, or all")
    if not names:
        raise argparse.ArgumentTypeError("empty list of models")
    return names


def _print_fusion(fusion: dict[str, Any]) -> None:
    t = fusion["seconds"]
    print(f"# fusion: {fusion['tensors']} float32 tensors, {fusion['parameters']} parameters, "
          f"{fusion['buckets']} bucket(s) of <= {fusion['bucket_bytes']}")  # fmt: skip
    for name, seconds in t.items():
        print(f"  {name:<20} {seconds * 1e3:10.3f} ms per step")
    print(f"  Averager vs one allreduce per tensor: {fusion['speedup_vs_per_tensor']:.1f}x faster "
          f"({fusion['speedup_vs_per_tensor_views']:.1f}x with bucket views; target >= 10x)")  # fmt: skip
    print(f"  Averager vs one flat allreduce: {fusion['speed_vs_flat']:.2f}x its speed "
          f"({fusion['speed_vs_flat_views']:.2f}x with bucket views; target >= 0.9x)")  # fmt: skip


def _print_training(r: dict[str, Any]) -> None:
    wire = f"{r['autocast']} autocast" if r["autocast"] else "float32"
    steps = r["steps"]
    print(f"# training step: {r['description']}; {r['parameters']:,} parameters; {r['optimizer']}; {wire}")
    print(f"#   ms per step: the median over {steps['rounds']} rounds of {steps['per_round']} steps (each round's "
          f"mean, slowest rank; rows interleaved, alternately forward and backward), the rounds' min-max; "
          f"vs none: the median over rounds of the row's time minus no communication's in the same round, and "
          f"that difference's min-max; parameters compared with DDP's after all "
          f"{steps['warmup'] + steps['timed']} steps")  # fmt: skip
    labels = {
        "none": "no communication",
        "ddp": f"DDP ({r['ddp_backend']}, defaults)",
        "ddp_repeat": "DDP again (its run-to-run noise)",
        "backward_averager": f"BackwardAverager, {r['buckets']['backward_averager']} bucket(s)",
        "averager_after": f"Averager after backward, {r['buckets']['averager_after']} bucket(s)",
        "distributed_optimizer": f"hvd.DistributedOptimizer, {r['buckets']['distributed_optimizer']} bucket(s)",
    }
    failed = "FAIL: outside the tolerance and DDP's run-to-run noise"
    if r["deterministic"]:
        failed = ("FAIL: not bitwise DDP's" if r["ddp_noise"] == 0 else
                  "FAIL: DDP differs from itself: determinism was not achieved")  # fmt: skip
    verdicts = {
        "bitwise": "ok (bitwise DDP's)",
        "tolerance": "ok (within the tolerance)",
        "ddp_noise": "ok (outside the tolerance, within DDP's own run-to-run noise)",
        None: failed,
    }
    print(f"  {'':<38} {'ms/step':>9} {'min-max':>17} {'vs none':>9} {'min-max':>17}   max |p - p_DDP|")
    for row in ROWS:
        d = r["max_param_difference"][row]
        if row == "ddp":
            verdict = "(the reference)"
        elif row == "ddp_repeat":
            verdict = "(the noise floor)"
        elif row == "none":
            verdict = "(not averaged)"
        else:
            verdict = verdicts[r["verified_by"][row]]
        low, high = (v * 1e3 for v in r["spread_seconds"][row])
        over_low, over_high = (v * 1e3 for v in r["overhead_spread_s"][row])
        print(f"  {labels[row]:<38} {r['seconds'][row] * 1e3:9.3f} {low:8.3f}-{high:<8.3f} "
              f"{r['overhead_s'][row] * 1e3:+9.3f} {over_low:+8.3f}/{over_high:<+8.3f}   "
              f"{d:.2e} {verdict}")  # fmt: skip
    for line in gpu_lines(r, labels):
        print(line)
    hidden = r["hidden_fraction"]
    hidden_text = f"{hidden * 100:.0f}%" if hidden is not None else "n/a (no communication cost measured)"
    print(f"  communication {r['communication_s'] * 1e3:.3f} ms per step (Averager after backward - no "
          f"communication); hidden by BackwardAverager: {hidden_text}")  # fmt: skip
    ratios = r["overhead_vs_ddp"]
    if ratios["backward_averager"] is not None:
        print(f"  cost over no communication, relative to DDP's: BackwardAverager {ratios['backward_averager']:.2f}x, "
              f"Averager after backward {ratios['averager_after']:.2f}x, "
              f"DistributedOptimizer {ratios['distributed_optimizer']:.2f}x")  # fmt: skip
    relative = r["tolerance"] / r["param_scale"]
    mode = " (deterministic algorithms: the check is bitwise)" if r["deterministic"] else ""
    print(f"  tolerance {r['tolerance']:.2e} (= {relative:.0e} x max |p| {r['param_scale']:.3f}); "
          f"DDP's run-to-run noise {r['ddp_noise']:.2e}{mode}")  # fmt: skip


def _print_report(results: dict[str, Any]) -> None:
    if results.get("fusion"):
        _print_fusion(results["fusion"])
    for r in results.get("training") or []:
        _print_training(r)
    accuracy = results.get("accuracy")
    if accuracy:
        print(f"# compression accuracy against a float64 average ({accuracy['gradient_scales']})")
        for kind in ("float32", "float16", "bfloat16"):
            a = accuracy[kind]
            print(f"  {kind:<9} max relative error per tensor {a['max_rel_error_per_tensor']:.3e}, "
                  f"relative L2 error {a['rel_l2_error']:.3e}")  # fmt: skip


def _models(args: argparse.Namespace, comm: Any, rank: int) -> tuple[list[str], list[str], str | None]:
    """(models to train, one line per model skipped, the refusal if a model named explicitly cannot
    be built). Every rank decides alike: a model counts as missing if it is missing on any rank."""
    from mpigpu.bench.models import MODELS, missing

    if "step" in args.skip:
        return [], [], None
    asked = args.model or ["mlp"]
    names = list(MODELS) if "all" in asked else list(dict.fromkeys(asked))
    gaps = comm.allgather({name: missing(name) for name in names})
    problems = {name: next((g[name] for g in gaps if g[name]), None) for name in names}
    explicit = args.model is not None and "all" not in asked
    for name in names:
        if problems[name] and explicit:
            return [], [], problems[name]
    skipped = [f"# training step: {name} skipped: {problems[name]}" for name in names if problems[name]]
    return [n for n in names if not problems[n]], skipped, None


def run(args: argparse.Namespace) -> int:
    from mpigpu.bench.harness import placements
    from mpigpu.core._mpi import world
    from mpigpu.core.config import parse_count
    from mpigpu.core.errors import InvalidArgument
    from mpigpu.runtime.context import Context

    args.bucket_bytes = parse_count(args.bucket_bytes, what="--bucket-bytes")
    args.overlap_bucket_bytes = parse_count(args.overlap_bucket_bytes, what="--overlap-bucket-bytes")
    if "step" not in args.skip:
        _deterministic(args)  # before anything touches CUDA
    ctx = Context.get(world())
    try:
        on_gpu = placements(ctx, args.device, auto_both=False) == [True]
    except InvalidArgument as exc:  # every rank alike: the GPUs are agreed at start-up
        return refuse("mpigpu.bench.training", exc, ctx.rank)
    models, skipped, refusal = _models(args, ctx.comm, ctx.rank)
    if refusal:
        return refuse("mpigpu.bench.training", refusal, ctx.rank)
    args.width = args.width or (4096 if on_gpu else 256)
    sync: Callable[[], Any] = ctx.activate_gpu().sync if on_gpu else (lambda: None)
    lines = header_lines(ctx)
    if ctx.rank == 0:
        print("\n".join(lines))
        print(f"# {'GPU' if on_gpu else 'host'} memory, backend {args.backend}, {args.iters} steps after {args.warmup}")
        for line in skipped:
            print(line)
        sys.stdout.flush()
    results: dict[str, Any] = {}
    if "fusion" not in args.skip:
        results["fusion"] = measure_fusion(args, ctx, on_gpu, sync)
    if models:
        results["training"] = _train_models(args, ctx, on_gpu, models)
    if args.accuracy:
        results["accuracy"] = measure_accuracy(args, ctx)
    failed = [r["model"] for r in results.get("training", []) if not all(r["verified"].values())]
    if failed and args.param_check == "report" and ctx.rank == 0:
        print(f"# parameters differ from DDP's beyond its run-to-run noise for {', '.join(failed)}: reported, "
              "not failed (--param-check report: a --deterministic run of the same model is the check)")  # fmt: skip
    if args.param_check == "report":
        failed = []
    if ctx.rank == 0:
        _print_report(results)
        if failed:
            print(f"# FAIL: parameters differ from DDP's by more than the tolerance for {', '.join(failed)}")
        if args.json is not None:
            document = {"header": lines, "ranks": ctx.size, "placement": "gpu" if on_gpu else "host",
                        "backend": args.backend, "versions": versions(), "date": now(),
                        "skipped": skipped, **results}  # fmt: skip
            write_json(args.json, document)
    return 1 if failed else 0


def _train_models(args: argparse.Namespace, ctx: Any, on_gpu: bool, models: list[str]) -> list[dict[str, Any]]:
    """measure_training for each model, inside one torch.distributed process group (for DDP) and
    with mpigpu.horovod started on the same communicator (for DistributedOptimizer)."""
    import torch.distributed as dist

    import mpigpu.horovod.torch as hvd
    from mpigpu.bench.models import init_torch_distributed

    init_torch_distributed(ctx.comm, "nccl" if on_gpu else "gloo")
    hvd.init(ctx.comm)
    try:
        return [measure_training(args, ctx, on_gpu, name) for name in models]
    finally:
        gc.collect()
        hvd.shutdown()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_command(build_parser(), argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
