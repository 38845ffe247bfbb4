"""The host backend on NumPy arrays, under mpiexec (-n 1, 2, 4; 8 through a subprocess): every dtype
and op checked exactly, in place and out of place with a poisoned output, bitwise identical on every
rank; both routes (latency and pipeline) with chunks small enough that the ring wraps many times;
virtual nodes (equal and unequal sizes); the pool cap; segment reuse and growth; finalize; and the
GPU schedule (events, streams, waits) driven against a lazy fake CUDA runtime, so a missing wait
fails here, without a GPU.

Contexts with their own settings are built on a duplicate of the world communicator while the
MPIGPU_* variables are set, so one mpiexec run covers many configurations.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import context_with, mpi_nodes

import mpigpu
from mpigpu.backends.host_layout import PAGE, SegmentLayout, split_even
from mpigpu.backends.host_reduce import internode, reduce_rows
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.ops import Op
from mpigpu.core.patterns import fill
from mpigpu.core.verify import count_wrong_host
from mpigpu.runtime.context import Context
from mpigpu.runtime.plan import layout_rule

POISON = 0x7F
# A 4 KiB latency route and 16 KiB chunks on a ring of 3: 70001 elements cross 5 to 35 chunks.
TINY = {"MPIGPU_HOST_CHUNK": "16K", "MPIGPU_HOST_SMALL": "4K", "MPIGPU_HOST_DEPTH": "1"}
VIRTUAL = dict(TINY, MPIGPU_HOST_CHUNK="64K")
COUNTS = [1, 7, 1000, 70001]  # 1000 x 4 B fits the latency route; 1000 x 8 B does not


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _poisoned_like(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    out.view(np.uint8)[...] = POISON
    return out


def _check_matrix(ctx: Context, dtypes: list[str], counts: list[int]) -> list[str]:
    """Every op on every dtype and count, out of place (poisoned) then in place; the problems found."""
    comm, rank, n = ctx.comm, ctx.rank, ctx.size
    problems = []
    for name in dtypes:
        dtype = DTYPES[name]
        for op in Op:
            for count in counts:
                x = np.empty(count, dtype.np)
                fill(x, "exact", op, rank, n)
                before = x.copy()
                out = _poisoned_like(x)
                assert mpigpu.allreduce(x, op, out=out, comm=comm, backend="host") is out
                wrong = count_wrong_host(out, "exact", op, dtype, n)
                untouched = np.array_equal(x.view(np.uint8), before.view(np.uint8))
                assert mpigpu.allreduce(x, op, comm=comm, backend="host") is x
                same = np.array_equal(x.view(np.uint8), out.view(np.uint8))
                wrong, distinct = comm.allreduce(wrong), len(set(comm.allgather(_digest(out))))
                flags = comm.allreduce(int(not untouched) + 2 * int(not same))
                if wrong or distinct != 1 or flags:
                    problems.append(
                        f"{name} {op.value} x{count}: {wrong} wrong, {distinct} distinct results, "
                        f"input changed={bool(flags & 1)}, in-place differs={bool(flags & 2)}"
                    )
    return problems


# -- layout arithmetic (serial) --------------------------------------------------------------------
def test_split_even_covers_and_aligns() -> None:
    for count in (0, 1, 7, 16, 17, 1000, 70001):
        for parts in (1, 2, 3, 4, 8):
            for align in (1, 2, 4, 16):
                ranges = split_even(count, parts, align)
                assert len(ranges) == parts
                assert ranges[0][0] == 0 and ranges[-1][1] == count
                for (a0, a1), (b0, _) in itertools.pairwise(ranges):
                    assert a1 == b0 and a0 <= a1
                assert all(start % align == 0 or start == count for start, _ in ranges)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("partial", [False, True])
def test_segment_areas_are_disjoint_and_aligned(ranks: int, partial: bool) -> None:
    lay = SegmentLayout(ranks=ranks, stride=12 * PAGE, small=PAGE, partial=partial)
    areas = []
    for parity in (0, 1):
        for r in range(ranks):
            areas += [(lay.small_in(parity, r), lay.small), (lay.small_out(parity, r), lay.small)]
    areas += [(lay.slot(r, 0), lay.stride) for r in range(ranks)]
    areas.append((lay.result(0), lay.stride))
    if partial:
        areas.append((lay.partial_at(0), 2 * lay.stride))
    areas.sort()
    for (a, size), (b, _) in itertools.pairwise(areas):
        assert a + size <= b, "areas overlap"
    assert areas[-1][0] + areas[-1][1] == lay.total
    assert all(offset % PAGE == 0 for offset, _ in areas)
    assert lay.slot(ranks - 1, 3 * PAGE) == lay.slot(0, 3 * PAGE) + (ranks - 1) * lay.stride


def test_max_stride_respects_the_pool() -> None:
    for ranks in (1, 2, 4, 8):
        stride = SegmentLayout.max_stride(ranks, PAGE, True, 64 << 20)
        assert stride % PAGE == 0 and stride > 0
        assert SegmentLayout(ranks, stride, PAGE, True).total <= ranks * (64 << 20)
    assert SegmentLayout.max_stride(4, 1 << 20, False, 1 << 20) == 0


# -- MPI tests --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(comm) -> Iterator[Context]:
    with context_with(comm, TINY) as ctx:
        yield ctx


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_dtype_and_op_both_routes(tiny: Context, dtype: str) -> None:
    problems = _check_matrix(tiny, [dtype], COUNTS)
    assert not problems, "; ".join(problems)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("node_size", [1, 2, 3, 4])
def test_virtual_nodes(comm, node_size: int) -> None:
    """Each MPI node's ranks split into nodes of ``node_size`` (its last one smaller when it does not
    divide): across MPI nodes of 3 and 1, node size 2 makes 2+1+1."""
    nodes = sum(-(-len(ranks) // node_size) for ranks in mpi_nodes(comm))
    if nodes == 1:
        pytest.skip(f"{comm.Get_size()} rank(s) make a single node of size {node_size}")
    with context_with(comm, dict(VIRTUAL, MPIGPU_NODE_SIZE=str(node_size))) as ctx:
        assert ctx.layout.num_nodes == nodes
        problems = _check_matrix(ctx, ["float16", "bfloat16", "float32", "float64", "int8", "uint64"], COUNTS)
        assert not problems, "; ".join(problems)
        phases = ctx.backend("host").last_phases
        assert len(set(comm.allgather(tuple(sorted(phases))))) == 1, "the same phase names on every rank"
        assert {"copy_out", "reduce", "copy_in", "barrier", "internode"} <= set(phases), phases
        if ctx.layout.local_rank < min(ctx.layout.node_sizes):  # who exchanges between nodes
            assert phases["internode"] > 0, phases


@pytest.mark.mpi(min_size=2)
def test_one_rank_per_node_auto_takes_cpu_and_host_still_runs_integer_avg(comm) -> None:
    """One rank per (virtual) node: auto's layout rule takes cpu (the host path only adds copies there), a
    request for host is honoured, and its integer avg across the nodes is the exact mean."""
    with context_with(comm, dict(VIRTUAL, MPIGPU_NODE_SIZE="1")) as ctx:
        big = np.full(40 << 20, 7, np.uint8)  # 40 MiB: the host backend's size on one node
        assert mpigpu.explain(big, "sum", comm=ctx.comm).reason.startswith("layout ")
        assert mpigpu.explain(big, "sum", comm=ctx.comm, backend="host").backend == "host"
        x = np.full(70001, -128, np.int8)
        mpigpu.allreduce(x, "avg", comm=ctx.comm, backend="host")
        assert np.all(x == -128)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_seed_pattern_default_settings(comm, dtype: str) -> None:
    """A million elements through the default pipeline, against the float64 reference."""
    with context_with(comm, {}) as ctx:
        x = np.empty(1000003, DTYPES[dtype].np)
        fill(x, "seed", Op.AVG, comm.Get_rank(), comm.Get_size())
        mpigpu.allreduce(x, "avg", comm=ctx.comm, backend="host")
        assert count_wrong_host(x, "seed", Op.AVG, DTYPES[dtype], comm.Get_size()) == 0
        assert len(set(comm.allgather(_digest(x)))) == 1


@pytest.mark.mpi(min_size=1)
def test_nan_and_inf_propagate(tiny: Context) -> None:
    for count in (8, 5000):  # latency route, then pipeline
        x = np.ones(count, np.float32)
        if tiny.rank == 0:
            x[1], x[2] = np.nan, np.inf
        mpigpu.allreduce(x, "sum", comm=tiny.comm, backend="host")
        assert np.isnan(x[1]) and np.isinf(x[2]) and x[0] == tiny.size


@pytest.mark.mpi(min_size=1)
def test_multidimensional_views_reduce_whole_array(tiny: Context) -> None:
    x = np.full((3, 50, 70), tiny.rank, dtype=np.float64)
    out = np.empty_like(x)
    mpigpu.allreduce(x, "max", out=out, comm=tiny.comm, backend="host")
    assert np.all(out == tiny.size - 1) and np.all(x == tiny.rank)


@pytest.mark.mpi(min_size=2)
def test_segment_reused_then_grown_within_the_cap(comm) -> None:
    with context_with(comm, {"MPIGPU_HOST_SMALL": "4K", "MPIGPU_HOST_POOL_MB": "4"}) as ctx:
        backend = ctx.backend("host")
        x = np.ones(40000, np.float32)  # 160 KB: one chunk
        mpigpu.allreduce(x, "sum", comm=ctx.comm, backend="host")
        segment, layout = backend._segment, backend._layout
        for _ in range(3):
            mpigpu.allreduce(x, "sum", comm=ctx.comm, backend="host")
        assert backend._segment is segment and backend._layout == layout, "no reallocation at a seen size"
        big = np.ones(3 << 20, np.float32)  # 12 MiB: chunks are capped by the 4 MiB-per-rank pool
        mpigpu.allreduce(big, "sum", comm=ctx.comm, backend="host")
        assert backend._layout.stride > layout.stride
        assert backend._layout.total <= 4 * (1 << 20) * ctx.layout.local_size
        assert np.all(big == ctx.size) and np.all(x == ctx.size**4)


@pytest.mark.mpi(min_size=1)
def test_phases_are_reported(tiny: Context) -> None:
    backend = tiny.backend("host")
    x = np.ones(30000, np.float32)
    mpigpu.allreduce(x, "avg", comm=tiny.comm, backend="host")
    if tiny.size > 1:
        assert {"copy_out", "reduce", "copy_in", "barrier"} <= set(backend.last_phases)
        assert all(v >= 0 for v in backend.last_phases.values())
    info = backend.describe()
    assert info["ranks_per_node"] == tiny.layout.local_size and info["depth"] == 1


@pytest.mark.mpi(min_size=2)  # one rank never reaches a backend
def test_pool_too_small_is_a_config_error(comm) -> None:
    env = {"MPIGPU_HOST_POOL_MB": "1", "MPIGPU_HOST_SMALL": "1M"}
    with context_with(comm, env) as ctx, pytest.raises(mpigpu.ConfigError, match="MPIGPU_HOST_POOL_MB=1 is too small"):
        mpigpu.allreduce(np.ones(4, np.float32), comm=ctx.comm, backend="host")


@pytest.mark.mpi(min_size=2)
def test_settings_must_agree_on_every_rank(comm) -> None:
    chunk = "8K" if comm.Get_rank() == 1 else "16K"
    with (
        pytest.raises(mpigpu.ConfigError, match="differ between ranks") as info,
        context_with(comm, {"MPIGPU_HOST_CHUNK": chunk}),
    ):
        pass  # agreed at start-up, with the other settings that change which collectives run
    assert "MPIGPU_HOST_CHUNK: 16384 on rank" in str(info.value)
    assert len(set(comm.allgather(str(info.value)))) == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("count", [3, 1000, 300007])  # fewer items than members; gather; all-to-all
def test_internode_exchange_is_exact_and_identical(comm, count: int) -> None:
    """The exchange between nodes, with the world as the 'nodes'."""
    rank, n = comm.Get_rank(), comm.Get_size()
    for op in (Op.SUM, Op.MAX, Op.PROD):
        buf = np.empty(count, np.float64)
        fill(buf, "exact", op, rank, n)
        gather = np.empty(n * buf.nbytes, np.uint8)
        internode(comm, buf, op, gather)
        assert count_wrong_host(buf, "exact", op, DTYPES["float64"], n) == 0
        assert len(set(comm.allgather(_digest(buf)))) == 1
    # min/max across nodes follow mpigpu's semantics: NaN on one member wins, -0.0 < +0.0
    for op, zero in ((Op.MAX, 0.0), (Op.MIN, -0.0)):
        buf = np.full(count, 0.0 if rank % 2 else -0.0)
        buf[0] = np.nan if rank == n - 1 else 1.0
        internode(comm, buf, op, np.empty(n * buf.nbytes, np.uint8))
        assert buf.view(np.uint64)[0] == 0x7FF8000000000000, "the canonical NaN"
        assert np.all(buf[1:].view(np.uint64) == np.float64(zero).view(np.uint64)), (op, buf[1:4])


@pytest.mark.mpi(min_size=1)
def test_explicit_host_backend_on_world(comm) -> None:
    x = np.arange(100000, dtype=np.int64)
    mpigpu.allreduce(x, "sum", backend="host")
    assert np.array_equal(x, np.arange(100000, dtype=np.int64) * comm.Get_size())


@pytest.mark.mpi(min_size=1)
def test_finalize_frees_everything_then_works_again(comm) -> None:
    """Runs last in this module: finalize closes every context, the fixtures' too."""
    x = np.ones(50000, np.float32)
    mpigpu.allreduce(x, "sum", backend="host")
    backend = Context.get(comm).backend("host")
    segment = backend._segment
    mpigpu.finalize()
    assert backend._closed and backend._segment is None
    if segment is not None:
        assert segment._closed and segment.array.size == 0
    with pytest.raises(mpigpu.BackendUnavailable, match="closed"):
        backend.allreduce(mpigpu.core.arrays.as_view(x), mpigpu.core.arrays.as_view(x), Op.SUM, None)
    y = np.ones(50000, np.float32)
    mpigpu.allreduce(y, "sum", backend="host")
    assert np.all(y == comm.Get_size())


# -- the GPU schedule, on a fake CUDA runtime -------------------------------------------------------
class LazyRuntime:
    """The CUDA runtime calls the host backend makes, emulated on host memory and maximally lazy:
    queued work runs only when something synchronises on it. A wait missing from the GPU schedule
    (a barrier before a copy completed, a reduction before every slot was filled, a reuse before the
    copy back read) then shows as wrong or differing results, which no GPU-less test could see otherwise."""

    eventDefault, eventDisableTiming, streamNonBlocking = 0, 2, 1
    memcpyHostToDevice, memcpyDeviceToHost, memcpyDeviceToDevice = 1, 2, 3
    CUDARuntimeError = RuntimeError

    def __init__(self) -> None:
        self.queues: dict[int, list[tuple]] = {}
        self.ids = itertools.count(1000)
        self.token: dict[int, int] = {}  # event -> its latest record
        self.stream_of: dict[int, int] = {}  # record -> stream
        self.done: set[int] = set()
        self.registered: set[int] = set()
        self.events: set[int] = set()
        self.streams: set[int] = set()

    def streamCreateWithFlags(self, flags: int) -> int:
        handle = next(self.ids)
        self.streams.add(handle)
        return handle

    def eventCreateWithFlags(self, flags: int) -> int:
        handle = next(self.ids)
        self.events.add(handle)
        return handle

    def streamDestroy(self, handle: int) -> None:
        self.streams.remove(handle)

    def eventDestroy(self, handle: int) -> None:
        self.events.remove(handle)

    def _queue(self, stream: int) -> list[tuple]:
        return self.queues.setdefault(stream, [])

    def eventRecord(self, event: int, stream: int) -> None:
        assert event in self.events
        token = next(self.ids)
        self.token[event], self.stream_of[token] = token, stream
        self._queue(stream).append(("event", token))

    def streamWaitEvent(self, stream: int, event: int, flags: int = 0) -> None:
        self._queue(stream).append(("wait", self.token[event]))

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._queue(stream).append(("run", lambda: ctypes.memmove(dst, src, size)))

    def _run(self, stream: int, until: int | None = None) -> None:
        queue = self._queue(stream)
        while queue:
            kind, item = queue.pop(0)
            if kind == "event":
                self.done.add(item)
                if item == until:
                    return
            elif kind == "wait":
                self._finish(item)
            else:
                item()
        assert until is None, "an event waited on was never recorded"

    def _finish(self, token: int) -> None:
        if token not in self.done:
            self._run(self.stream_of[token], token)

    def eventSynchronize(self, event: int) -> None:
        self._finish(self.token[event])

    def streamSynchronize(self, stream: int) -> None:
        self._run(stream)

    def eventElapsedTime(self, start: int, end: int) -> float:
        assert {self.token[start], self.token[end]} <= self.done
        return 0.001

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        self.registered.add(ptr)

    def hostUnregister(self, ptr: int) -> None:
        self.registered.remove(ptr)

    def pointerGetAttributes(self, ptr: int) -> Any:
        return types.SimpleNamespace(devicePointer=ptr)

    def setDevice(self, index: int) -> None:
        """One fake device."""

    def launch(self, stream: int, kernel: str, count: int, *args: Any) -> None:
        """The reduction kernel's contract (kernels/host.cu), computed with NumPy when it runs."""
        slots, stride, n, size, op, nranks, dst = (int(a) for a in args)
        _, kind, name = kernel.split("_", 2)
        dtype, final = DTYPES[name], kind == "final"
        out_np = dtype.np if final else (np.dtype(np.float32) if dtype.is_half else dtype.np)

        def run() -> None:
            rows = [_at(slots + r * stride, size, dtype.np).copy() for r in range(n)]
            scratch = np.empty(max(size, 1), np.float32)
            reduce_rows(rows, list(Op)[op], dtype, nranks, _at(dst, size, out_np), final=final, scratch=scratch)

        self._queue(stream).append(("run", run))


def _at(address: int, count: int, dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(address), dtype=dt)


@pytest.fixture
def lazy_gpu(monkeypatch) -> LazyRuntime:
    import mpigpu.core._cuda
    import mpigpu.kernels.compile

    runtime = LazyRuntime()
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(mpigpu.core._cuda, "cupy", lambda what="": fake_cupy)
    monkeypatch.setattr(mpigpu.core._cuda, "core_stream", lambda handle: handle)
    monkeypatch.setattr(mpigpu.kernels.compile, "launch", runtime.launch)
    monkeypatch.setattr(mpigpu.kernels.compile, "load_module", lambda source, arch: FakeModule())
    return runtime


class FakeModule:
    def kernel(self, name: str) -> str:
        return name


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize(
    "env",
    [TINY, dict(TINY, MPIGPU_HOST_CHUNK="8K", MPIGPU_HOST_DEPTH="3", MPIGPU_HOST_SMALL="0"),
     dict(TINY, MPIGPU_NODE_SIZE="2"), dict(TINY, MPIGPU_NODE_SIZE="3")],
    ids=["tiny", "depth3", "nodes2", "nodes3"],
)  # fmt: skip
def test_gpu_schedule_on_a_lazy_runtime(comm, lazy_gpu: LazyRuntime, env: dict[str, str]) -> None:
    from mpigpu.core._cuda import StreamRef
    from mpigpu.core.arrays import ArrayView
    from mpigpu.job.device import GpuInfo

    if "MPIGPU_NODE_SIZE" in env and int(env["MPIGPU_NODE_SIZE"]) >= comm.Get_size():
        pytest.skip("a single node")
    caller = 7  # the caller's stream
    with context_with(comm, env) as ctx:
        ctx.gpu = GpuInfo(0, "fake", "0000:00:00.0", "", (9, 0), 1, None)
        backend, rank, n = ctx.backend("host"), ctx.rank, ctx.size
        problems = []
        for name in ["float16", "bfloat16", "float32", "float64", "int8", "uint64"]:
            dtype = DTYPES[name]
            for op in Op:
                for count in COUNTS:
                    x = np.empty(count, dtype.np)
                    fill(x, "exact", op, rank, n)
                    out = _poisoned_like(x)
                    xv, ov = (ArrayView(a, a.ctypes.data, a.shape, dtype, 0, False, "cupy") for a in (x, out))
                    backend.allreduce(xv, ov, op, StreamRef(caller))
                    lazy_gpu.streamSynchronize(caller)
                    wrong = count_wrong_host(out, "exact", op, dtype, n)
                    backend.allreduce(xv, xv, op, StreamRef(caller))
                    lazy_gpu.streamSynchronize(caller)
                    same = np.array_equal(x.view(np.uint8), out.view(np.uint8))
                    wrong, distinct = comm.allreduce(wrong), len(set(comm.allgather(_digest(out))))
                    if wrong or distinct != 1 or comm.allreduce(int(not same)):
                        problems.append(f"{name} {op.value} x{count}: {wrong} wrong, {distinct} distinct")
        assert not problems, "; ".join(problems)
        if n > 1:
            assert {"copy_out", "reduce", "copy_in"} <= set(backend.last_phases)
            assert lazy_gpu.registered, "the segment is pinned for GPU arrays"
    assert not lazy_gpu.registered and not lazy_gpu.events and not lazy_gpu.streams, "close() releases all"


# -- larger jobs in a subprocess (serial tests) ----------------------------------------------------
def test_eight_ranks_on_virtual_nodes() -> None:
    """8 ranks as 4 nodes of 2 and 2 nodes of 4, plus the exchange between 8 members."""
    from conftest import run_mpi

    tests = [f"tests/backends/test_host_mpi.py::{name}" for name in ("test_virtual_nodes[2]", "test_virtual_nodes[4]")]
    tests.append("tests/backends/test_host_mpi.py::test_internode_exchange_is_exact_and_identical")
    result = run_mpi(
        8,
        ["-m", "pytest", "-q", "-x", "--with-mpi", "--only-mpi", "-p", "no:cacheprovider", *tests],
        timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


@pytest.mark.parametrize("node_size", ["2", "3"])
def test_average_command_with_virtual_nodes(tmp_path, node_size: str) -> None:
    """MPIGPU_NODE_SIZE from the environment, end to end through `python -m mpigpu.average`."""
    from conftest import run_mpi

    path = tmp_path / "average.json"
    result = run_mpi(
        4,
        ["-m", "mpigpu.average", "--backend", "host", "--device", "cpu", "--size", "300007", "--dtype", "float32",
         "--out-of-place", "--iters", "3", "--warmup", "1", "--json", str(path)],
        env={"MPIGPU_NODE_SIZE": node_size},
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(path.read_text())
    assert document["ok"] and document["nodes"] == 2 and document["backend"] == "host"
    assert "internode" in document["results"][0]["phases_us"]


@pytest.mark.mpi(min_size=2)
def test_auto_takes_host_in_its_measured_windows_with_the_same_bits_on_every_rank(comm) -> None:
    """auto's rule for NumPy arrays (mpigpu.backends.host.AUTO_HOST_WINDOWS): cpu at 8 B and 256 KiB,
    host at 64 KiB (its latency route), 2 MiB and 8 MiB (its pipeline); through either, a NaN whose
    payload differs per rank and an IEEE NaN (+inf + -inf) end as the same bits on every rank."""
    rank = comm.Get_rank()
    sizes = Context.get(comm).layout.node_sizes  # across nodes, or 8 ranks and more: the layout's rule
    for nbytes, want in ((8, "cpu"), (64 << 10, "host"), (256 << 10, "cpu"), (2 << 20, "host"), (8 << 20, "host")):
        rule = layout_rule(sizes, nbytes)
        want = want if rule is None else rule.backend
        x = np.full(nbytes // 4, -0.0, np.float32)
        assert mpigpu.explain(x, "sum", comm=comm).backend == want, nbytes
        x.view("u4")[0] = 0x7F800001 + rank | (rank % 2) << 31  # a signalling NaN of this rank's own
        x[-1] = np.inf if rank % 2 == 0 else -np.inf
        for _ in range(2):  # the first call binds the record's launch, the second runs it
            y = x.copy()
            mpigpu.allreduce(y, "sum", comm=comm)
            assert np.flatnonzero(np.isnan(y)).tolist() == [0, y.size - 1], nbytes
            assert np.array_equal(y[1:-1].view("u4"), x[1:-1].view("u4")), "-0.0 + -0.0 stays -0.0"
            assert len(set(comm.allgather(y.tobytes()))) == 1, f"{nbytes} B: ranks hold different bits"
