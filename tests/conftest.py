"""Shared test fixtures.

Layout: tests without an ``mpi`` marker run serially (``python -m pytest``); tests marked
``@pytest.mark.mpi`` run under ``mpiexec -n N python -m pytest --with-mpi --only-mpi`` (scripts/test.sh
runs the serial tests, then N = 1, 2, 3 and 4, then across MPI nodes: 2x2, 1+1+1 and 2+1, see ``mpi_nodes``).
Tests marked ``gpu`` are skipped, with the reason, where no GPU is visible; MPIGPU_REQUIRE_GPU=1 (set by
scripts/gpu-check.sh) turns that skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _under_mpi() -> bool:
    return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def pytest_configure(config: pytest.Config) -> None:
    # stall reports and a timeout's abort reach the terminal despite capture (mpigpu's pytest plugin does
    # this where mpigpu is installed; the GPU machine runs the checkout from PYTHONPATH)
    from mpigpu.core.console import follow_pytest_capture

    follow_pytest_capture(config)
    # Under mpiexec every rank runs pytest; only rank 0 writes to the terminal, the others to a
    # log file that scripts/test.sh prints if their run fails.
    if _under_mpi():
        from mpigpu.cli import launcher_rank

        rank = launcher_rank()
        if rank > 0:
            log = ROOT / f".pytest-rank{rank}.log"
            sys.stdout = open(log, "w", buffering=1)  # noqa: SIM115 - lives for the session


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --with-mpi run only the MPI-marked tests (pytest-mpi 0.6's --only-mpi does not drop
    the others when combined with --with-mpi); the serial run covers the rest."""
    if not config.getoption("with_mpi", default=False):
        return
    serial = [item for item in items if item.get_closest_marker("mpi") is None]
    if serial:
        config.hook.pytest_deselected(items=serial)
        items[:] = [item for item in items if item.get_closest_marker("mpi") is not None]


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 without a GPU or without cuda.core)."""
    from mpigpu.core._cuda import visible_device_count

    return visible_device_count()


def gpu_available() -> bool:
    return gpu_count() > 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None or gpu_available():
        return
    if os.environ.get("MPIGPU_REQUIRE_GPU") == "1":
        pytest.fail("MPIGPU_REQUIRE_GPU=1, but no CUDA GPU is visible to this process")
    pytest.skip("needs a CUDA GPU (none visible here); scripts/gpu-check.sh runs these on a GPU machine")


@pytest.fixture(scope="session")
def comm():
    from mpigpu.core._mpi import world

    return world()


@pytest.fixture(scope="module")
def ctx(comm):
    """This rank bound to its GPU, and mpigpu's Context of the world communicator (the GPU tests' start)."""
    import mpigpu
    from mpigpu.runtime.context import Context

    mpigpu.select_device(comm)
    return Context.get(comm)


@contextlib.contextmanager
def fresh_context(comm: Any) -> Iterator[Any]:
    """mpigpu's Context of a fresh duplicate of ``comm`` (collective), freed afterwards."""
    from mpigpu.runtime.context import Context

    dup = comm.Dup()
    try:
        yield Context.get(dup)
    finally:
        dup.Free()


def check_outcome(comm: Any, sig: Any) -> str | None:
    """None if the cross-rank argument check of ``sig`` on ``comm`` passed, else its MismatchError's message."""
    from mpigpu.core.errors import MismatchError
    from mpigpu.job.check import check_signature

    try:
        check_signature(comm, sig)
    except MismatchError as exc:
        return str(exc)
    return None


def random_checks(board_comm: Any, plain: Any, rng: Any, checks: int) -> list[str | None]:
    """``checks`` random signature checks on ``board_comm`` (which has a board) beside the same on ``plain``
    (none: MPI_Allreduce), a rank differing in count, dtype, op, shape or a refusal in half of them (``rng``:
    the same draws on every rank). Each verdict and message must be the MPI path's, name the differing
    rank, and be the same on every rank. Returns the verdicts (collective)."""
    from mpigpu.job.check import Signature

    rank, n = plain.Get_rank(), plain.Get_size()
    seen: list[str | None] = []
    for i in range(checks):
        count, dtype, op = (int(v) for v in rng.integers(0, 50, size=3))
        shape = (count, int(rng.integers(1, 4)))
        odd = int(rng.integers(0, 2 * n))  # a rank that differs, in half the checks
        field = int(rng.integers(0, 5))
        if rank == odd:
            if field == 0:
                count += 1
            elif field == 1:
                dtype += 1
            elif field == 2:
                op += 1
            elif field == 3:
                shape = (shape[1], shape[0])  # same count, another shape
        error = "ValueError: refused" if rank == odd and field == 4 else None
        sig = Signature(count, dtype, op, 1, 0, error=error, shape=shape)
        verdict = check_outcome(board_comm, sig)
        assert verdict == check_outcome(plain, sig), f"check {i}: the board and MPI differ"
        differs = field == 4 or (n > 1 and not (field == 3 and shape[0] == shape[1]))
        if odd < n and differs:
            assert verdict is not None, f"check {i}: rank {odd} differs in field {field}, not caught"
            assert f"rank {odd}" in verdict
        else:
            assert verdict is None, f"check {i}: every rank agrees, but the check failed: {verdict}"
        seen.append(verdict)
    assert plain.allgather(seen) == [seen] * n, "the same verdict and message on every rank"
    return seen


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """The variables ``values`` set inside the block; each restored (or removed) after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def context_with(comm: Any, env: dict[str, str]) -> Iterator[Any]:
    """mpigpu's Context of a fresh duplicate of ``comm``, created while the variables ``env`` are set
    (collective; settings are read at start-up), closed and freed afterwards."""
    from mpigpu.runtime.context import Context

    dup = comm.Dup()
    try:
        with environment(env):
            ctx = Context.get(dup)
        yield ctx
    finally:
        with contextlib.suppress(NameError):
            ctx.close()
        dup.Free()


def mpi_nodes(comm: Any) -> list[list[int]]:
    """The ranks of ``comm`` on each MPI node (MPI_COMM_TYPE_SHARED: under MPICH's fork launcher
    with named hosts, each host is a node), nodes ordered by their lowest rank, ranks in rank order
    (collective). One entry under a plain ``mpiexec -n N``; what a test expects across nodes follows it."""
    from mpigpu.core._mpi import MPI

    node = comm.Split_type(MPI().COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        mine = node.allgather(comm.Get_rank())
    finally:
        node.Free()
    return [list(ranks) for ranks in sorted({tuple(ranks) for ranks in comm.allgather(mine)}, key=min)]


def missing_compiler(language: str) -> str | None:
    """Why mpigpu's compiled helpers cannot be built here for ``language`` ("c" or "c++"), or None: the
    reason a test that needs one skips with."""
    from mpigpu.core.native import BuildFailed, compiler

    try:
        compiler(language)
    except BuildFailed as exc:
        return str(exc)
    return None


def load_script(path: Path | str, name: str | None = None) -> Any:
    """A script or sample (not a package module) imported as a module, to call its functions."""
    import importlib.util

    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mpiexec() -> str:
    """The launcher that belongs to the MPI mpi4py loads (the venv's mpich wheel first)."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        pytest.fail("no mpiexec found: install MPICH (pip install mpich: the mpi extra) or a system MPI")
    return found


def nodes_launcher(hosts: str) -> list[str]:
    """mpiexec with ranks on the MPI nodes ``hosts`` names (``"nodeA:2,nodeB:1"``), all on this machine:
    MPICH's launcher starts one proxy per host by fork, and MPI_COMM_TYPE_SHARED splits by those hosts.
    Skips where the launcher is not MPICH's (Open MPI's mpirun has no fork launcher for named hosts)."""
    launcher = mpiexec()
    try:
        version = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"{launcher} --version failed: {exc}")
    if "HYDRA" not in version:
        pytest.skip(f"{launcher} is not MPICH's Hydra: MPI nodes on one machine need its fork launcher (-hosts)")
    return [launcher, "-launcher", "fork", "-hosts", hosts]


# What identifies a rank of the job a test runs in, per launcher (MPICH's Hydra, PMIx, Open MPI). A site's
# own settings (the GPU image's OMPI_MCA_*, OMPI_ALLOW_RUN_AS_ROOT) are not among them: an inner mpirun needs them.
_RANK_VARS = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE")
# Open MPI's contact with the outer job's daemon: a process started alone (a singleton) that inherits them
# registers with that daemon as a rank of the outer job.
_DAEMON_VARS = ("OMPI_MCA_orte_", "OMPI_MCA_ess_", "OMPI_MCA_pmix", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS",
                "OMPI_NUM_APP_CTX")  # fmt: skip


def outside_job_env(singleton: bool = False) -> dict[str, str]:
    """This process's environment without what makes a child a rank of the job this test runs in, however
    it was launched: the child launches a job of its own (mpiexec), or with ``singleton``, runs alone as a
    job of one process."""
    drop = _RANK_VARS + (_DAEMON_VARS if singleton else ())
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def run_mpi(
    n: int,
    args: list[str],
    *,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    hosts: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n n python <args>`` as a subprocess; fails the test on timeout (a hang). ``hosts``
    (``"nodeA:2,nodeB:2"``) spreads the ranks over those MPI nodes (nodes_launcher)."""
    full_env = outside_job_env()  # a clean launch: no inherited rank variables from an outer mpiexec
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    command = [*(nodes_launcher(hosts) if hosts else [mpiexec()]), "-n", str(n), sys.executable, *args]
    try:
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd or ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s (hang?)\n{exc.stdout}\n{exc.stderr}")


# -- MPICH's files in /dev/shm ---------------------------------------------------------------------
# MPICH keeps one file per job and node (/dev/shm/mpich_shm_<job>_<node>) and removes it in
# MPI_Finalize; mpigpu removes it before MPI_Abort. A job the tests kill (SIGKILL, a launch timeout)
# leaves it: each test's own leftovers are removed after it.
SHM = Path("/dev/shm")


def mpich_segments() -> dict[Path, float]:
    """MPICH's files in /dev/shm that belong to this user, with their change (creation) times."""
    found: dict[Path, float] = {}
    with contextlib.suppress(OSError):
        for path in SHM.glob("mpich*"):
            with contextlib.suppress(OSError):
                info = path.lstat()
                if info.st_uid == os.geteuid() and stat.S_ISREG(info.st_mode):
                    found[path] = info.st_ctime
    return found


def in_use(paths: set[Path]) -> set[Path]:
    """Those of ``paths`` that a live process maps or holds open (a running job's)."""
    names = {str(path) for path in paths}
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            used |= names & {line.split(maxsplit=5)[-1] for line in (proc / "maps").read_text().splitlines()}
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    used |= names & {os.readlink(fd)}
    return {Path(name) for name in used}


def remove_leftovers(before: set[Path], since: float, grace: float = 5.0) -> list[Path]:
    """Remove the MPICH files made since ``since`` (absent from ``before``) that no live process
    uses: what jobs started since then left. A running job's file (another user's test run
    included) is mapped by its ranks, so it stays. A killed job's ranks may still be exiting, with
    the file mapped, when the test ends: a file in use is looked at again for up to ``grace`` seconds."""
    new = {path for path, made in mpich_segments().items() if path not in before and made >= since - 1}
    deadline = time.monotonic() + grace
    used = in_use(new) if new else set()
    while used and time.monotonic() < deadline:
        time.sleep(0.1)
        used = in_use(used)
    removed = []
    for path in sorted(new - used):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    return removed


@pytest.fixture(autouse=True)
def _no_mpich_leftovers() -> Iterator[None]:
    """After each test, what the jobs it started left in /dev/shm (see remove_leftovers)."""
    before, since = set(mpich_segments()), time.time()
    yield
    remove_leftovers(before, since)


# -- JAX on the CPU (tests/jax) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def jax_x64() -> Iterator[None]:
    """float64 and int64 arrays stay 64-bit in the module that uses it (JAX's default truncates them)."""
    jax = pytest.importorskip("jax", reason="jax is not installed (the CI test script installs it)")
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.fixture
def jax_cpu_programs_tokened(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's programs run on JAX's CPU, also on GPU machines, where JAX's default device is a GPU and a
    call traced inside jit is therefore untokened (MPIGPU_JAX_ORDER=auto) and refused when compiled for the
    CPU: there a user sets MPIGPU_JAX_ORDER=tokens, as this does."""
    from mpigpu.jax import _primitive

    monkeypatch.setattr(_primitive, "_order_setting", lambda: "tokens")


# -- the check board's two paths (mpigpu.job.native_board) ----------------------------------------
@pytest.fixture(params=["compiled", "python"])
def board_handler(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The test runs on the boards' compiled exchange, then on their Python path: boards made during it by
    MPIGPU_BOARD_HANDLER, and the world context's board (made once per process) switched for its length,
    its call records forgotten before and after (a record's launch is bound to one path). Collective: every
    rank runs it at the same place."""
    from mpigpu.core._mpi import world
    from mpigpu.job import native_board
    from mpigpu.runtime.context import Context

    handler = request.param
    if handler == "compiled" and native_board.why_not() is not None:
        pytest.skip(f"the compiled board is not here: {native_board.why_not()}")
    ctx = Context.get(world())  # made (if not yet) before the setting changes: its board as a user's would be
    monkeypatch.setenv("MPIGPU_BOARD_HANDLER", "python" if handler == "python" else "auto")
    board = ctx.check_board
    saved = None if board is None else board.native
    if board is not None and handler == "python":
        board.native = None
    assert board is None or handler == "python" or board.native is not None, "the world's board runs Python"
    ctx.plan_cache.clear()
    try:
        yield handler
    finally:
        if board is not None:
            board.native = saved
        ctx.plan_cache.clear()
