"""mpigpu.jax on JAX CPU arrays under mpiexec (-n 1 to 4): inside jax.jit against a float64 reference,
under jax.grad, in lax.scan, several collectives in one compiled function, vmap, average_tree, outside
jit, and mismatches across ranks raising MismatchError on every rank while compiling (nothing runs).

The serial tests at the end check what needs no MPI launch: ``import mpigpu`` does not import JAX,
and the lowered program threads one token through every collective (the ordering guarantee)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import ROOT

jax = pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")
jnp = jax.numpy

from mpigpu.core.dtypes import DTYPES  # noqa: E402
from mpigpu.core.errors import InvalidArgument, MismatchError  # noqa: E402
from mpigpu.core.ops import Op  # noqa: E402
from mpigpu.core.patterns import fill  # noqa: E402
from mpigpu.core.verify import count_wrong_host  # noqa: E402

mpi = pytest.mark.mpi(min_size=1)
# float64 kept 64-bit, and the CPU programs carrying their token on GPU machines too (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jax_x64", "jax_cpu_programs_tokened")


def _mj():
    """mpigpu.jax, with JAX bound to this rank's device (init: collective on the first call, every rank
    makes it in the first test; where every rank sees every GPU, JAX's default would be GPU 0 on all)."""
    import mpigpu.jax as mj

    mj.init()
    return mj


def _digest(arr) -> str:
    return hashlib.sha256(np.asarray(arr).tobytes()).hexdigest()


def _same_everywhere(comm, arr) -> None:
    assert len(set(comm.allgather(_digest(arr)))) == 1, "ranks hold different bits"


def _exact(count: int, dtype: str, op: Op, rank: int, size: int, offset: int = 0) -> np.ndarray:
    x = np.empty(count, DTYPES[dtype].np)
    fill(x, "exact", op, rank, size, offset)
    return x


def _cpu(x: np.ndarray):
    return jax.device_put(x, jax.devices("cpu")[0])


# -- exact results inside jit -------------------------------------------------------------------------------------


@mpi
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8"])
@pytest.mark.parametrize("op", list(Op))
def test_inside_jit_exact(comm, dtype: str, op: Op) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = _exact(1001, dtype, op, rank, size)
    before = x.copy()
    f = jax.jit(lambda v: _mj().allreduce(v, op.value))
    out = np.asarray(f(_cpu(x)))
    assert out.dtype == x.dtype and out.shape == x.shape
    assert count_wrong_host(out, "exact", op, DTYPES[dtype], size) == 0
    assert np.array_equal(x, before)
    _same_everywhere(comm, out)


@mpi
@pytest.mark.parametrize("shape", [(), (3, 5, 7), (0,), (2, 0)])
def test_shapes_and_empty(comm, shape: tuple[int, ...]) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    x = (np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + rank) * 2
    expected = sum((np.arange(x.size, dtype=np.float64).reshape(shape) + r) * 2 for r in range(size))
    out = jax.jit(lambda v: _mj().allreduce(v, "sum"))(_cpu(x))
    assert out.shape == shape
    assert np.array_equal(np.asarray(out), expected)


@mpi
def test_outside_jit_same_as_inside(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    x = _exact(777, "float32", Op.SUM, rank, size)
    eager = np.asarray(mj.allreduce(_cpu(x), "sum"))
    # NumPy input: converted on this rank's device (its GPU where it has one), reduced, a JAX array back
    from_numpy = np.asarray(mj.allreduce(x, "sum"))
    jitted = np.asarray(jax.jit(lambda v: mj.allreduce(v, "sum"))(_cpu(x)))
    assert count_wrong_host(eager, "exact", Op.SUM, DTYPES["float32"], size) == 0
    assert np.array_equal(eager, jitted) and np.array_equal(eager, from_numpy)


@mpi
def test_new_programs_work_after_finalize(comm) -> None:
    """mpigpu.finalize() closes mpigpu.jax's communicator; a program compiled after it sets up a new one
    (a test suite, or a program that finalizes between phases, must not be left with a dead channel)."""
    import mpigpu

    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    x = _exact(33, "float64", Op.SUM, rank, size)
    first = np.asarray(jax.jit(lambda v: mj.allreduce(v, "sum"))(_cpu(x)))
    mpigpu.finalize()
    again = np.asarray(jax.jit(lambda v: mj.allreduce(v * 1, "sum"))(_cpu(x)))  # a new program
    assert count_wrong_host(again, "exact", Op.SUM, DTYPES["float64"], size) == 0
    assert np.array_equal(first, again)


@mpi
def test_explicit_cpu_backend_and_unknown_backend(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    x = _exact(64, "int64", Op.MAX, rank, size)
    out = jax.jit(lambda v: mj.allreduce(v, "max", backend="cpu"))(_cpu(x))
    assert count_wrong_host(np.asarray(out), "exact", Op.MAX, DTYPES["int64"], size) == 0
    with pytest.raises(InvalidArgument, match="unknown backend"):
        mj.allreduce(x, backend="nope")
    with pytest.raises(InvalidArgument, match="unknown op"):
        mj.allreduce(x, op="mean")


# -- grad ---------------------------------------------------------------------------------------------------------


@mpi
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_grad_is_the_allreduce_of_the_cotangent(comm, op: str) -> None:
    """Rank r's loss is sum(c_r * allreduce(a_r * w)); its gradient in w is a_r * allreduce(c) (sum or avg)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    count = 50
    i = np.arange(count, dtype=np.float64)
    a = (i % 5 + 1 + rank).astype(np.float32)
    c = ((i + 3 * rank) % 7 - 3).astype(np.float32)
    w = (i % 3 + 1).astype(np.float32)

    def loss(w):
        return jnp.sum(jnp.asarray(c) * _mj().allreduce(jnp.asarray(a) * w, op))

    g = np.asarray(jax.jit(jax.grad(loss))(_cpu(w)))
    c_all = sum(((i + 3 * r) % 7 - 3) for r in range(size)).astype(np.float32)  # exact
    reduced = c_all / np.float32(size) if op == "avg" else c_all  # avg: one IEEE division in float32
    expected = a * reduced  # one rounding in float32, as the gradient's own product
    assert g.dtype == np.float32 and np.array_equal(g, expected)
    _same_everywhere(comm, g / a)


@mpi
def test_grad_of_max_refused(comm) -> None:
    def loss(w):
        return jnp.sum(_mj().allreduce(w, "max"))

    with pytest.raises(InvalidArgument, match="op='sum' and op='avg'"):
        jax.grad(loss)(_cpu(np.ones(4, np.float32)))


# -- ordering: scan, several collectives, repeated dispatch ----------------------------------------------------------


@mpi
def test_scan_over_steps(comm) -> None:
    """Each step averages the carry, adds the rank, and sums a counter: 2 collectives per step, 6 steps."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    steps = 6

    def body(carry, _):
        x, k = carry
        x = mj.allreduce(x, "avg") + rank
        k = mj.allreduce(k + 1, "sum")
        return (x, k), jnp.sum(x)

    x0 = np.arange(8, dtype=np.float64) * (rank + 1)
    run = jax.jit(lambda x, k: jax.lax.scan(body, (x, k), None, length=steps))
    (x, k), sums = run(_cpu(x0), _cpu(np.int64(rank)))
    # float64 reference: every rank's carry, stepped together
    xs = [np.arange(8, dtype=np.float64) * (r + 1) for r in range(size)]
    ks = list(range(size))
    expected_sums = []
    for _ in range(steps):
        mean = sum(xs) / size
        xs = [mean + r for r in range(size)]
        total = sum(kk + 1 for kk in ks)
        ks = [total] * size
        expected_sums.append(xs[rank].sum())
    assert np.array_equal(np.asarray(x), xs[rank])
    assert int(k) == ks[rank]
    assert np.array_equal(np.asarray(sums), np.array(expected_sums))


@mpi
def test_several_independent_collectives_in_one_function(comm) -> None:
    """Twelve collectives with no data dependency between them, of different sizes, dtypes and ops:
    the CPU runtime may run independent operations concurrently; the token keeps them in program order
    on every rank (out of order, the sizes would not match and MPI would fail or mix the data)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    specs = [(17 * (j + 1) + j * j, ["float32", "int32", "float64"][j % 3], list(Op)[j % 5]) for j in range(12)]
    inputs = [_exact(n, dt, op, rank, size, offset=j) for j, (n, dt, op) in enumerate(specs)]

    @jax.jit
    def many(*xs):
        return [mj.allreduce(x, op.value) for x, (_, _, op) in zip(xs, specs, strict=True)]

    for _ in range(3):
        outs = many(*[_cpu(x) for x in inputs])
        for j, (out, (_, dt, op)) in enumerate(zip(outs, specs, strict=True)):
            assert count_wrong_host(np.asarray(out), "exact", op, DTYPES[dt], size, offset=j) == 0, (j, dt, op)


@mpi
def test_many_dispatches_without_waiting(comm) -> None:
    """Twenty calls of a jitted function dispatched back to back (JAX runs them asynchronously): the
    ordered effect chains them, so each rank's k-th call meets every other rank's k-th call."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    f = jax.jit(lambda x, s: mj.allreduce(x * s, "sum"))
    x = _cpu(np.arange(1, 65, dtype=np.float64) + rank)
    outs = [f(x, float(step + 1)) for step in range(20)]
    base = sum(np.arange(1, 65, dtype=np.float64) + r for r in range(size))
    for step, out in enumerate(outs):
        assert np.array_equal(np.asarray(out), base * (step + 1))


def python_handler(monkeypatch) -> None:
    """Programs lowered from here on in this test run on the Python FFI handler (MPIGPU_JAX_HANDLER=python
    for the world's channel; the setting is read from the channel's context while lowering)."""
    import dataclasses

    from mpigpu.jax._comms import channel, comm_key

    ctx = channel(comm_key()).ctx
    monkeypatch.setattr(ctx, "settings", dataclasses.replace(ctx.settings, jax_handler="python"))


@mpi
def test_handler_keeps_its_thread_state_between_calls(comm, monkeypatch) -> None:
    """XLA runs the Python handler on threads Python does not know; ctypes used to make and delete a Python
    thread state around every call, so thread-local caches (the current GPU, cuda.core's and CuPy's) were
    rebuilt on every call. Now each XLA thread is new to Python once: at most one new state per thread,
    and the results stay exact (sums of small integers)."""
    from mpigpu.jax._ffi import record_times

    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    python_handler(monkeypatch)
    f = jax.jit(lambda x, s: mj.allreduce(x * s, "sum"))
    n = 1 << 14  # large enough that JAX's CPU runtime runs the program on its own threads, not inline
    x = _cpu(np.arange(1, n + 1, dtype=np.float64) + rank)
    base = sum(np.arange(1, n + 1, dtype=np.float64) + r for r in range(size))
    jax.block_until_ready(f(x, 1.0))  # compiled outside the record
    with record_times() as times:
        outs = [f(x, float(step + 1)) for step in range(30)]
        jax.block_until_ready(outs)
    for step, out in enumerate(outs):
        assert np.array_equal(np.asarray(out), base * (step + 1))
    assert times.calls == 30
    assert len(times.threads) >= 1 and times.fresh <= len(times.threads), (
        f"{times.fresh} of {times.calls} handler calls found a new Python thread state on {len(times.threads)} threads"
    )
    assert threading.main_thread().ident not in times.threads, "the handler ran inline: this test needs XLA's threads"
    assert times.cpu_seconds <= times.seconds + 1e-3


@mpi
def test_programs_pass_the_token_without_a_host_wait(comm, monkeypatch) -> None:
    """Two programs of different sizes, alternated and dispatched back to back: the host never waits for
    the previous program (JAX's runtime token used to be re-placed with block_until_ready before every
    call: host dispatch and device time in series), each program's input token is the previous one's
    output token (the data dependency that keeps every rank's collectives in order), and every result
    is exact (out of order, the sizes would not match between ranks)."""
    from jax._src import core, dispatch

    from mpigpu.jax._primitive import EFFECT

    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    big = _cpu(np.full((256, 256), 1e-3, np.float32))

    @jax.jit
    def f(x, s, m):  # a producer long enough that the CPU runtime runs the program asynchronously
        for _ in range(6):
            m = jnp.tanh(m @ m)
        return mj.allreduce(x * s + 0 * jnp.sum(m), "sum")

    g = jax.jit(lambda x: mj.allreduce(x, "max"))
    xf = _cpu(np.arange(1, 65, dtype=np.float64) + rank)
    xg = _cpu(_exact(100, "int32", Op.MAX, rank, size))
    jax.block_until_ready([f(xf, 1.0, big), g(xg)])  # compiled (collective) before counting
    waits, handed = [], []
    real_wait, real_input = core.Token.block_until_ready, dispatch.RuntimeTokenSet.get_token_input

    def counting_wait(self):
        waits.append(self)
        return real_wait(self)

    def recording_input(self, eff, devices):
        before = self.current_tokens.get(eff)
        token = real_input(self, eff, devices)
        if eff == EFFECT:
            handed.append(token is before)
        return token

    monkeypatch.setattr(core.Token, "block_until_ready", counting_wait)
    monkeypatch.setattr(dispatch.RuntimeTokenSet, "get_token_input", recording_input)
    outs = [(f(xf, float(k + 1), big), g(xg)) for k in range(10)]
    monkeypatch.undo()
    assert waits == [], f"the host waited for the previous program's token {len(waits)} times in 20 calls"
    assert handed == [True] * 20, handed
    base = sum(np.arange(1, 65, dtype=np.float64) + r for r in range(size))
    for k, (a, b) in enumerate(outs):
        assert np.array_equal(np.asarray(a), base * (k + 1)), k
        assert count_wrong_host(np.asarray(b), "exact", Op.MAX, DTYPES["int32"], size) == 0, k


def test_token_passing_is_only_for_mpigpus_effect_on_one_device() -> None:
    """Another effect, or mpigpu's inside jax_host_wait() (the benchmark's baseline), keeps JAX's own path."""
    from jax._src import core, dispatch

    from mpigpu.jax._primitive import EFFECT, TOKENS_PASSED
    from mpigpu.jax._tokens import jax_host_wait

    assert TOKENS_PASSED
    tokens = dispatch.RuntimeTokenSet()
    cpu = jax.devices("cpu")[0]
    mine = core.Token(jax.device_put(np.zeros(0, np.bool_), cpu))
    other_effect = object()
    tokens.current_tokens = {EFFECT: mine, other_effect: mine}
    assert tokens.get_token_input(EFFECT, [cpu]) is mine
    assert tokens.get_token_input(other_effect, [cpu]) is not mine  # JAX re-placed it
    with jax_host_wait():
        assert tokens.get_token_input(EFFECT, [cpu]) is not mine
    assert tokens.get_token_input(EFFECT, [cpu]) is mine


@mpi
def test_compiled_calls_name_the_backend(comm) -> None:
    """mpigpu.jax.compiled_calls() records each collective a program was compiled with: dtype, count,
    bytes, the requested and the chosen backend (what scripts/jax_step_bench.py prints per row)."""
    mj = _mj()
    tree = {"a": _cpu(np.ones((3, 4), np.float32)), "b": _cpu(np.ones(5, np.int32)), "c": _cpu(np.ones(2, np.float32))}
    jax.block_until_ready(jax.jit(lambda t: mj.average_tree(t, backend="cpu"))(tree))
    new = mj.compiled_calls()[-2:]  # the record keeps the last 256: a long session (the GPU suite) fills it
    assert [(c.dtype, c.count, c.nbytes, c.op, c.requested, c.backend, c.platform) for c in new] == [
        ("float32", 14, 56, "avg", "cpu", "cpu", "cpu"),
        ("int32", 5, 20, "avg", "cpu", "cpu", "cpu"),
    ]


# -- vmap ---------------------------------------------------------------------------------------------------------


@mpi
def test_vmap_folds_the_batch_into_the_count(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    x = (np.arange(4 * 6, dtype=np.float32).reshape(4, 6) + rank) * 3
    out = jax.jit(jax.vmap(lambda v: mj.allreduce(v, "sum")))(_cpu(x))
    expected = sum((np.arange(24, dtype=np.float64).reshape(4, 6) + r) * 3 for r in range(size))
    assert np.array_equal(np.asarray(out, np.float64), expected)
    y = np.arange(6, dtype=np.float32)
    out2 = jax.vmap(lambda v, w: mj.allreduce(v + w, "sum"), in_axes=(1, None))(_cpu(x), _cpu(y[:4]))
    expected2 = sum(((np.arange(24, dtype=np.float64).reshape(4, 6) + r) * 3).T + y[:4] for r in range(size))
    assert np.array_equal(np.asarray(out2, np.float64), expected2)


@mpi(min_size=2)
def test_vmap_batch_size_mismatch_raises_everywhere(comm) -> None:
    """The check sees the batched count: ranks that vmap over different batch sizes fail while compiling."""
    mj = _mj()
    batch = 3 if comm.Get_rank() == 0 else 4
    f = jax.jit(jax.vmap(lambda v: mj.allreduce(v, "sum")))
    with pytest.raises(MismatchError, match="count: 15 on rank 0"):
        f(_cpu(np.ones((batch, 5), np.float32)))
    _still_works(comm)


# -- average_tree -------------------------------------------------------------------------------------------------


@mpi
def test_average_tree_one_allreduce_per_dtype(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    mj = _mj()
    tree = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1),
        "b": np.full(4, 2.0 * rank, np.float32),
        "layers": [np.float32(rank), np.arange(5, dtype=np.float64) - rank],
        "steps": np.array([2 * size * rank], np.int32),
    }
    lowered = jax.jit(mj.average_tree).lower(tree).as_text()  # lowering is collective: every rank does it
    assert lowered.count("custom_call @mpigpu_allreduce") == 3  # float32, float64, int32
    out = jax.jit(mj.average_tree)(tree)
    ranks = range(size)
    np.testing.assert_array_equal(out["w"], np.arange(12).reshape(3, 4) * sum(r + 1 for r in ranks) / size)
    np.testing.assert_array_equal(out["b"], np.full(4, 2.0 * sum(ranks) / size))
    np.testing.assert_array_equal(out["layers"][0], np.float32(sum(ranks) / size))
    np.testing.assert_array_equal(out["layers"][1], np.arange(5) - sum(ranks) / size)
    assert out["layers"][1].dtype == np.float64 and out["steps"].dtype == np.int32
    np.testing.assert_array_equal(out["steps"], [2 * sum(ranks)])
    assert out["w"].shape == (3, 4)


# -- mismatches ---------------------------------------------------------------------------------------------------


def _still_works(comm) -> None:
    size = comm.Get_size()
    out = jax.jit(lambda v: _mj().allreduce(v, "sum"))(_cpu(np.full(3, comm.Get_rank() + 1, np.int64)))
    assert np.all(np.asarray(out) == size * (size + 1) // 2)


@mpi(min_size=2)
@pytest.mark.parametrize("what", ["count", "dtype", "op"])
def test_mismatch_raises_on_every_rank_while_compiling(comm, what: str) -> None:
    rank = comm.Get_rank()
    mj = _mj()
    count, dtype, op = 10, np.float32, "sum"
    if rank == 1:
        count, dtype, op = {"count": (11, dtype, op), "dtype": (count, np.float64, op), "op": (count, dtype, "max")}[
            what
        ]
    ran = []

    def f(v):
        ran.append(1)  # traced, then lowered: the check runs while lowering, before anything executes
        return mj.allreduce(v, op)

    x = _cpu(np.ones(count, dtype))
    with pytest.raises(MismatchError, match=what):
        jax.jit(f).lower(x)  # lowering alone raises: nothing was compiled or run
    with pytest.raises(MismatchError, match=what):
        jax.jit(f)(x)
    _still_works(comm)


@mpi(min_size=2)
def test_invalid_dtype_on_one_rank_names_it_on_the_others(comm) -> None:
    mj = _mj()
    x = np.ones(4, np.complex64 if comm.Get_rank() == 1 else np.float32)
    f = jax.jit(lambda v: mj.allreduce(v, "sum"))
    if comm.Get_rank() == 1:
        with pytest.raises(InvalidArgument, match="complex64"):
            f(_cpu(x))
    else:
        with pytest.raises(MismatchError, match="rank 1"):
            f(_cpu(x))
    _still_works(comm)


# -- serial: import and structure ---------------------------------------------------------------------------------


def test_import_mpigpu_does_not_import_jax() -> None:
    code = (
        "import sys, mpigpu; assert 'jax' not in sys.modules and 'jaxlib' not in sys.modules, 'jax imported'; "
        "import mpigpu.jax; assert 'jax' in sys.modules; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_lowered_program_threads_one_token_through_every_collective() -> None:
    """The ordering guarantee, read off the lowered program: each custom call takes the token the
    previous one returned, including the ones inside a loop body and the backward pass."""
    code = """
import re, jax, jax.numpy as jnp, numpy as np
import mpigpu.jax as mj
def f(a, b, c):
    y = mj.allreduce(a, "sum") + 1
    z = mj.allreduce(b, "max")  # independent of y: only the token orders it
    w = jax.grad(lambda t: jnp.sum(mj.allreduce(t * 2, "avg")))(c)  # forward and backward calls
    _, s = jax.lax.scan(lambda k, _: (mj.allreduce(k, "sum"), k), a, None, length=3)
    return y, z, w, s
text = jax.jit(f).lower(np.ones(3, np.float32), np.ones(5, np.int32), np.ones(2, np.float32)).as_text()
main = text.split("func.func private")[0]
calls = re.findall(r"(%[0-9]+):2 = stablehlo.custom_call @mpigpu_allreduce\\((%[^,]+),", main)
assert len(calls) == 4, text
assert calls[0][1] == "%arg0", text  # the program's input token
for (previous, _), (_, token_in) in zip(calls, calls[1:]):
    assert token_in == previous + "#0", (previous, token_in, text)
loop = re.search(r"stablehlo.while\\(%iterArg = ([^,]+),", main)
assert loop and loop.group(1) == calls[-1][0] + "#0", text  # the loop starts from the last token
body = re.findall(r"custom_call @mpigpu_allreduce\\((%[^,]+),", text.split("func.func private")[1])
assert body == ["%arg0"], text  # inside the loop body: the token carried by the loop
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr


def test_handler_error_reaches_the_program() -> None:
    """An exception inside the FFI handler becomes an XLA error raised where the program waits for the
    result, with the message; it never unwinds into XLA's C++ frames."""
    code = """
import jax, numpy as np
import mpigpu.jax as mj
from mpigpu.jax import _handler
def boom(*args):
    raise ValueError("boom from the handler")
_handler._run = boom
try:
    np.asarray(jax.jit(lambda v: mj.allreduce(v, "sum"))(np.ones(3, np.float32)))
except Exception as exc:
    assert "boom from the handler" in str(exc), str(exc)
    print("raised", type(exc).__name__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0 and "raised" in result.stdout, result.stdout + result.stderr


def test_handler_is_registered_under_xla_platform_names(monkeypatch) -> None:
    """The GPU handler must be registered as "CUDA": registered as "cuda" (the lowering platform's name)
    XLA never finds it (seen on an H100 with JAX 0.11.2: "No FFI handler registered ... platform CUDA")."""
    from mpigpu.jax import _primitive

    seen = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, fn, platform: seen.append((name, platform)))
    monkeypatch.setattr(_primitive, "_registered", set())
    _primitive._register("cuda")
    _primitive._register("cpu")
    _primitive._register("cuda")  # once per platform
    targets = ["mpigpu_allreduce", "mpigpu_broadcast", "mpigpu_allgather"]
    assert seen == [(t, "CUDA") for t in targets] + [(t, "cpu") for t in targets]


def test_call_attribute_round_trips() -> None:
    """The lowering packs collective, op, root, backend, placement and communicator into one integer
    attribute (one read per call in the handler instead of six); every combination decodes to what was packed."""
    import itertools

    from mpigpu.backends import BACKEND_NAMES
    from mpigpu.jax._handler import COLLECTIVES, _decode, encode

    for op, backend, gpu, comm, collective, root in itertools.product(
        Op, BACKEND_NAMES, (False, True), (0, 1, 7, 1000, 2**20), COLLECTIVES, (0, 1, 4095, 2**24 - 1)
    ):
        assert _decode(encode(op, backend, gpu, comm, collective, root)) == (op, backend, gpu, comm, collective, root)
