"""Horovod's synthetic benchmark on mpigpu's Horovod layer beside DDP, the runs alternated (issue 37).

    scripts/hvd-suite.sh HOROVOD_CHECKOUT        # once: .hvd-suite/ holds Horovod's benchmark and the alias
    python scripts/hvd_synthetic.py --runs 3 --json synthetic.json
    python scripts/hvd_synthetic.py --launcher "mpirun --bind-to none" -n 2 --num-iters 5

Two sides, each a job of -n ranks started by --launcher, with the same benchmark options:

  hvd  LAUNCHER -n N python -m mpigpu.run .hvd-suite/examples/pytorch/pytorch_synthetic_benchmark.py OPTIONS
       Horovod's own file, unchanged; the alias package in .hvd-suite makes its ``import horovod.torch``
       mpigpu.horovod.torch (hvd.DistributedOptimizer, broadcast_parameters, ...)
  ddp  LAUNCHER -n N python -m mpigpu.bench.synthetic OPTIONS
       the same measurement with torch's DistributedDataParallel (NCCL; gloo on the host), started from MPI

Run order: hvd, ddp, then ddp, hvd, then hvd, ddp, ... (--runs pairs), so that neither side always runs
first or on a warmer machine. Each run's total img/sec (the line ``Total img/sec on N GPU(s): X +-C`` both
print) is parsed; each pair gives the ratio hvd/ddp. The goal (issue 37): hvd >= 1.1 x ddp in float32 in
every pair; it is reported, not asserted. --json writes the machine, versions, date, options, every run
(its iterations' img/sec, its output) and every pair's ratio with the verdict.

Both sides build the model as ``torchvision.models.<--model>()`` (Horovod's file imports
torchvision.models): without torchvision the driver stops before any run and says so (exit status 2).
Exit status: 0 when every run completed and printed its figures, 1 otherwise, 2 for what stops all runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mpigpu.cli import gpu_names, nonneg_int, now, positive_int, seconds_arg, versions, write_json

DRIVER = Path(__file__).resolve()
ROOT = DRIVER.parent.parent
HVD_SCRIPT = Path("examples/pytorch/pytorch_synthetic_benchmark.py")  # inside the suite folder
GOAL = 1.1  # issue 37: hvd's img/sec at least 1.1 x DDP's, float32, every run
SIDES = ("hvd", "ddp")
TAIL_LINES = 25

_ITER = re.compile(r"^Iter #(\d+): ([0-9.]+) img/sec per (\w+)\s*$", re.M)
_PER_DEVICE = re.compile(r"^Img/sec per (\w+): ([0-9.]+) \+-([0-9.]+)\s*$", re.M)
_TOTAL = re.compile(r"^Total img/sec on (\d+) (\w+)\(s\): ([0-9.]+) \+-([0-9.]+)\s*$", re.M)


def parse_output(text: str) -> dict[str, Any]:
    """The figures a run printed: each iteration's img/sec per device, the mean per device and the total,
    each with its +- (1.96 standard deviations). ValueError naming what is missing."""
    iters = [float(m.group(2)) for m in _ITER.finditer(text)]
    per_device, total = _PER_DEVICE.search(text), _TOTAL.search(text)
    missing = [what for what, found in (("'Iter #' lines", iters), ("'Img/sec per' line", per_device),
                                        ("'Total img/sec' line", total)) if not found]  # fmt: skip
    if missing or per_device is None or total is None:
        raise ValueError(f"the output lacks the {', the '.join(missing)}")
    return {
        "device": total.group(2),
        "ranks": int(total.group(1)),
        "iter_img_s": iters,
        "img_s_per_device": float(per_device.group(2)),
        "conf_per_device": float(per_device.group(3)),
        "total_img_s": float(total.group(3)),
        "total_conf": float(total.group(4)),
    }


def schedule(pairs: int) -> list[tuple[int, str]]:
    """(pair, side) in run order: hvd, ddp, then ddp, hvd, alternately."""
    return [(pair, side) for pair in range(pairs) for side in (SIDES if pair % 2 == 0 else SIDES[::-1])]


def compare(runs: list[dict[str, Any]], fp16: bool) -> dict[str, Any]:
    """Each pair's totals and ratio hvd/ddp (None where a run of the pair failed), and the goal's verdict:
    met when every pair completed with a ratio >= GOAL; None (not applicable) for fp16 gradients."""
    pairs = []
    for pair in sorted({r["pair"] for r in runs}):
        totals = {r["side"]: (r["figures"] or {}).get("total_img_s") for r in runs if r["pair"] == pair}
        hvd, ddp = totals.get("hvd"), totals.get("ddp")
        ratio = hvd / ddp if hvd is not None and ddp else None
        pairs.append({"pair": pair, "hvd_total_img_s": hvd, "ddp_total_img_s": ddp, "ratio": ratio})
    ratios = [p["ratio"] for p in pairs]
    reached = sum(1 for r in ratios if r is not None and r >= GOAL)
    met = None if fp16 else bool(pairs) and reached == len(pairs)
    return {"pairs": pairs, "goal": {"ratio": GOAL, "every_pair": True, "float32_only": True,
                                     "pairs_reaching": reached, "met": met}}  # fmt: skip


def table(doc: dict[str, Any]) -> list[str]:
    """The printed report of a document made by ``main`` (or read back from its JSON)."""
    o, runs = doc["options"], doc["runs"]
    device = next((r["figures"]["device"] for r in runs if r["figures"]), "GPU")
    wire = "float16 gradients (fp16 allreduce)" if o["fp16_allreduce"] else "float32"
    lines = [
        f"# Horovod's {HVD_SCRIPT.name} (unchanged) on mpigpu.horovod.torch beside DDP (python -m "
        "mpigpu.bench.synthetic), alternated",
        f"# {o['model']} (torchvision {doc['torchvision']}), batch {o['batch_size']} per {device}, {wire}, "
        f"{doc['ranks']} ranks, {o['num_warmup_batches']} warm-up batches, {o['num_iters']} iterations of "
        f"{o['num_batches_per_iter']} batches; total img/sec, +- 1.96 std over the iterations",
        f"{'pair':>4}  {'order':<8} {'hvd img/s':>20} {'ddp img/s':>20} {'hvd/ddp':>8}",
    ]
    for pair in doc["pairs"]:
        cells, order = {}, []
        for run in runs:
            if run["pair"] != pair["pair"]:
                continue
            order.append(run["side"])
            f = run["figures"]
            cells[run["side"]] = f"{f['total_img_s']:.1f} +-{f['total_conf']:.1f}" if f else f"FAILED rc={run['rc']}"
        ratio = f"{pair['ratio']:.3f}" if pair["ratio"] is not None else "-"
        lines.append(f"{pair['pair'] + 1:>4}  {','.join(order):<8} {cells.get('hvd', '-'):>20} "
                     f"{cells.get('ddp', '-'):>20} {ratio:>8}")  # fmt: skip
    goal = doc["goal"]
    if goal["met"] is None:
        verdict = "not applicable (the goal is set for float32 gradients)"
    else:
        verdict = "met" if goal["met"] else "NOT met"
    lines.append(f"# goal (issue 37): hvd >= {goal['ratio']:g} x ddp in every pair: {verdict} "
                 f"({goal['pairs_reaching']} of {len(doc['pairs'])} pairs)")  # fmt: skip
    return lines


def closing_line(doc: dict[str, Any]) -> str:
    """One line: PASS when every run completed and printed its figures (else FAIL), the ratios, the goal."""
    done = sum(1 for r in doc["runs"] if r["figures"] is not None)
    ratios = ", ".join(f"{p['ratio']:.3f}" if p["ratio"] is not None else "-" for p in doc["pairs"])
    met = {True: "met", False: "NOT met", None: "n/a"}[doc["goal"]["met"]]
    return (f"# {'PASS' if doc['ok'] else 'FAIL'}: {done} of {len(doc['runs'])} runs completed; hvd/ddp per pair "
            f"{ratios}; goal >= {doc['goal']['ratio']:g} in every pair: {met}")  # fmt: skip


# -- running the sides ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{os.path.basename(sys.executable)} scripts/hvd_synthetic.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=positive_int, default=2, help="pairs of runs, one of each side (default 2)")
    parser.add_argument("-n", "--np", type=positive_int, default=2, dest="ranks", help="ranks of each run (default 2)")
    parser.add_argument("--launcher", default=os.environ.get("MPIRUN"),
                        help="the MPI launcher command line (default: $MPIRUN, else the mpiexec beside this "
                        "Python, else mpiexec on PATH)")  # fmt: skip
    parser.add_argument("--python", default=sys.executable, help="the Python of the runs (default: this one)")
    parser.add_argument("--suite", type=Path, default=ROOT / ".hvd-suite",
                        help="the folder scripts/hvd-suite.sh prepared (default .hvd-suite)")  # fmt: skip
    parser.add_argument("--timeout", type=seconds_arg, default=300, help="seconds a run may take (default 300)")
    parser.add_argument("--json", type=Path, help="write the machine, versions, runs and verdict as JSON here")
    bench = parser.add_argument_group("the benchmark's options, passed to both sides")
    bench.add_argument("--model", default="resnet50", help="a model of torchvision.models (default resnet50)")
    bench.add_argument("--batch-size", type=positive_int, default=32, help="images per rank and step (default 32)")
    bench.add_argument("--num-warmup-batches", type=nonneg_int, default=10, help="untimed steps first (default 10)")
    bench.add_argument("--num-batches-per-iter", type=positive_int, default=10, help="steps per iteration (default 10)")
    bench.add_argument("--num-iters", type=positive_int, default=10, help="timed iterations (default 10)")
    bench.add_argument("--no-cuda", action="store_true", help="train on the host")
    bench.add_argument("--fp16-allreduce", action="store_true", help="float16 gradients on the wire")
    return parser


def _launcher(given: str | None) -> list[str]:
    if given:
        return shlex.split(given)
    beside = Path(sys.executable).parent / "mpiexec"
    return [str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"]


def _bench_options(args: argparse.Namespace) -> list[str]:
    options = [f"--model={args.model}", f"--batch-size={args.batch_size}",
               f"--num-warmup-batches={args.num_warmup_batches}", f"--num-batches-per-iter={args.num_batches_per_iter}",
               f"--num-iters={args.num_iters}"]  # fmt: skip
    flags = (("--no-cuda", args.no_cuda), ("--fp16-allreduce", args.fp16_allreduce))
    return options + [flag for flag, on in flags if on]


def _env(*front: Path) -> dict[str, str]:
    """This environment with ``front`` (and this checkout, whose mpigpu the runs use) first on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(p) for p in (*front, ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _end(proc: subprocess.Popen[str]) -> str:
    """End a job, its whole process group (the launcher and its ranks): SIGTERM, SIGKILL 10 s later; its output."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=10)[0] or ""
        except subprocess.TimeoutExpired:
            continue
    return ""


def _launch(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, float, str]:
    """(exit status, seconds, output with stderr) of one job, in its own process group; a job past ``timeout``
    is ended (status 124), and so is a job still running when the driver itself ends (SIGTERM, Ctrl-C)."""
    begin = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, rc = proc.communicate(timeout=timeout)[0] or "", proc.returncode
    except subprocess.TimeoutExpired:
        out, rc = _end(proc) + f"\n(ended after {timeout:g} s: --timeout)\n", 124
    finally:
        if proc.poll() is None:
            _end(proc)
    return rc, time.monotonic() - begin, out


def _torchvision(args: argparse.Namespace, env: dict[str, str]) -> tuple[bool, str]:
    """(whether the runs can build --model, torchvision's version or why not), asked of the runs' Python."""
    code = ("import sys\nfrom mpigpu.bench.synthetic import torchvision_model\n"
            f"made, about = torchvision_model({args.model!r})\nprint(about)\nsys.exit(0 if made else 3)")  # fmt: skip
    done = subprocess.run([args.python, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return done.returncode == 0, said[-1] if said else f"{args.python} -c ... exited with status {done.returncode}"


def _version_line(command: list[str]) -> str | None:
    """The first line of ``command``'s output that names a version (else its first line), or None."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in (done.stdout or done.stderr).splitlines() if line.strip()]
    return next((line for line in lines if "version" in line.lower()), lines[0] if lines else None)


def _machine() -> dict[str, Any]:
    """Host, platform, CPUs, and the GPUs nvidia-smi lists (model of the first, count), if it is there."""
    names = gpu_names()
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "gpu": names[0] if names else None, "gpus": len(names)}  # fmt: skip


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)  # gpu-check's time limit: the running job ends too

    script = args.suite / HVD_SCRIPT
    if not script.is_file():
        sys.stderr.write(f"hvd_synthetic.py: no {script}: scripts/hvd-suite.sh HOROVOD_CHECKOUT prepares it\n")
        return 2
    hvd_env, ddp_env = _env(args.suite), _env()
    usable, torchvision = _torchvision(args, hvd_env)
    if not usable:
        sys.stderr.write(f"hvd_synthetic.py: both sides need torchvision.models.{args.model}: {torchvision}\n")
        return 2
    launcher, options = _launcher(args.launcher), _bench_options(args)
    commands = {
        "hvd": ([*launcher, "-n", str(args.ranks), args.python, "-m", "mpigpu.run", str(script), *options], hvd_env),
        "ddp": ([*launcher, "-n", str(args.ranks), args.python, "-m", "mpigpu.bench.synthetic", *options], ddp_env),
    }
    for side, (command, _) in commands.items():
        print(f"# {side}: {shlex.join(command)}")
    runs = []
    order = schedule(args.runs)
    for index, (pair, side) in enumerate(order):
        rc, seconds, output = _launch(*commands[side], args.timeout)
        try:
            figures, problem = (parse_output(output), None) if rc == 0 else (None, f"FAILED: exit status {rc}")
        except ValueError as exc:
            figures, problem = None, f"FAILED: {exc}"
        runs.append({"pair": pair, "side": side, "rc": rc, "seconds": round(seconds, 2), "figures": figures,
                     "problem": problem, "output": output.splitlines()})  # fmt: skip
        result = f"{figures['total_img_s']:.1f} +-{figures['total_conf']:.1f} img/s" if figures else problem
        print(f"# run {index + 1} of {len(order)}: {side} (pair {pair + 1}), {seconds:.1f} s: {result}", flush=True)
        if figures is None:
            print("\n".join(f"#   | {line}" for line in output.splitlines()[-TAIL_LINES:]), flush=True)
    doc = {
        "date": now(), "command": [sys.executable, str(DRIVER), *(sys.argv[1:] if argv is None else argv)],
        "machine": _machine(),
        "versions": {**versions(), "torchvision": torchvision, "launcher": _version_line([*launcher, "--version"])},
        "torchvision": torchvision, "ranks": args.ranks, "launcher": launcher,
        "options": {k: getattr(args, k) for k in ("model", "batch_size", "num_warmup_batches", "num_batches_per_iter",
                                                  "num_iters", "no_cuda", "fp16_allreduce")},
        "commands": {side: command for side, (command, _) in commands.items()},
        "order": "pair i: hvd then ddp for even i, ddp then hvd for odd i", "runs": runs,
        **compare(runs, args.fp16_allreduce),
    }  # fmt: skip
    doc["ok"] = all(r["figures"] is not None for r in runs)
    print("\n".join(table(doc)))
    print(closing_line(doc))
    if args.json:
        write_json(args.json, doc)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
