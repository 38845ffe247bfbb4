"""mpigpu.jax's compiled FFI handler (issue 38) on JAX CPU arrays: which calls it takes, the same bits as
the Python handler, every rank deciding alike, its build cache, and the watchdog seeing its calls.

The MPI tests run under mpiexec (-n 1 to 4); the others build the library into a private cache here.
Without a C++ compiler the tests that need the compiled handler skip, saying so (the Python handler then
runs every call, as tests/jax/test_jax_mpi.py checks); .ci/run fails on a machine without one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import stat
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import missing_compiler, run_mpi

jax = pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")
jnp = jax.numpy

from mpigpu.core.errors import ConfigError  # noqa: E402
from mpigpu.jax import _native  # noqa: E402

mpi = pytest.mark.mpi(min_size=1)
# float64 kept 64-bit, and the CPU programs carrying their token on GPU machines too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jax_x64", "jax_cpu_programs_tokened")


needs_compiler = pytest.mark.skipif(
    missing_compiler("c++") is not None, reason=f"the compiled handler: {missing_compiler('c++')}"
)


def _mj():
    import mpigpu.jax as mj

    mj.init()
    return mj


def _handler(monkeypatch, mode: str) -> None:
    """Programs lowered from here on in this test use MPIGPU_JAX_HANDLER=``mode`` on the world's channel."""
    from mpigpu.jax._comms import channel, comm_key

    ctx = channel(comm_key()).ctx
    monkeypatch.setattr(ctx, "settings", dataclasses.replace(ctx.settings, jax_handler=mode))


def _cpu(x):
    """On JAX's CPU device (the MPI path of the compiled handler), on GPU machines too."""
    return jax.device_put(np.asarray(x), jax.devices("cpu")[0])


def _run_both(monkeypatch, make, x):
    """(compiled handler's result, Python handler's result, the handlers the two programs were compiled with)."""
    mj = _mj()
    _handler(monkeypatch, "auto")
    compiled = np.asarray(jax.jit(make(mj))(x))
    first = mj.compiled_calls()[-1]
    _handler(monkeypatch, "python")
    python = np.asarray(jax.jit(make(mj))(x))
    second = mj.compiled_calls()[-1]
    return compiled, python, (first.handler, second.handler)


CASES = [  # (dtype, op): every one the compiled handler takes on the host
    ("float32", "sum"),
    ("float32", "avg"),
    ("float64", "avg"),
    ("float64", "prod"),
    ("int32", "sum"),
    ("int64", "max"),
    ("int32", "min"),
]


@needs_compiler
@mpi
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_allreduce_compiled_equals_the_reference_and_the_python_handler(comm, monkeypatch, dtype: str, op: str) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    base = np.arange(1, 38, dtype=np.float64)  # small integers: every sum and product here is exact
    x = (base + rank if op != "prod" else np.where(base % 3 == 0, 2.0, 1.0)).astype(dtype)
    every = [(base + r if op != "prod" else np.where(base % 3 == 0, 2.0, 1.0)) for r in range(size)]
    reference = {"sum": np.sum, "avg": np.mean, "prod": np.prod, "max": np.max, "min": np.min}[op](every, axis=0)
    compiled, python, handlers = _run_both(monkeypatch, lambda mj: lambda v: mj.allreduce(v, op), _cpu(x))
    expected = "compiled" if size > 1 else "python"
    assert handlers == (expected, "python")
    assert compiled.dtype == np.dtype(dtype)
    if np.dtype(dtype).kind == "f" or op != "avg":
        assert np.array_equal(compiled.astype(np.float64), reference.astype(dtype).astype(np.float64))
    assert compiled.tobytes() == python.tobytes()


@needs_compiler
@mpi
def test_nan_is_made_canonical_as_the_python_handler_makes_it(comm, monkeypatch) -> None:
    """A NaN with payload and sign bits comes out as the canonical NaN on both handlers, bit for bit (one
    rank: the input, copied)."""
    odd_nan = np.array([0xFFC00123, 0x3F800000, 0x7F800001], np.uint32).view(np.float32)  # -NaN, 1.0, sNaN
    for op in ("sum", "avg"):
        compiled, python, handlers = _run_both(
            monkeypatch, lambda mj, op=op: lambda v: mj.allreduce(v, op), _cpu(odd_nan)
        )
        if comm.Get_size() > 1:
            assert compiled.view(np.uint32)[0] == 0x7FC00000 and compiled.view(np.uint32)[2] == 0x7FC00000
        assert compiled.tobytes() == python.tobytes(), (handlers, compiled.view(np.uint32), python.view(np.uint32))


@needs_compiler
@mpi
def test_broadcast_and_allgather_compiled(comm, monkeypatch) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _cpu(np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * rank)
    root = size - 1
    got, python, handlers = _run_both(monkeypatch, lambda mj: lambda v: mj.broadcast(v, root=root), x)
    assert handlers[0] == ("compiled" if size > 1 else "python")
    assert np.array_equal(got, np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * root)
    assert got.tobytes() == python.tobytes()
    got, python, handlers = _run_both(monkeypatch, lambda mj: lambda v: mj.allgather(v), x)
    assert np.array_equal(got, np.concatenate([np.arange(6.0).reshape(2, 3) + 10 * r for r in range(size)]))
    assert got.tobytes() == python.tobytes()


@needs_compiler
@pytest.mark.mpi(min_size=2)
def test_calls_it_does_not_take_run_on_the_python_handler_and_say_why(comm, monkeypatch) -> None:
    mj = _mj()
    _handler(monkeypatch, "auto")
    x = _cpu(np.arange(5, dtype=np.float32) - comm.Get_rank())
    out = np.asarray(jax.jit(lambda v: mj.allreduce(v, "max"))(x))
    assert np.array_equal(out, np.arange(5, dtype=np.float32))
    record = mj.compiled_calls()[-1]
    assert record.handler == "python" and "keys" in record.handler_reason, record
    # a long jit of several calls: each on its own handler, in program order
    f = jax.jit(lambda v: (mj.allreduce(v, "sum"), mj.allreduce(v, "max"), mj.allreduce(v * 2, "avg")))
    total, top, mean = (np.asarray(a) for a in f(x))
    size = comm.Get_size()
    assert np.array_equal(total, sum(np.arange(5, dtype=np.float32) - r for r in range(size)))
    assert np.array_equal(top, np.arange(5, dtype=np.float32))
    assert np.array_equal(mean, 2 * np.mean([np.arange(5.0) - r for r in range(size)], axis=0))
    assert [c.handler for c in mj.compiled_calls()[-3:]] == ["compiled", "python", "compiled"]


@pytest.mark.mpi(min_size=2)
def test_one_rank_that_cannot_makes_every_rank_use_the_python_handler(comm, monkeypatch) -> None:
    """The handlers need not make the same library calls (broadcast in pieces, MPI_Allgatherv): every rank
    decides alike, from every rank's verdict."""
    mj = _mj()
    _handler(monkeypatch, "auto")
    if comm.Get_rank() == 1:
        monkeypatch.setattr(_native, "local_verdict", lambda *args: "no compiler on this node (test)")
    x = _cpu(np.arange(4, dtype=np.float32))
    out = np.asarray(jax.jit(lambda v: mj.allgather(v))(x))
    assert np.array_equal(out, np.tile(np.arange(4, dtype=np.float32), comm.Get_size()))
    record = mj.compiled_calls()[-1]
    assert record.handler == "python" and "rank 1: no compiler on this node (test)" in record.handler_reason


@needs_compiler
@pytest.mark.mpi(min_size=2)
def test_compiled_demanded_on_one_rank_raises_on_every_rank_and_the_next_call_pairs(comm, monkeypatch) -> None:
    mj = _mj()
    rank = comm.Get_rank()
    _handler(monkeypatch, "compiled" if rank == 0 else "auto")
    x = _cpu(np.arange(3, dtype=np.float32))
    with pytest.raises(ConfigError, match=r"MPIGPU_JAX_HANDLER=compiled on rank\(s\) 0.*rank \d: float32 max"):
        jax.jit(lambda v: mj.allreduce(v, "max"))(x)
    out = np.asarray(jax.jit(lambda v: mj.allreduce(v + 1, "sum"))(x))
    assert np.array_equal(out, comm.Get_size() * (np.arange(3, dtype=np.float32) + 1))
    assert mj.compiled_calls()[-1].handler == "compiled"


# -- serial: the decision, the build, the cache ------------------------------------------------------------------


class _FakeCheck:
    def __init__(self, verdicts):
        self.verdicts = verdicts

    def allgather(self, mine):
        return self.verdicts


def test_agree_is_the_same_decision_from_every_ranks_verdict() -> None:
    assert _native.agree(_FakeCheck([(None, False), (None, True)]), None, "auto") is None
    reason = _native.agree(_FakeCheck([(None, False), ("no compiler", False)]), None, "auto")
    assert reason == "rank 1: no compiler"
    with pytest.raises(ConfigError, match=r"compiled on rank\(s\) 0.*rank 1: no compiler"):
        _native.agree(_FakeCheck([(None, True), ("no compiler", False)]), None, "compiled")
    many = _native.agree(_FakeCheck([("x", False)] * 6), "x", "auto")
    assert many is not None and many.endswith("and 2 more ranks")


def test_the_per_device_verdict_takes_gpus_on_the_nccl_path_only(monkeypatch) -> None:
    """Host devices, other paths, one participant, an empty array and more GPUs than a slot holds keep the
    Python handler, each with its reason; GPUs on the nccl path take the compiled one where it is loaded."""
    from types import SimpleNamespace

    def verdict(mode="auto", on_gpu=True, backend="nccl", total=4, count=2, size=8):
        ctx = SimpleNamespace(settings=SimpleNamespace(jax_handler=mode))
        return _native.per_device_verdict(ctx, SimpleNamespace(total=total, count=count), backend, on_gpu, size)

    monkeypatch.setattr(_native, "_not_loaded", lambda on_gpu: None)
    assert verdict() is None
    assert verdict(mode="python") == "MPIGPU_JAX_HANDLER=python"
    assert verdict(on_gpu=False, backend="cpu") == "host devices: MPI has no communicator per device"
    assert "the host path" in verdict(backend="host")
    assert "the cuda-aware path" in verdict(backend="cuda-aware")
    assert verdict(total=1, count=1).startswith("one participant")
    assert verdict(size=0) == "an empty array"
    assert verdict(count=_native.MAX_DEVICES + 1) == f"{_native.MAX_DEVICES + 1} GPUs in one process: a " \
        f"per-device slot holds {_native.MAX_DEVICES}"  # fmt: skip
    monkeypatch.setattr(_native, "_not_loaded", lambda on_gpu: "no compiler")
    assert verdict() == "no compiler"


class _FakeComms:
    def __init__(self, gpus: list[int], handles: list[int]) -> None:
        self.gpus, self._handles = gpus, handles

    def handles(self) -> list[int]:
        return self._handles


def test_a_per_device_slot_holds_each_gpus_communicator_by_its_cuda_ordinal() -> None:
    """GPUs 2 and 3 of a process (positions 0 and 1), their communicators in the same order, ncclAvg dividing
    by every participant; the rest of the table empty; equal tables share a slot, others do not."""
    import re

    from mpigpu.core.dtypes import parse_dtype
    from mpigpu.core.ops import Op

    source = (Path(_native.__file__).parent / _native.SOURCE).read_text()
    assert re.search(rf"constexpr int kMaxDevices = {_native.MAX_DEVICES};", source)
    f32 = parse_dtype(np.dtype("float32"))
    slot = _native.per_device_values(_FakeComms([2, 3], [0x1000, 0x2000]), 4, f32, Op.AVG, 0x77)
    assert (slot.kind, slot.collective, slot.devices, slot.nranks, slot.fn) == (1, 0, 2, 4, 0x77)
    assert (slot.datatype, slot.op, slot.comm) == (f32.nccl, Op.AVG.nccl, 0)
    assert list(slot.ordinals) == [2, 3] + [0] * (_native.MAX_DEVICES - 2)
    assert list(slot.comms) == [0x1000, 0x2000] + [0] * (_native.MAX_DEVICES - 2)
    again = _native.per_device_values(_FakeComms([2, 3], [0x1000, 0x2000]), 4, f32, Op.AVG, 0x77)
    other = _native.per_device_values(_FakeComms([2, 3], [0x1000, 0x3000]), 4, f32, Op.AVG, 0x77)
    assert hash(slot.key()) == hash(again.key()) and slot.key() == again.key() and slot.key() != other.key()
    with pytest.raises(IndexError):  # more GPUs than the table holds: the verdict keeps those calls away
        _native.per_device_values(_FakeComms(list(range(17)), list(range(17))), 17, f32, Op.SUM, 0x77)


@pytest.fixture
def fresh_library(monkeypatch, tmp_path: Path):
    """A process state with no library decided yet, and a cache of this test's own."""
    monkeypatch.setenv("MPIGPU_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "_state", [])
    return tmp_path / "cache" / "jax"


def _entries(where: Path) -> list[Path]:
    return sorted(p for p in where.iterdir() if p.name.endswith(".so"))


@needs_compiler
def test_built_once_cached_privately_then_loaded_and_rebuilt_when_corrupt(fresh_library: Path, capfd) -> None:
    first = _native.library()
    assert isinstance(first, _native.Library), first
    assert not first.cached
    (entry,) = _entries(fresh_library)
    assert stat.S_IMODE(fresh_library.stat().st_mode) == 0o700 and stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert first.dll.mpigpu_native_slot_bytes() == ctypes.sizeof(_native.Slot)  # per-device table included
    _native._state.clear()
    second = _native.library()
    assert isinstance(second, _native.Library) and second.cached
    stored = entry.read_bytes()
    entry.write_bytes(stored[: len(stored) // 2])  # truncated: never loaded, rebuilt and replaced
    _native._state.clear()
    third = _native.library()
    assert isinstance(third, _native.Library) and not third.cached
    assert "corrupt or truncated: rebuilding it" in capfd.readouterr().err


@needs_compiler
def test_an_entry_another_user_could_have_written_is_not_loaded(fresh_library: Path, capfd) -> None:
    assert isinstance(_native.library(), _native.Library)
    (entry,) = _entries(fresh_library)
    os.chmod(entry, 0o666)  # writable by others: what it holds is not trusted
    _native._state.clear()
    again = _native.library()
    assert isinstance(again, _native.Library) and not again.cached
    assert "not using the compiled-handler cache entry" in capfd.readouterr().err


def test_no_compiler_leaves_the_python_handler_with_the_reason(fresh_library: Path, monkeypatch) -> None:
    monkeypatch.setenv("CXX", str(fresh_library / "no-such-c++"))
    found = _native.library()
    assert isinstance(found, str) and "no-such-c++" in found and "Python handler" in found


STALL = textwrap.dedent("""
    import sys
    import time
    import numpy as np
    import jax
    import mpigpu.jax as mj
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    f = jax.jit(lambda v: mj.allreduce(v, "sum"))
    x = np.arange(4, dtype=np.float32)
    f(x).block_until_ready()
    if rank == 1:
        time.sleep(2.5)  # rank 0 waits in the compiled handler's MPI_Allreduce meanwhile
    out = np.asarray(f(x)).tolist()
    sys.stdout.write(f"{rank} {out} {mj.compiled_calls()[-1].handler}\\n")  # one write: lines never interleave
""")


@needs_compiler
def test_the_watchdog_reports_a_stall_inside_the_compiled_handler(tmp_path: Path) -> None:
    script = tmp_path / "stall.py"
    script.write_text(STALL)
    result = run_mpi(2, [str(script)], timeout=120, env={"MPIGPU_STALL": "0.5", "MPIGPU_CACHE_DIR": str(tmp_path)})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "0 [0.0, 2.0, 4.0, 6.0] compiled" in output, output
    assert "stalled: waiting" in output and "mpigpu.jax allreduce(cpu, float32, compiled handler)" in output, output


def test_cpu_programs_keep_the_token_and_refuse_an_untokened_call() -> None:
    """Issue 38: GPU programs drop the ordered effect (JAX's fast dispatch); CPU programs must keep it (the
    CPU runtime runs programs concurrently), so a call traced without it is refused when compiled for the CPU."""
    from mpigpu.core.errors import InvalidArgument
    from mpigpu.jax import _primitive
    from mpigpu.jax._comms import comm_key

    x = _cpu(np.ones(3, np.float32))
    with pytest.MonkeyPatch.context() as auto:
        auto.setattr(_primitive, "_order_setting", lambda: "auto")
        assert _primitive.ordered_calls(x)  # a concrete array on the CPU (a call outside jit), GPU machines too
        on_gpu = jax.devices()[0].platform == "gpu"
        assert _primitive.ordered_calls() is not on_gpu  # inside jit: JAX's default device decides
    untokened = jax.jit(lambda v: _primitive.allreduce_p.bind(v, op="sum", comm=comm_key(), backend="auto",
                                                             ordered=False))  # fmt: skip
    with pytest.raises(InvalidArgument, match="MPIGPU_JAX_ORDER=tokens"):
        untokened(x)
    assert "stablehlo.token" in jax.jit(lambda v: _mj().allreduce(v, "sum")).lower(x).as_text()
