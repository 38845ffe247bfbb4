"""Milliseconds per data-parallel JAX training step, several ways, on the same model:

  (a)  in-jit   one jitted step: loss, grad, mpigpu.jax.average_tree (an XLA FFI call), update; the
                compiled FFI handler where it takes the call (MPIGPU_JAX_HANDLER=auto)
  (ap) in-jit as (a) on the Python FFI handler (MPIGPU_JAX_HANDLER=python)
  (a1) in-jit as (ap), with a new Python thread state made and deleted for every handler call (ctypes'
                own behaviour on XLA's threads, before the handler kept one per thread): runs first
  (at) in-jit as (a) with MPIGPU_JAX_ORDER=tokens: the calls carry JAX's ordered effect (a token from call
                to call and program to program), which GPU programs no longer need; JAX's Python dispatch
  (a0) in-jit as (at), with JAX's own host wait before every call restored (the runtime token placed
                with block_until_ready, as before issue 17): what mpigpu.jax._tokens saves
  (an) in-jit as (a) with backend="nccl" forced, on GPUs where (a)'s auto chose another backend
  (b)  leave    grad in jit, mpigpu.allreduce on the concrete flattened gradient, update in jit
  (l)  local    as (a) without the average (each rank its own gradient): the step's own cost, JAX's C++
                dispatch (a program with an ordered effect always takes JAX's Python dispatch); not checked
  (s)  shard_map the user's call inside JAX's SPMD step: a jitted shard_map step over the mesh of every
                process's device, mpigpu.jax.average_tree inside (which there is XLA's own lax.pmean)
  (c)  jax      JAX's own multi-process collectives: the same shard_map step with lax.pmean written by hand

Both (s) and (c) need JAX's multi-process runtime: mpigpu.jax.init(distributed=True) starts it
(jax.distributed.initialize, coordinator address from rank 0 over MPI, local_device_ids = the rank's GPU);
every other row runs on the device init() returns.

    mpirun -np 2 python3 scripts/jax_step_bench.py --json jax-step.json
    mpirun -np 2 python3 scripts/jax_step_bench.py --device cpu --width 256     # no GPU: the CPU path

--local-devices: one process drives every device it sees (several GPUs per process, mpigpu.multi), with no
JAX multi-process runtime: (s) and (c) over a mesh of the process's devices (jax.local_devices()), each
device with its own --batch samples; mpigpu.jax.init() is not called (it would restrict JAX to one GPU).
(sd) is (s) with a named backend (nccl on GPUs, cpu on host devices): mpigpu's FFI call once per device, on
the handler MPIGPU_JAX_HANDLER=auto picks (GPUs, nccl: the compiled one, each device's thread calling NCCL on
its own communicator; host devices: the Python one, the devices meeting as mpigpu.multi's participants);
issue 38's goal: within 1.1x of (c). (sdp) is (sd) on the Python handler (forced). The variants are
compiled and warmed up first, then timed in turns, as in the main mode (below).
Times are per step; the checks: every device ends with the same parameters, and (s), (sd) and (sdp) agree
with (c).

    mpirun -np 1 python3 scripts/jax_step_bench.py --local-devices --json jax-step-local.json   # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        python3 scripts/jax_step_bench.py --local-devices --device cpu --width 256              # no GPU

Every row says which backend reduced the gradient, how many bytes it reduced per step and rank, and the
host's dispatch time per step (time spent in the step calls, before the final wait): where that is
close to ms/step the host is the limit, not the device. "main cpu" is the CPU time of the dispatching
thread per step (near host ms: dispatch is Python work; well below: it waits, for the GIL or for XLA).
The in-jit rows also say what the FFI handler costs per call, measured inside it on XLA's thread: wall
and CPU time (wall - CPU: waiting, for the GIL or in MPI), calls per step, and for the Python handler how
many calls found their thread's Python state new (all of them in (a1)). The compiled handler times itself
(its C++ counters, on only while a row is timed). Every variant is compiled and warmed up first, then the
variants are timed in ROUNDS turns taken in rotation, so that a slow spell of a shared machine falls on all
of them ((a1) alone, first, before any other variant's Python handler keeps a thread state on XLA's
threads). Every variant starts from the same parameters and data and runs the same number of steps; the
script checks that all end with the same parameters on every rank (to a float32 tolerance: the reductions
add in different orders) and that each is identical across ranks. (s) and (c) are skipped, with a one-line
reason, if jax.distributed cannot start.
Times are the slowest rank's, per step, after warm-up. The JSON (--json) also holds the machine, the
versions, and the goals: (a) and (s) against (c), and the handler's cost per call, which ``handler`` sets beside
NCCL's own enqueue of the same call (cupy.cuda.nccl, the same bytes, timed after the rows on GPUs: issue 48).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

ROUNDS = 5  # the timed steps of each variant, in this many turns taken in rotation (both modes)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jax_step_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto", help="default: gpu if any")
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP (default 2048)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers (default 4)")
    parser.add_argument("--batch", type=int, default=128, help="samples per rank (default 128)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per variant (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--no-jax-distributed", action="store_true", help="skip (s) and (c)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--local-devices",
        action="store_true",
        help="one process, every device it sees: (s) shard_map + mj.average_tree and (c) lax.pmean over a mesh "
        "of jax.local_devices() (run it with one process; on CPU give XLA several host devices)",
    )
    return parser.parse_args(argv)


def _stepper(jax: Any, init: Any, one_step: Any) -> tuple[Any, dict[str, Any]]:
    """``steps(n)``: n steps from the parameters in ``state["p"]`` (``init()`` at first), kept there;
    returns (seconds to dispatch them, this thread's CPU seconds), after waiting for the last."""
    state = {"p": init()}

    def steps(n: int) -> tuple[float, float]:
        p = state["p"]
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            p = one_step(p)
        dispatched, cpu = time.perf_counter() - start, time.thread_time() - cpu
        jax.block_until_ready(p)
        state["p"] = p
        return dispatched, cpu

    return steps, state


def _step_functions(lr: float) -> tuple[Any, Any]:
    """The MLP's loss and the SGD update every mode times (the same model in every mode)."""
    import jax
    import jax.numpy as jnp

    def loss_fn(p, x, y):
        h = x
        for w, b in zip(p["w"][:-1], p["b"][:-1], strict=True):
            h = jnp.tanh(h @ w + b)
        return jnp.mean((h @ p["w"][-1] + p["b"][-1] - y) ** 2)

    def update(p, g):
        return jax.tree_util.tree_map(lambda q, d: q - lr * d, p, g)

    return loss_fn, update


def _model(width: int, depth: int, seed: int = 0) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    sizes = [32, *([width] * depth), 8]
    ws = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in itertools.pairwise(sizes)]
    bs = [np.zeros(b, np.float32) for b in sizes[1:]]
    return {"w": ws, "b": bs}


def _host_copy(jax: Any, tree: Any) -> np.ndarray:
    """Every leaf of ``tree`` flattened into one NumPy array (this process's copy of replicated arrays)."""
    leaves = [np.asarray(leaf.addressable_data(0)).ravel() for leaf in jax.tree_util.tree_leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0, np.float32)


def _timed(comm: Any, run_steps: Any, steps: int) -> tuple[float, float, float]:
    """(ms per step, host dispatch ms per step, main thread CPU ms per step), each on the slowest rank."""
    comm.Barrier()
    start = time.perf_counter()
    dispatch, cpu = run_steps(steps)
    elapsed = time.perf_counter() - start
    from mpigpu.core._mpi import MPI

    slowest = MPI().MAX
    return tuple(comm.allreduce(v, op=slowest) * 1e3 / steps for v in (elapsed, dispatch, cpu))  # type: ignore[return-value]


@dataclass
class _Variant:
    """A compiled, warmed-up variant of the main mode: its stepper, its parameters, the block its steps run
    in (settings it was compiled with, or run-time ones such as a new thread state per call), and whether
    its final parameters are checked."""

    steps: Any
    state: dict[str, Any]
    around: Any
    checked: bool


def _add_times(total: Any, times: Any) -> None:
    """Add one turn's handler times (mpigpu.jax._ffi.HandlerTimes, or the compiled handler's NativeTimes, which
    counts no thread states) to ``total``, a HandlerTimes summing a variant's turns for ``_handler_row``."""
    total.calls += times.calls
    total.seconds += times.seconds
    total.cpu_seconds += times.cpu_seconds
    total.fresh += getattr(times, "fresh", 0)
    total.threads |= set(getattr(times, "threads", ()))


def _time_in_turns(comm: Any, variants: dict[str, _Variant], results: dict[str, Any], steps: int, *,
                   python_times: Any = None, compiled_times: Any = None, failed: Any = None) -> None:  # fmt: skip
    """Time every variant's ``steps`` steps in ROUNDS turns, the variants in rotation (a slow spell of a shared
    machine falls on all of them, not on the ones that happened to run then), each turn inside its variant's
    block; each row's times are the turns' step-weighted sum. With ``python_times``/``compiled_times`` (the
    handlers' recorders), the FFI handler's cost per call over the turns too. ``failed(name, exc)``: a variant
    whose turn raises is dropped (from ``variants`` and ``results``) and reported there; without it, raised."""
    from mpigpu.core._mpi import MPI
    from mpigpu.jax._ffi import HandlerTimes

    names = list(variants)
    totals = {name: (HandlerTimes(), HandlerTimes()) for name in names}  # (Python handler, compiled handler)
    rounds = max(1, min(ROUNDS, steps))
    for r in range(rounds):
        this_round = steps // rounds + (r < steps % rounds)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            variant = variants.get(name)
            if variant is None:  # dropped in an earlier round
                continue
            recorders = (python_times() if python_times is not None else contextlib.nullcontext(),
                         compiled_times() if compiled_times is not None else contextlib.nullcontext())  # fmt: skip
            try:
                with variant.around(), recorders[0] as times, recorders[1] as compiled:
                    timed = _timed(comm, variant.steps, this_round)
            except Exception as exc:
                if failed is None:
                    raise
                del variants[name], results[name]
                failed(name, exc)
                continue
            for key, value in zip(("ms_per_step", "host_dispatch_ms_per_step", "main_cpu_ms_per_step"), timed,
                                  strict=True):  # fmt: skip
                results[name][key] += value * this_round / steps
            for total, recorded in zip(totals[name], (times, compiled), strict=True):
                if recorded is not None:
                    _add_times(total, recorded)
    for name in variants:
        python, compiled = totals[name]
        if comm.allreduce(python.calls, op=MPI().MAX):
            results[name]["handler"] = _handler_row(comm, python, steps, "python")
        elif comm.allreduce(compiled.calls, op=MPI().MAX):
            results[name]["handler"] = _handler_row(comm, compiled, steps, "compiled")


def _handler_row(comm: Any, times: Any, steps: int, kind: str) -> dict[str, Any]:
    """The FFI handler's cost per call during the timed steps, the slowest rank's (``kind``: "python" or
    "compiled"; the compiled one has no thread states to count)."""
    from mpigpu.core._mpi import MPI

    calls = max(times.calls, 1)
    slowest = MPI().MAX
    wall = comm.allreduce(times.seconds / calls, op=slowest)
    cpu = comm.allreduce(times.cpu_seconds / calls, op=slowest)
    fresh = comm.allreduce(getattr(times, "fresh", 0), op=slowest)
    return {"handler": kind, "calls_per_step": times.calls / steps, "us_per_call": wall * 1e6,
            "cpu_us_per_call": cpu * 1e6, "new_thread_state_calls": fresh,
            "threads": len(getattr(times, "threads", ()))}  # fmt: skip


@contextlib.contextmanager
def _order_mode(mode: str) -> Any:
    """Programs traced inside the block use MPIGPU_JAX_ORDER=``mode``."""
    from mpigpu.jax import _primitive

    before = _primitive._order_setting
    _primitive._order_setting = lambda: mode  # type: ignore[assignment]
    try:
        yield
    finally:
        _primitive._order_setting = before


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.local_devices:
        return local_main(args)
    import mpigpu
    from mpigpu.bench.enqueue import handler_beside_nccl
    from mpigpu.core._mpi import world
    from mpigpu.runtime.context import Context

    comm = world()
    rank, size = comm.Get_rank(), comm.Get_size()
    gpu = mpigpu.select_device() if args.device != "cpu" else None
    if args.device == "gpu" and gpu is None:
        print("# no GPU visible: use --device cpu", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"

    import jax
    from jax.flatten_util import ravel_pytree

    import mpigpu.jax as mj
    from mpigpu.jax import _native
    from mpigpu.jax._comms import channel, comm_key
    from mpigpu.jax._ffi import fresh_thread_states, record_times
    from mpigpu.jax._tokens import jax_host_wait

    skipped_c = "--no-jax-distributed" if args.no_jax_distributed else None
    device = None
    if skipped_c is None:
        try:
            device = mj.init(distributed=True)  # the rank's device, and JAX's runtime for (s) and (c)
        except Exception as exc:
            skipped_c = f"jax.distributed could not start: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if device is None:
        device = mj.init()
    params0 = _model(args.width, args.depth)
    nparams = sum(int(a.size) for a in jax.tree_util.tree_leaves(params0))
    rng = np.random.default_rng(1 + rank)
    x_np = rng.standard_normal((args.batch, 32)).astype(np.float32)
    y_np = rng.standard_normal((args.batch, 8)).astype(np.float32)
    x, y = jax.device_put(x_np, device), jax.device_put(y_np, device)
    lr = args.lr

    loss_fn, update = _step_functions(lr)

    if rank == 0:
        print(f"# {size} ranks, JAX {jax.__version__} on {device.platform} ({device.device_kind}); MLP "
              f"{args.depth} x {args.width}: {nparams} float32 parameters ({nparams * 4 / 2**20:.1f} MiB), "
              f"batch {args.batch} per rank, {args.steps} steps after {args.warmup}")  # fmt: skip

    results: dict[str, Any] = {}
    finals: dict[str, np.ndarray] = {}

    # (a) one jitted step with the average inside
    def make_step_a(backend: str | None) -> Any:
        @jax.jit
        def step_a(p, x, y):
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            return update(p, g if backend is None else mj.average_tree(g, backend=backend)), loss

        return step_a

    # (b) grad in jit, leave jit to average, update in jit
    grad_b = jax.jit(lambda p, x, y: ravel_pytree(jax.grad(loss_fn)(p, x, y))[0])
    unravel = ravel_pytree(params0)[1]
    update_b = jax.jit(lambda p, flat: update(p, unravel(flat)))

    variants: dict[str, _Variant] = {}

    def run_variant(
        name: str, init: Any, one_step: Any, reduced: Any, around: Any = contextlib.nullcontext, checked: bool = True
    ) -> None:
        """Compile and warm up ``one_step`` under ``around``; ``reduced()`` (called right after the warm-up,
        which compiles, before the next variant compiles) says what reduced the gradient: (backend, bytes per
        step and rank). The variants are timed later, in turns (``_time_in_turns``)."""
        steps, state = _stepper(jax, init, one_step)
        with around():
            steps(args.warmup)
        backend, nbytes = reduced()
        variants[name] = _Variant(steps, state, around, checked)
        results[name] = {"ms_per_step": 0.0, "host_dispatch_ms_per_step": 0.0, "main_cpu_ms_per_step": 0.0,
                         "backend": backend, "bytes_reduced_per_step": nbytes}  # fmt: skip

    def init_local() -> Any:
        return jax.device_put(params0, device)

    def in_jit(name: str, backend: str | None, around: Any = contextlib.nullcontext) -> list[Any]:
        """Run variant (a) with ``backend``; the collectives its step was compiled with."""
        step_a = make_step_a(backend)
        first = len(mj.compiled_calls())
        calls: list[Any] = []

        def reduced() -> tuple[str, int]:
            calls.extend(mj.compiled_calls()[first:])
            return "+".join(sorted({c.backend for c in calls})) or "?", sum(c.nbytes for c in calls)

        run_variant(name, init_local, lambda p: step_a(p, x, y)[0], reduced, around, checked=backend is not None)
        return calls

    jax_ctx = channel(comm_key(comm)).ctx  # collective (made once): every rank here, in this order

    def python_handler(*more: Any) -> Any:
        def around() -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(jax_ctx.changed_settings(jax_handler="python"))
            for each in more:
                stack.enter_context(each())
            return stack

        return around

    def order(mode: str, *more: Any) -> Any:
        def around() -> Any:
            stack = contextlib.ExitStack()
            stack.enter_context(_order_mode(mode))
            for each in more:
                stack.enter_context(each())
            return stack

        return around

    library = _native.library()
    recorders = {"python_times": record_times,
                 "compiled_times": library.record_times if isinstance(library, _native.Library) else None}  # fmt: skip
    # (a1) first, and timed at once, alone: the other variants' Python handler calls pin XLA's threads, whose
    # thread states are then kept (what (a1) must not find)
    in_jit("in_jit_fresh_thread_state", "auto", python_handler(fresh_thread_states))
    timed_first = {"in_jit_fresh_thread_state": variants.pop("in_jit_fresh_thread_state")}
    _time_in_turns(comm, timed_first, results, args.steps, **recorders)
    calls_a = in_jit("in_jit", "auto")
    in_jit("in_jit_python", "auto", python_handler())
    in_jit("in_jit_tokens", "auto", order("tokens"))
    in_jit("in_jit_host_wait", "auto", order("tokens", jax_host_wait))
    ctx = Context.get(comm)
    nccl = ctx.availability.get("nccl")
    if device.platform == "gpu" and nccl is not None and nccl.ok and any(c.backend != "nccl" for c in calls_a):
        in_jit("in_jit_nccl", "nccl")

    def reduced_b() -> tuple[str, int]:
        flat = grad_b(init_local(), x, y)
        return mpigpu.explain(flat).backend, int(flat.nbytes)

    run_variant("leave_jit", init_local, lambda p: update_b(p, mpigpu.allreduce(grad_b(p, x, y))), reduced_b)

    in_jit("local_only", None)

    if skipped_c is None:
        collectives = "XLA's NCCL" if device.platform == "gpu" else "XLA's CPU collectives"
        for name, reduce in (("in_shard_map", mj.average_tree), ("jax_distributed", _pmean(jax))):
            try:
                run_variant(name, *_jax_variant(jax, loss_fn, update, params0, x_np, y_np, reduce),
                            lambda: (collectives, nparams * 4))  # fmt: skip
            except Exception as exc:
                skipped_c = f"the {name} step failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                if rank == 0:
                    print(f"# {name} failed: {exc}", file=sys.stderr)
                break

    _time_in_turns(comm, variants, results, args.steps, **recorders)
    for name, variant in {**timed_first, **variants}.items():
        if variant.checked:
            finals[name] = _host_copy(jax, variant.state["p"])
    # issue 48: the handler's cost per call beside NCCL's own enqueue of the same call (collective; GPUs)
    handler = handler_beside_nccl(Context.get(comm), device.platform, results.get("in_jit", {}))

    # checks: every variant identical across ranks, and the variants agree with each other
    ok = True
    steps_total = args.warmup + args.steps
    for name, final in finals.items():
        same = len(set(comm.allgather(hashlib.sha256(final.tobytes()).hexdigest()))) == 1
        results[name]["identical_on_every_rank"] = same
        ok &= same
    reference = finals["in_jit"]
    for name, final in finals.items():
        diff = float(np.max(np.abs(final - reference))) if final.size else 0.0
        results[name]["max_abs_diff_vs_in_jit"] = diff
        ok &= diff <= 1e-4 * max(1.0, float(np.max(np.abs(reference))))
    if rank == 0:
        labels = {"in_jit": "(a) in-jit average (mpigpu.jax)",
                  "in_jit_host_wait": "(a0) in-jit, tokens, JAX's host wait",
                  "in_jit_tokens": "(at) in-jit, MPIGPU_JAX_ORDER=tokens",
                  "in_jit_python": "(ap) in-jit, Python FFI handler",
                  "in_jit_fresh_thread_state": "(a1) in-jit, new thread state/call",
                  "local_only": "(l) no average (local gradient)",
                  "in_jit_nccl": "(an) in-jit, backend='nccl'", "leave_jit": "(b) leave jit, mpigpu.allreduce",
                  "in_shard_map": "(s) shard_map + mj.average_tree",
                  "jax_distributed": "(c) jax.distributed + pmean"}  # fmt: skip
        print(f"# {'variant':<38} {'ms/step':>8} {'host ms':>8} {'main cpu':>8} {'vs (a)':>6}  {'backend':<22} "
              f"{'MB/step':>8}  identical  max |diff| vs (a)")  # fmt: skip
        base = results["in_jit"]["ms_per_step"]
        for name, r in results.items():
            same, diff = r.get("identical_on_every_rank", "-"), r.get("max_abs_diff_vs_in_jit")
            diff_text = "-" if diff is None else f"{diff:.2e}"
            print(f"  {labels[name]:<38} {r['ms_per_step']:8.3f} {r['host_dispatch_ms_per_step']:8.3f} "
                  f"{r['main_cpu_ms_per_step']:8.3f} {r['ms_per_step'] / base:6.2f}  {r['backend']:<22} "
                  f"{r['bytes_reduced_per_step'] / 1e6:8.2f}  {same!s:<9}  {diff_text}")  # fmt: skip
        print("# host ms: time in the step calls per step, before the final wait (near ms/step: host-bound); "
              "main cpu: the dispatching thread's CPU time per step; "
              "MB/step: bytes reduced per step and rank")  # fmt: skip
        print(f"# FFI handler, inside, per call (slowest rank): {'variant':<38} {'handler':>8} {'us':>8} "
              f"{'cpu us':>8} {'calls/step':>10} {'new thread state':>16} {'threads':>7}")  # fmt: skip
        for name, r in results.items():
            h = r.get("handler")
            if h:
                print(f"#   {labels[name]:<69} {h['handler']:>8} {h['us_per_call']:8.1f} {h['cpu_us_per_call']:8.1f} "
                      f"{h['calls_per_step']:10.2f} {h['new_thread_state_calls']:16d} {h['threads']:7d}")  # fmt: skip
        if skipped_c:
            print(f"# (s), (c) skipped: {skipped_c}")
        if handler is not None:
            enqueue = handler["nccl_enqueue_cpu_us"]
            print(f"# handler {handler['cpu_us_per_call']:.1f} us CPU per call; NCCL's own enqueue of its "
                  f"{handler['bytes_per_call']} B: " + (f"{enqueue:.1f} us CPU" if enqueue is not None
                  else handler["nccl_enqueue_reason"]))  # fmt: skip
        for goal, value in _goals(results, handler).items():
            print(f"# goal {goal}: {value}")
        print("# PASS" if ok else "# FAIL")
    machine = _machine(comm)  # collective: every rank
    if args.json and rank == 0:
        document = {
            "ok": bool(ok),
            "ranks": size,
            "device": device.platform,
            "device_kind": device.device_kind,
            "jax": jax.__version__,
            "mpi_library": Context.get(comm).mpi_lib.version.splitlines()[0],
            "host": platform.node(),
            "machine": machine,
            "versions": _versions(jax),
            "goals": _goals(results, handler),
            "handler": handler,
            "model": {"depth": args.depth, "width": args.width, "parameters": nparams, "batch_per_rank": args.batch},
            "steps": {"warmup": args.warmup, "timed": args.steps, "total": steps_total},
            "results": results,
            "skipped": {"in_shard_map and jax_distributed": skipped_c} if skipped_c else {},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with open(args.json, "w") as out:
            json.dump(document, out, indent=2)
    return 0 if ok else 1


def _pmean(jax: Any) -> Any:
    return lambda g: jax.lax.pmean(g, "data")


def _goals(results: dict[str, Any], handler: dict[str, Any] | None = None) -> dict[str, Any]:
    """Issue 23's targets: the in-jit steps at most 1.05x (c); issue 48's: the FFI handler at most 10 us of CPU
    per call, or at most 3 us over NCCL's own enqueue of the same call (``handler``: handler_beside_nccl's)."""
    goals: dict[str, Any] = {}
    c = (results.get("jax_distributed") or results.get("jax_pmean") or {}).get("ms_per_step")
    for name in ("in_jit", "in_shard_map"):
        if c and name in results:
            ratio = results[name]["ms_per_step"] / c
            goals[f"{name}_vs_pmean"] = {"ratio": round(ratio, 3), "target": 1.05, "met": ratio <= 1.05}
    if c and "per_device_ffi" in results:  # issue 38: mpigpu's FFI call once per device beside XLA's collectives
        ratio = results["per_device_ffi"]["ms_per_step"] / c
        goals["per_device_ffi_vs_pmean"] = {"ratio": round(ratio, 3), "target": 1.1, "met": ratio <= 1.1}
    if handler is not None:  # CPU time: its own work; wall time adds the wait for the other ranks
        from mpigpu.bench.enqueue import handler_goal

        goals["handler_cpu_us_per_call"] = handler_goal(handler)
    return goals


def _machine(comm: Any) -> dict[str, Any]:
    """Where it ran: host, CPUs, and the GPUs nvidia-smi lists (none on a CPU-only machine)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    return {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "gpus": [line.split(" (UUID")[0] for line in listed.splitlines() if line.startswith("GPU")],
            "nodes": len(set(comm.allgather(platform.node())))}  # fmt: skip


def _versions(jax: Any) -> dict[str, str]:
    import jaxlib
    import mpi4py

    import mpigpu

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "numpy": np.__version__, "mpi4py": mpi4py.__version__, "mpigpu": mpigpu.__version__,
            "mpigpu_commit": commit}  # fmt: skip


def _jax_variant(
    jax: Any,
    loss_fn: Any,
    update: Any,
    params0: Any,
    x_np: np.ndarray,
    y_np: np.ndarray,
    reduce: Any,
    devices: list[Any] | None = None,
) -> tuple[Any, Any]:
    """(init, one_step) for a step in JAX's SPMD form: one device per process in a global mesh (or
    ``devices``, the process's own, with ``x_np``/``y_np`` holding every one's rows), a jitted
    shard_map step that averages the gradient with ``reduce`` (lax.pmean, or mpigpu.jax.average_tree,
    which becomes lax.pmean there)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices() if devices is None else devices), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(split, x_np)
    y = jax.make_array_from_process_local_data(split, y_np)

    def local_step(p, xb, yb):
        g = jax.grad(loss_fn)(p, xb, yb)  # this device's gradient (replication checks off: no implicit psum)
        return update(p, reduce(g))

    options = inspect.signature(shard_map).parameters
    unchecked = {"check_vma": False} if "check_vma" in options else {"check_rep": False}
    specs = {"in_specs": (P(), P("data"), P("data")), "out_specs": P()}
    step = jax.jit(shard_map(local_step, mesh=mesh, **specs, **unchecked))

    def init() -> Any:
        return jax.tree_util.tree_map(lambda a: jax.make_array_from_process_local_data(replicated, a), params0)

    def one_step(p: Any) -> Any:
        return step(p, x, y)

    return init, one_step


def _local_failure(skipped: dict[str, str], name: str, exc: Exception) -> None:
    skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    print(f"# {name} failed: {exc}", file=sys.stderr)


def local_main(args: argparse.Namespace) -> int:
    """--local-devices: (s) and (c) over a mesh of this one process's devices (module docstring)."""
    from mpigpu.core._mpi import world

    comm = world()
    if comm.Get_size() != 1:
        if comm.Get_rank() == 0:
            print("# --local-devices runs in one process (it drives every device it sees): use mpirun -np 1",
                  file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    import mpigpu.jax as mj
    from mpigpu.jax._comms import channel, comm_key
    from mpigpu.runtime.context import Context

    devices = jax.local_devices()
    platform_ = devices[0].platform
    if args.device == "gpu" and platform_ != "gpu":
        print(f"# --device gpu: JAX runs on {platform_} here (no GPU backend): use --device cpu", file=sys.stderr)
        return 2
    if len(devices) < 2:
        print(f"# --local-devices needs several devices in this process; JAX sees {len(devices)} "
              f"({platform_}). On CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu",
              file=sys.stderr)  # fmt: skip
        return 2
    n = len(devices)
    if platform_ == "cpu":  # mpigpu's per-device route: as many host devices as XLA's (before any Context reads it)
        os.environ.setdefault("MPIGPU_DEVICES_PER_RANK", str(n))
    params0 = _model(args.width, args.depth)
    nparams = sum(int(a.size) for a in jax.tree_util.tree_leaves(params0))
    xs, ys = [], []
    for g in range(n):  # device g's samples, as rank g's in the MPI mode
        rng = np.random.default_rng(1 + g)
        xs.append(rng.standard_normal((args.batch, 32)).astype(np.float32))
        ys.append(rng.standard_normal((args.batch, 8)).astype(np.float32))
    x_np, y_np = np.concatenate(xs), np.concatenate(ys)
    lr = args.lr

    loss_fn, update = _step_functions(lr)

    print(f"# 1 process, {n} local devices, JAX {jax.__version__} on {platform_} ({devices[0].device_kind}); MLP "
          f"{args.depth} x {args.width}: {nparams} float32 parameters ({nparams * 4 / 2**20:.1f} MiB), "
          f"batch {args.batch} per device, {args.steps} steps after {args.warmup}")  # fmt: skip
    collectives = "XLA's NCCL" if platform_ == "gpu" else "XLA's CPU collectives"
    results: dict[str, Any] = {}
    finals: dict[str, list[np.ndarray]] = {}
    skipped: dict[str, str] = {}
    path = "nccl" if platform_ == "gpu" else "cpu"  # a named backend: mpigpu's FFI call once per device
    jax_ctx = channel(comm_key(comm)).ctx

    def per_device(tree: Any) -> Any:
        return mj.average_tree(tree, backend=path)

    variants = (("in_shard_map", mj.average_tree, contextlib.nullcontext),
                ("jax_pmean", _pmean(jax), contextlib.nullcontext),
                ("per_device_ffi", per_device, contextlib.nullcontext),
                ("per_device_python", per_device, lambda: jax_ctx.changed_settings(jax_handler="python")))  # fmt: skip
    built: dict[str, _Variant] = {}
    for name, reduce, around in variants:
        first = len(mj.compiled_calls())
        try:
            init, one_step = _jax_variant(jax, loss_fn, update, params0, x_np, y_np, reduce, devices)
            steps, state = _stepper(jax, init, one_step)
            with around():  # compiled, and so its handler chosen, in the warm-up (one step at least)
                steps(max(1, args.warmup))
        except Exception as exc:
            _local_failure(skipped, name, exc)
            continue
        built[name] = _Variant(steps, state, around, checked=True)
        calls = mj.compiled_calls()[first:]  # none where XLA's collectives reduce
        backend = "+".join(sorted({f"{c.backend} per device, {c.handler}" for c in calls})) or collectives
        results[name] = {"ms_per_step": 0.0, "host_dispatch_ms_per_step": 0.0, "main_cpu_ms_per_step": 0.0,
                         "backend": backend, "bytes_reduced_per_step": nparams * 4}  # fmt: skip
    _time_in_turns(comm, built, results, args.steps, failed=lambda name, exc: _local_failure(skipped, name, exc))
    for name, variant in built.items():
        # every device's copy of the parameters (out_specs P(): replicated), flattened
        leaves = jax.tree_util.tree_leaves(variant.state["p"])
        finals[name] = [np.concatenate([np.asarray(leaf.addressable_shards[d].data).ravel() for leaf in leaves])
                        for d in range(len(leaves[0].addressable_shards))]  # fmt: skip
    ok = not skipped
    reference = finals.get("jax_pmean")
    for name, copies in finals.items():
        same = all(np.array_equal(copies[0], c) for c in copies[1:])
        results[name]["identical_on_every_device"] = same
        results[name]["devices_holding_a_copy"] = len(copies)
        ok &= same
        if reference is not None:
            diff = float(np.max(np.abs(copies[0] - reference[0]))) if copies[0].size else 0.0
            results[name]["max_abs_diff_vs_pmean"] = diff
            ok &= diff <= 1e-4 * max(1.0, float(np.max(np.abs(reference[0]))))
    labels = {"in_shard_map": "(s) shard_map + mj.average_tree", "jax_pmean": "(c) shard_map + lax.pmean",
              "per_device_ffi": f"(sd) (s), FFI per device ({path})",
              "per_device_python": "(sdp) (sd), Python handler"}  # fmt: skip
    print(f"# {'variant':<38} {'ms/step':>8} {'host ms':>8} {'main cpu':>8} {'vs (c)':>6}  {'backend':<27} "
          f"{'MB/step':>8}  identical  max |diff| vs (c)")  # fmt: skip
    base = results.get("jax_pmean", {}).get("ms_per_step")
    for name, r in results.items():
        ratio = f"{r['ms_per_step'] / base:6.2f}" if base else f"{'-':>6}"
        diff = r.get("max_abs_diff_vs_pmean")
        print(f"  {labels[name]:<38} {r['ms_per_step']:8.3f} {r['host_dispatch_ms_per_step']:8.3f} "
              f"{r['main_cpu_ms_per_step']:8.3f} {ratio}  {r['backend']:<27} {r['bytes_reduced_per_step'] / 1e6:8.2f}  "
              f"{r['identical_on_every_device']!s:<9}  {'-' if diff is None else f'{diff:.2e}'}")  # fmt: skip
    for name, why in skipped.items():
        print(f"# {labels[name]} failed: {why}")
    goals = _goals(results)
    for goal, value in goals.items():
        print(f"# goal {goal}: {value}")
    print("# PASS" if ok else "# FAIL")
    machine = _machine(comm)
    if args.json:
        document = {
            "ok": bool(ok),
            "ranks": 1,
            "mode": "local_devices",
            "local_devices": n,
            "device": platform_,
            "device_kind": devices[0].device_kind,
            "jax": jax.__version__,
            "mpi_library": Context.get(comm).mpi_lib.version.splitlines()[0],
            "host": platform.node(),
            "machine": machine,
            "versions": _versions(jax),
            "goals": goals,
            "model": {"depth": args.depth, "width": args.width, "parameters": nparams, "batch_per_device": args.batch},
            "steps": {"warmup": args.warmup, "timed": args.steps, "total": args.warmup + args.steps},
            "results": results,
            "skipped": skipped,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        with open(args.json, "w") as out:
            json.dump(document, out, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    from mpigpu.job.failsafe import abort_on_exception

    abort_on_exception()
    sys.exit(main())
