"""The ipc backend without a GPU: launch planning (pieces, slices, grids) checked against the
kernel's indexing, the constants shared with kernels/ipc.cu, the probe's reasons, auto's rules,
and (under mpiexec) that ipc is unavailable with a reason and its extras fail on every rank alike.
The kernel itself runs in tests/gpu/test_ipc.py and scripts/sanitize-ipc.sh."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mpigpu.backends import Availability
from mpigpu.backends import ipc_plan as P
from mpigpu.backends.ipc import AUTO_MAX_BYTES as IPC_MAX_BYTES
from mpigpu.backends.ipc import IpcBackend
from mpigpu.backends.ipc_memory import collective_step
from mpigpu.core.arrays import ArrayView
from mpigpu.core.dtypes import DTYPES
from mpigpu.core.errors import BackendUnavailable, InvalidArgument
from mpigpu.core.ops import Op
from mpigpu.runtime.plan import choose
from mpigpu.runtime.tuning import TuningTable

KERNEL = Path(__file__).resolve().parents[2] / "mpigpu" / "kernels" / "ipc.cu"


# -- constants shared with the kernel -------------------------------------------------------------
def test_constants_match_the_kernel() -> None:
    defines = dict(re.findall(r"^#define (IPC_\w+) (\d+)", KERNEL.read_text(), re.MULTILINE))
    assert int(defines["IPC_MAX_RANKS"]) == P.MAX_RANKS
    assert int(defines["IPC_MAX_BLOCKS"]) == P.MAX_BLOCKS
    assert int(defines["IPC_SIGNAL_BYTES"]) == P.SIGNAL_BYTES
    assert int(defines["IPC_TABLE_OFFSET"]) == P.TABLE_OFFSET
    assert int(defines["IPC_MAX_THREADS"]) == P.MAX_THREADS
    assert int(defines["IPC_FLAG_TEMP_RESULT"]) == P.FLAG_TEMP_RESULT
    assert P.DEFAULT_MAX_BLOCKS <= P.MAX_BLOCKS
    assert P.STAGE_BYTES % P.PACK_BYTES == 0 and P.SIGNAL_BYTES % 256 == 0


# -- planning -------------------------------------------------------------------------------------
def _owners(launch: P.Launch, itemsize: int, nranks: int) -> tuple[np.ndarray, np.ndarray]:
    """For each element of a launch: the rank that reduces it (two-shot: the owner of its slice;
    one-shot: -1, every rank) and the block that handles it, by the kernel's indexing: element
    e is in pack k = (e - lo) // V of its range, handled by global thread k % (blocks * threads)."""
    per = P.PACK_BYTES // itemsize
    e = np.arange(launch.count, dtype=np.int64)
    if launch.slice == 0:
        owner, lo = np.full_like(e, -1), np.zeros_like(e)
    else:
        owner = e // launch.slice
        lo = owner * launch.slice
        assert ((e - lo) // per < -(-launch.slice // per)).all(), "every pack inside its slice's loop"
    thread = ((e - lo) // per) % (launch.blocks * launch.threads)
    return owner, thread // launch.threads


CASES = [
    (count, dtype, nranks, two_shot)
    for count in (1, 7, 15, 16, 17, 4099, 65536, 100003)
    for dtype in ("int8", "float16", "float32", "float64")
    for nranks in (1, 2, 3, 4, 8)
    for two_shot in (None, 0)
]


@pytest.mark.parametrize(("count", "dtype", "nranks", "two_shot"), CASES)
def test_pieces_and_slices_cover_every_element_once(count: int, dtype: str, nranks: int, two_shot: int | None) -> None:
    itemsize = DTYPES[dtype].itemsize
    stage = 4096 * 16  # small staging buffers: several pieces for the larger counts
    launches = P.plan_launches(count, itemsize, nranks, stage_bytes=stage, two_shot_min_bytes=two_shot, max_blocks=5)
    assert [x.first for x in launches] == list(range(0, count, stage // itemsize))
    assert sum(x.count for x in launches) == count
    for launch in launches:
        assert launch.count * itemsize <= stage
        assert 1 <= launch.blocks <= 5 and launch.threads % 32 == 0 and 32 <= launch.threads <= P.MAX_THREADS
        if two_shot is None or nranks == 1:
            assert launch.slice == 0
        else:
            assert launch.slice % (P.PACK_BYTES // itemsize) == 0 and launch.slice * nranks >= launch.count
        owner, block = _owners(launch, itemsize, nranks)
        assert (owner < nranks).all(), "every element belongs to exactly one rank's slice"
        assert (block >= 0).all() and (block < launch.blocks).all()


def test_two_shot_slices_keep_16_byte_alignment() -> None:
    for dtype in ("int8", "float16", "float32", "float64"):
        itemsize = DTYPES[dtype].itemsize
        (launch,) = P.plan_launches(1000003, itemsize, 3, two_shot_min_bytes=0)
        assert (launch.slice * itemsize) % P.PACK_BYTES == 0


def test_small_messages_get_one_warp_and_large_ones_the_block_limit() -> None:
    assert P.plan_launches(2, 4, 4) == (P.Launch(0, 2, 0, 1, 32),)
    (big,) = P.plan_launches(1 << 20, 4, 4, two_shot_min_bytes=None, max_blocks=32)
    assert big.blocks == 32 and big.threads == P.MAX_THREADS
    assert P.plan_launches(0, 4, 4) == ()


def test_two_shot_only_from_the_threshold_and_never_by_default_on_two_ranks() -> None:
    assert P.default_two_shot_min(2) is None
    threshold = P.default_two_shot_min(4)
    assert threshold == P.TWO_SHOT_MIN_BYTES
    below = P.plan_launches(threshold // 4 - 1, 4, 4, two_shot_min_bytes=threshold)
    at = P.plan_launches(threshold // 4, 4, 4, two_shot_min_bytes=threshold)
    assert below[0].slice == 0 and at[0].slice == threshold // 16


def test_messages_larger_than_a_staging_buffer_go_in_pieces() -> None:
    launches = P.plan_launches(P.STAGE_BYTES // 8 * 2 + 5, 8, 4)
    assert [x.count for x in launches] == [P.STAGE_BYTES // 8, P.STAGE_BYTES // 8, 5]
    assert P.allocation_bytes() == P.SIGNAL_BYTES + 2 * P.STAGE_BYTES


@pytest.mark.parametrize(
    "kwargs", [{"nranks": 0}, {"nranks": 9}, {"itemsize": 3}, {"stage_bytes": 24}, {"max_blocks": 65}]
)
def test_plan_refuses_impossible_shapes(kwargs: dict) -> None:
    args = {"count": 10, "itemsize": 4, "nranks": 2} | kwargs
    count, itemsize, nranks = args.pop("count"), args.pop("itemsize"), args.pop("nranks")
    with pytest.raises(ValueError):
        P.plan_launches(count, itemsize, nranks, **args)


# -- collective_step: a step failing on one rank fails on all -----------------------------------------------
class _Comm:
    """A stand-in node communicator for text exchanges (mpigpu.core.typed.allgather_text): the other
    ranks hold ``others`` (text, or None for the empty text), placed around this rank's value."""

    def __init__(self, rank: int, others: list) -> None:
        self.rank = rank
        self.others = [(value or "").encode() for value in others]

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return len(self.others) + 1

    def _everyone(self, mine: bytes) -> list[bytes]:
        everyone = list(self.others)
        everyone.insert(self.rank, mine)
        return everyone

    def Allgather(self, send, recv) -> None:  # the text lengths
        lengths = [len(data) for data in self._everyone(b"")]
        lengths[self.rank] = int(send[0][0])
        recv[0][...] = np.array(lengths, np.int64).reshape(recv[0].shape)

    def Allgatherv(self, send, recv) -> None:  # the UTF-8 bytes
        data = b"".join(self._everyone(send[0].tobytes()))
        recv[0][: len(data)] = np.frombuffer(data, np.uint8)


def test_agree_returns_the_value_when_every_rank_succeeds() -> None:
    assert collective_step(_Comm(0, [None]), "step", lambda: 42) == 42


def test_agree_raises_everywhere_and_undoes_local_success() -> None:
    undone = []
    with pytest.raises(BackendUnavailable, match=r"step failed on node rank 1: RuntimeError: boom"):
        collective_step(_Comm(0, ["RuntimeError: boom"]), "step", lambda: 7, undone.append)
    assert undone == [7]

    def fail() -> int:
        raise RuntimeError("cudaErrorPeerAccessUnsupported: peer access is not supported")

    with pytest.raises(BackendUnavailable, match=r"node rank 0 \(and on 1 more rank\(s\)\).*PeerAccessUnsupported"):
        collective_step(_Comm(0, ["RuntimeError: x"]), "step", fail)
    with pytest.raises(InvalidArgument, match="ipc_buffer failed on node rank 1: InvalidArgument: bad shape"):
        collective_step(_Comm(0, ["InvalidArgument: bad shape"]), "ipc_buffer", lambda: 1, error=InvalidArgument)


# -- probe reasons (before any CUDA call) ---------------------------------------------------------
def _ctx(**changes) -> SimpleNamespace:
    gpu = SimpleNamespace(index=0, pci_bus_id="0000:19:00.0", compute_capability=(9, 0), describe=lambda: "GPU 0")
    layout = SimpleNamespace(num_nodes=1, virtual=False, node_comm=_Comm(0, ["0000:3b:00.0"]))
    ctx = SimpleNamespace(all_have_gpus=True, size=2, layout=layout, gpu=gpu)
    for key, value in changes.items():
        target = layout if key in ("num_nodes", "virtual", "node_comm") else ctx
        setattr(target, key, value)
    return ctx


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"all_have_gpus": False}, "needs a GPU on every rank"),
        ({"num_nodes": 2}, "span 2 nodes; CUDA IPC connects the GPUs of one node only"),
        ({"num_nodes": 2, "virtual": True}, r"span 2 virtual nodes \(MPIGPU_NODE_SIZE\)"),
        ({"size": 9}, "at most 8 GPUs"),
        ({"node_comm": _Comm(0, ["0000:19:00.0"])}, "ranks share GPUs"),
    ],
)
def test_probe_says_why_ipc_cannot_run(changes: dict, reason: str) -> None:
    available = IpcBackend.probe(_ctx(**changes))
    assert not available.ok
    assert re.search(reason, available.reason)


def test_ipc_supports_every_dtype_and_op() -> None:
    for dtype in DTYPES.values():
        for op in Op:
            assert IpcBackend.supports(dtype, op) is None


# -- auto -----------------------------------------------------------------------------------------
def _device_view(nbytes: int) -> ArrayView:
    dtype = DTYPES["float32"]
    return ArrayView(None, 0, (nbytes // 4,), dtype, 0, False, "cupy")


def _plan_ctx(ipc_ok: bool, tuning: TuningTable | None = None) -> SimpleNamespace:
    availability = {
        "ipc": Availability(ipc_ok, "ok" if ipc_ok else "the ranks span 2 nodes"),
        "nccl": Availability(True, "ok"),
        "cuda-aware": Availability(False, "not CUDA-aware"),
        "host": Availability(True, "ok"),
        "cpu": Availability(True, "ok"),
    }
    layout = SimpleNamespace(node_sizes=(2,))  # one node of 2 ranks: the layout the table's reason names
    return SimpleNamespace(availability=availability, tuning=tuning, size=2, layout=layout)


def test_auto_uses_ipc_up_to_the_crossover_then_nccl() -> None:
    ctx = _plan_ctx(True)
    assert choose(ctx, _device_view(8), Op.AVG, "auto").backend == "ipc"
    assert choose(ctx, _device_view(IPC_MAX_BYTES), Op.AVG, "auto").backend == "ipc"
    above = choose(ctx, _device_view(IPC_MAX_BYTES + 4), Op.AVG, "auto")
    assert above.backend == "nccl" and "ipc: message above" in above.reason


def test_auto_never_picks_an_unavailable_ipc_even_when_the_table_says_so() -> None:
    table = TuningTable(signature={}, bands={"device": [(1 << 20, "ipc"), (1 << 40, "nccl")]}, source="t.json")
    assert choose(_plan_ctx(True, table), _device_view(1 << 20), Op.SUM, "auto").backend == "ipc"
    choice = choose(_plan_ctx(False, table), _device_view(8), Op.SUM, "auto")
    assert choice.backend == "nccl" and "ipc: the ranks span 2 nodes" in choice.reason


def test_auto_never_takes_ipc_when_the_job_spans_nodes() -> None:
    """The decision end to end, as a job over two MPI nodes meets it (gpu-check's nodes stage runs it on GPUs):
    ipc's own probe refuses the layout, and auto then never picks ipc, for any size ipc would take on one
    node, either reduction, or a tuning table that names ipc (measured on one node and carried over)."""
    probed = IpcBackend.probe(_ctx(num_nodes=2))
    table = TuningTable(signature={}, bands={"device": [(4 << 20, "ipc"), (1 << 40, "nccl")]}, source="t.json")
    for tuning in (None, table):
        ctx = _plan_ctx(True, tuning)
        ctx.availability["ipc"] = probed
        for nbytes in (4, 8, 4096, 1 << 20, IPC_MAX_BYTES):
            for collective in ("allreduce", "reduce_scatter"):
                choice = choose(ctx, _device_view(nbytes), Op.SUM, "auto", collective)
                assert choice.backend == "nccl", (nbytes, collective, choice)
        ctx.availability["nccl"] = Availability(False, "no NCCL")
        choice = choose(ctx, _device_view(8), Op.SUM, "auto")
        assert choice.backend == "host" and "ipc: the ranks span 2 nodes" in choice.reason, choice


def test_auto_reduce_scatter_takes_nccl_before_ipc_and_no_allreduce_table() -> None:
    """ipc's reduce_scatter is its allreduce plus a copy (52-58 us on 2 x H100 where nccl's took 35-40), and
    the tuning table times allreduce only: a reduce_scatter follows the rules, nccl first, ipc where it cannot."""
    table = TuningTable(signature={}, bands={"device": [(1 << 20, "ipc"), (1 << 40, "nccl")]}, source="t.json")
    for tuning in (None, table):
        choice = choose(_plan_ctx(True, tuning), _device_view(8), Op.SUM, "auto", "reduce_scatter")
        assert choice.backend == "nccl" and choice.reason.startswith("rule"), choice
    assert choose(_plan_ctx(True, table), _device_view(8), Op.SUM, "auto").backend == "ipc"  # allreduce: the table
    ctx = _plan_ctx(True)
    ctx.availability["nccl"] = Availability(False, "no NCCL")
    choice = choose(ctx, _device_view(8), Op.SUM, "auto", "reduce_scatter")
    assert choice.backend == "ipc" and "nccl: no NCCL" in choice.reason


# -- import hygiene ---------------------------------------------------------------------------------
def test_importing_the_ipc_modules_loads_no_gpu_or_mpi_library() -> None:
    code = (
        "import sys, mpigpu.calls.ipc, mpigpu.backends.ipc, mpigpu.backends.ipc_memory, mpigpu.backends.ipc_plan\n"
        "bad = [m for m in ('cupy', 'cuda.core', 'mpi4py.MPI', 'torch', 'jax') if m in sys.modules]\n"
        "print(bad)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# -- under mpiexec, on a machine without GPUs ---------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_ipc_is_unavailable_without_gpus_with_the_reason(comm) -> None:
    from conftest import gpu_available

    from mpigpu.runtime.context import Context

    if gpu_available():
        pytest.skip("this machine has a GPU: tests/gpu/test_ipc.py covers it")
    ctx = Context.get(comm)
    state = ctx.availability["ipc"]
    assert not state.ok and state.reason == "needs a GPU on every rank"


@pytest.mark.mpi(min_size=1)
def test_ipc_buffer_and_graph_fail_alike_on_every_rank_without_gpus(comm) -> None:
    from conftest import gpu_available

    import mpigpu
    from mpigpu.calls.ipc import ipc_buffer, ipc_graph

    if gpu_available():
        pytest.skip("this machine has a GPU: tests/gpu/test_ipc.py covers it")
    with pytest.raises(BackendUnavailable, match=r"ipc_buffer needs the ipc backend.*needs a GPU on every rank"):
        ipc_buffer(16, "float32")
    with pytest.raises((BackendUnavailable, mpigpu.InvalidArgument)):
        ipc_graph(np.ones(4, np.float32), "sum")
    y = np.ones(3)  # the communicator still works: no rank was left behind in a collective
    mpigpu.allreduce(y, "sum")
    assert np.all(y == comm.Get_size())
