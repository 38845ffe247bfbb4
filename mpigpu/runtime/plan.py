"""Choosing a backend per call: an explicit request is validated; ``auto`` uses the crossover table
that ``python -m mpigpu.bench --tune`` measured on a matching machine, or these rules:

GPU arrays:  ipc (one node, peer access) up to 4 MiB -> nccl -> cuda-aware MPI -> host staging
             (reduce_scatter: nccl first, as ipc makes it out of an allreduce).
Host arrays: by the layout (nodes, ranks per node; ``layout_rule``) for allreduce and reduce_scatter:
             one rank per node, or a node holding one rank: cpu (the host path's node step shares
             nothing there, it only adds copies); several nodes of at least 3 ranks: host from
             256 KiB (its two-level path), of 2: from 1 MiB, cpu below; one node of 8 or
             more ranks: host from 256 KiB, cpu below. One node of 2 to 7 ranks, as measured there: host
             (shared-memory reduce) from 32 MiB, and from 32 KiB to 64 KiB and from 2 MiB, where
             the host backend is available; cpu (MPI_Allreduce) otherwise.

The order is the registry's (``mpigpu.backends._REGISTRY``), the size limits are each backend's
``auto_declines``, and a backend is tried only for the collectives it lists (reduce_scatter tries
nccl first). The tuning table, measured on allreduce, chooses allreduces only.

Every input to the choice (sizes, dtypes, capabilities agreed at start-up, the table broadcast from
rank 0) is identical on every rank, so ranks agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mpigpu.backends import BACKEND_NAMES, backend_class, preference
from mpigpu.core.config import size_label
from mpigpu.core.errors import BackendUnavailable, InvalidArgument

if TYPE_CHECKING:
    from mpigpu.core.arrays import ArrayView
    from mpigpu.core.ops import Op
    from mpigpu.runtime.context import Context

__all__ = ["Choice", "choose", "choose_cached", "layout_rule", "log_choice", "remember"]

# auto's layout rules for host arrays (issue 45's runs, 16 cores, MPICH, float32 sum, slowest rank's median):
# across nodes host's two-level path lost at 64 KiB (2x4: 174 us, MPI 116) and won from 1 MiB (2x4: 798 against
# 1259; 4x2: 925 against 1007; 8 MiB: 4x and 3x); on one node of 8 or 16 ranks host won at 1 MiB (681 against
# 787, 735 against 842); with one rank per node it only added copies (2x1, 8 MiB: 8446 against cpu 2446).
# Mid sizes (bench/results/cpu-nodes-2026-11-29-mid-sizes.txt, two runs): from 256 KiB host won on one node
# of 8 (177 and 190 us against cpu 197 and 213) and across nodes of 4 ranks (2x4: 245 against 297; 4x4: 384
# against 401; 3x3: 357 against 530), and lost across nodes of 2 ranks at 256 KiB (4x2: 316 and 380 against
# cpu 287 and 311; 2x2: 288 against 243; at 512 KiB 4x2 542 and 570 against 522 and 540, 2x2 451 against 485).
ACROSS_NODES_HOST_FROM = 256 << 10
FULL_NODE = 3  # nodes of fewer ranks share less in the node step: host from FEW_PER_NODE_HOST_FROM
FEW_PER_NODE_HOST_FROM = 1 << 20
MANY_RANKS = 8  # one node of this many ranks or more takes host from ONE_NODE_HOST_FROM
ONE_NODE_HOST_FROM = 256 << 10


@dataclass(frozen=True)
class Choice:
    """A backend and the reason it was chosen."""

    backend: str
    reason: str


_logged: set[tuple[str, str, str]] = set()


def log_choice(rank: int, size: int, name: str, what: str, nbytes: int, choice: Choice) -> None:
    """The one choice log (MPIGPU_LOG=1): rank 0 prints each (collective, backend, reason) once
    (``name`` the collective, ``what`` the data: "float32 on GPU 0", "float32 x several devices")."""
    key = (name, choice.backend, choice.reason)
    if rank == 0 and key not in _logged and nbytes and size > 1:
        _logged.add(key)
        import sys

        sys.stderr.write(f"mpigpu: {name} {nbytes} B {what} -> {choice.backend} ({choice.reason})\n")


_REDUCTIONS = frozenset({"allreduce", "reduce_scatter"})  # the collectives whose dtype/op support a backend states


def _sizes_label(node_sizes: tuple[int, ...]) -> str:
    """The layout as nodes x ranks per node ("2x4"), or each node's ranks where they differ ("2+1")."""
    if len(set(node_sizes)) == 1:
        return f"{len(node_sizes)}x{node_sizes[0]}"
    return "+".join(map(str, node_sizes))


def layout_rule(node_sizes: tuple[int, ...], nbytes: int) -> Choice | None:
    """auto's choice for a host array's allreduce or reduce_scatter of ``nbytes`` in a job whose nodes
    hold ``node_sizes`` ranks (the same tuple on every rank), or None where the backends' own size
    rules apply (one node of fewer than MANY_RANKS ranks, where they were measured)."""
    nodes, fewest, most = len(node_sizes), min(node_sizes), max(node_sizes)
    layout = _sizes_label(node_sizes)
    if nodes == 1 and most < MANY_RANKS:
        return None
    if most == 1:
        return Choice("cpu", f"layout {layout}: one rank per node, where the host path only adds copies")
    if nodes > 1 and fewest == 1:
        return Choice("cpu", f"layout {layout}: a node holds one rank, where the host path only adds copies")
    if nodes > 1:
        start = ACROSS_NODES_HOST_FROM if fewest >= FULL_NODE else FEW_PER_NODE_HOST_FROM
        if nbytes >= start:
            return Choice("host", f"layout {layout}: host's two-level path from {size_label(start)}")
        return Choice("cpu", f"layout {layout}: MPI's own collectives below {size_label(start)}")
    if nbytes >= ONE_NODE_HOST_FROM:
        return Choice("host", f"layout {layout}: host's shared-memory reduce from {size_label(ONE_NODE_HOST_FROM)}")
    return Choice("cpu", f"layout {layout}: MPI_Allreduce below {size_label(ONE_NODE_HOST_FROM)}")


def _usable(ctx: Context, name: str, view: ArrayView, op: Op, collective: str = "allreduce") -> str | None:
    """None if ``name`` can take this call, else why not."""
    available = ctx.availability.get(name)
    if available is None or not available.ok:
        return available.reason if available else "unknown backend"
    cls = backend_class(name)
    if collective not in cls.collectives:
        return f"does not implement {collective}"
    if view.on_device and not cls.device_arrays:
        return "takes host (NumPy) arrays only"
    if not view.on_device and not cls.host_arrays:
        return "takes GPU arrays only"
    if collective not in _REDUCTIONS:  # data movement: bytes, any dtype
        return None
    return cls.supports_on(ctx, view.dtype, op)


_CACHE_LIMIT = 4096


def remember(ctx: Context, key: Any, value: Any) -> None:
    """Store ``value`` under ``key`` in the context's plan cache, which is bounded: past its limit,
    everything is forgotten (choices and call records alike)."""
    cache = ctx.plan_cache
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def choose_cached(ctx: Context, view: ArrayView, op: Op, requested: str, collective: str = "allreduce") -> Choice:
    """``choose``, remembered per (placement, shape, dtype, op, request, collective) on the context:
    the decision depends on nothing else (bytes follow from shape and dtype), and repeated calls (a
    training loop) then cost a lookup."""
    key = (view.device is not None, view.shape, view.dtype.name, op, requested, collective)
    choice = ctx.plan_cache.get(key)
    if choice is None:
        choice = choose(ctx, view, op, requested, collective)
        remember(ctx, key, choice)
    return choice


def choose(ctx: Context, view: ArrayView, op: Op, requested: str, collective: str = "allreduce") -> Choice:
    """Resolve ``requested`` ("auto" or a backend name) for this call of ``collective``, or raise
    saying why not."""
    if requested != "auto":
        if requested not in BACKEND_NAMES:
            backend_class(requested)  # raises the "unknown backend" error
        problem = _usable(ctx, requested, view, op, collective)
        if problem is None:
            return Choice(requested, "requested")
        available = ctx.availability[requested]
        if not available.ok:
            fix = ""
            if not ctx.all_have_gpus and not backend_class(requested).host_arrays:
                fix = (
                    ". It runs on GPUs only: use backend='auto', 'cpu' or 'host' for NumPy arrays; for GPU arrays, "
                    "run on GPU nodes with at most one rank per GPU (python -m mpigpu.info shows each rank's GPU)"
                )
            raise BackendUnavailable(f"backend {requested!r} is not available here: {available.reason}{fix}")
        where = "a GPU array" if view.on_device else "a host array"
        hint = "use backend='auto'"
        if not view.on_device and not backend_class(requested).host_arrays:
            hint = "move the data to the GPU first, or use backend='host' or 'cpu'"
        if view.on_device and not backend_class(requested).device_arrays:
            hint = "use backend='host', 'nccl' or 'auto' for GPU arrays"
        what = (
            f"reduce {where} of {view.dtype.name} with op {op.value}"
            if collective in _REDUCTIONS
            else (f"{collective} {where}")
        )
        raise InvalidArgument(f"backend {requested!r} cannot {what}: {problem}; {hint}")
    placement = "device" if view.on_device else "host"
    if ctx.tuning is not None and collective == "allreduce":  # the table times allreduce only
        name = ctx.tuning.lookup(placement, view.nbytes)
        if name is not None and _usable(ctx, name, view, op, collective) is None:
            layout = _sizes_label(ctx.layout.node_sizes)
            return Choice(name, f"tuned table ({ctx.tuning.source}) for {view.nbytes} B, measured in layout {layout}")
    if not view.on_device and collective in _REDUCTIONS and ctx.size > 1:
        rule = layout_rule(ctx.layout.node_sizes, view.nbytes)
        if rule is not None:
            problem = _usable(ctx, rule.backend, view, op, collective)
            if problem is None:
                return rule
    order = preference(view.on_device, collective)
    skipped = []
    for name in order:
        problem = _usable(ctx, name, view, op, collective)
        if problem is None:
            problem = backend_class(name).auto_declines(view.on_device, view.nbytes, collective)
        if problem is None:
            why = "; ".join(skipped)
            return Choice(name, f"rule: first usable of {', '.join(order)}" + (f" (skipped {why})" if why else ""))
        skipped.append(f"{name}: {problem}")
    verb = "reduce" if collective in _REDUCTIONS else collective
    raise BackendUnavailable(f"no backend can {verb} this {placement} array: " + "; ".join(skipped))
