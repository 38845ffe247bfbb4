"""The kernel cache loads only what this user compiled (issue 12, section 1).

NVRTC and the driver are replaced by a fake cuda.core whose ObjectCode keeps the bytes it is given
and a compile function that counts its calls, so every decision of the cache (use, refuse,
recompile, replace) runs here on a CPU. A planted entry is always well formed (the format the cache
writes, hash included), so that only trust, never format, can keep it out: the control test shows
that the same bytes are loaded from a directory of ours.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mpigpu.core import build_cache
from mpigpu.kernels import compile as kc

GENUINE = b"\x7fELF genuine cubin compiled by this user " + bytes(range(256))
PLANTED = b"\x7fELF planted cubin of another user " + bytes(range(255, -1, -1))
OTHER_UID = 54321

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid (os.chown)")


class _ObjectCode:
    def __init__(self, cubin: bytes) -> None:
        self.cubin = cubin

    @classmethod
    def from_cubin(cls, cubin: bytes, name: str) -> _ObjectCode:
        return cls(bytes(cubin))


@dataclass
class Kernels:
    """load() runs load_module as a new process would (nothing remembered in memory)."""

    monkeypatch: pytest.MonkeyPatch
    root: Path
    compiles: list[str] = field(default_factory=list)

    def use(self, root: Path) -> None:
        self.root = root
        self.monkeypatch.setenv("MPIGPU_CACHE_DIR", str(root))

    def load(self) -> tuple[bytes, Any]:
        self.monkeypatch.setattr(kc, "_modules", {})
        module = kc.load_module("arith.cu", "90")
        return module.object_code.cubin, module.stats

    @property
    def kernels(self) -> Path:
        return self.root / "kernels"


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Kernels]:
    state = Kernels(monkeypatch, tmp_path / "cache")
    state.use(tmp_path / "cache")
    core = SimpleNamespace(__version__="0-test", ObjectCode=_ObjectCode)
    monkeypatch.setattr(kc, "require_cuda_core", lambda *args: core)

    def fake_compile(core: Any, text: str, source: str, options: dict[str, Any]) -> bytes:
        state.compiles.append(source)
        return GENUINE

    monkeypatch.setattr(kc, "_compile", fake_compile)
    monkeypatch.setattr(build_cache, "_warned", set())
    yield state
    for path in tmp_path.rglob("*"):  # give everything back, so pytest can remove it
        if not path.is_symlink():
            os.chmod(path, 0o700)
            if os.geteuid() == 0:
                os.chown(path, 0, 0)


def _entry_bytes(cubin: bytes) -> bytes:
    """A cache entry as the cache itself writes it (what an attacker would plant)."""
    return build_cache.pack(kc.MAGIC, cubin)


def _entry_name(kernels: Kernels, tmp_path: Path) -> str:
    """The entry's file name (it depends on the inputs only), learned from a run in another directory."""
    real = kernels.root
    kernels.use(tmp_path / "learn")
    _, stats = kernels.load()
    kernels.use(real)
    kernels.compiles.clear()
    return Path(stats.path).name


def _warnings(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpigpu:")]


# -- the normal path ---------------------------------------------------------------------------------
def test_an_entry_is_compiled_once_then_loaded(kernels: Kernels, capsys: pytest.CaptureFixture[str]) -> None:
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, False, 1)
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, True, 1)
    assert _warnings(capsys) == []


def test_the_cache_directories_are_created_0700(kernels: Kernels) -> None:
    kernels.load()
    assert oct(kernels.root.stat().st_mode & 0o777) == oct(0o700)
    assert oct(kernels.kernels.stat().st_mode & 0o777) == oct(0o700)


def test_control_a_planted_entry_in_a_directory_of_ours_is_loaded(kernels: Kernels, tmp_path: Path) -> None:
    """The planted bytes below are well formed: only trust keeps them out."""
    name = _entry_name(kernels, tmp_path)
    kernels.kernels.mkdir(parents=True, mode=0o700)
    (kernels.kernels / name).write_bytes(_entry_bytes(PLANTED))
    os.chmod(kernels.kernels / name, 0o600)
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, kernels.compiles) == (PLANTED, True, [])


# -- directories another user could write ------------------------------------------------------------
def _foreign_kernels_dir(kernels: Kernels, tmp_path: Path) -> None:
    os.chown(kernels.kernels, OTHER_UID, OTHER_UID)


def _foreign_root_dir(kernels: Kernels, tmp_path: Path) -> None:
    os.chown(kernels.kernels, OTHER_UID, OTHER_UID)
    os.chown(kernels.root, OTHER_UID, OTHER_UID)


def _world_writable_dir(kernels: Kernels, tmp_path: Path) -> None:
    os.chmod(kernels.kernels, 0o777)


def _group_writable_root(kernels: Kernels, tmp_path: Path) -> None:
    os.chmod(kernels.root, 0o770)


def _symlinked_dir(kernels: Kernels, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    kernels.kernels.rename(elsewhere)
    kernels.kernels.symlink_to(elsewhere)


@pytest.mark.parametrize(
    "make_untrusted",
    [
        pytest.param(_foreign_kernels_dir, marks=needs_root, id="kernels-dir-of-another-uid"),
        pytest.param(_foreign_root_dir, marks=needs_root, id="cache-dir-of-another-uid"),
        pytest.param(_world_writable_dir, id="world-writable-kernels-dir"),
        pytest.param(_group_writable_root, id="group-writable-cache-dir"),
        pytest.param(_symlinked_dir, id="kernels-dir-is-a-symlink"),
    ],
)
def test_a_planted_entry_in_an_untrusted_directory_is_not_loaded(
    kernels: Kernels, tmp_path: Path, capsys: pytest.CaptureFixture[str], make_untrusted: Any
) -> None:
    name = _entry_name(kernels, tmp_path)
    capsys.readouterr()
    kernels.kernels.mkdir(parents=True, mode=0o700)
    os.chmod(kernels.root, 0o700)
    planted = kernels.kernels / name
    planted.write_bytes(_entry_bytes(PLANTED))
    before = planted.read_bytes()
    make_untrusted(kernels, tmp_path)
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, False, 1)
    assert planted.read_bytes() == before  # left alone: not ours to replace
    warnings = _warnings(capsys)
    assert len(warnings) == 1, warnings
    assert "not using the kernel cache" in warnings[0] and "building in memory" in warnings[0]
    assert "MPIGPU_CACHE_DIR" in warnings[0]


# -- entries another user could have written ---------------------------------------------------------
def _foreign_entry(entry: Path, tmp_path: Path) -> None:
    os.chown(entry, OTHER_UID, OTHER_UID)


def _world_writable_entry(entry: Path, tmp_path: Path) -> None:
    os.chmod(entry, 0o666)


def _symlinked_entry(entry: Path, tmp_path: Path) -> None:
    target = tmp_path / "planted.cubin"  # even a file of ours: a link in the cache is never followed
    entry.rename(target)
    entry.symlink_to(target)


@pytest.mark.parametrize(
    "make_untrusted",
    [
        pytest.param(_foreign_entry, marks=needs_root, id="entry-of-another-uid"),
        pytest.param(_world_writable_entry, id="world-writable-entry"),
        pytest.param(_symlinked_entry, id="entry-is-a-symlink"),
    ],
)
def test_an_untrusted_entry_in_a_private_directory_is_not_loaded(
    kernels: Kernels, tmp_path: Path, capsys: pytest.CaptureFixture[str], make_untrusted: Any
) -> None:
    name = _entry_name(kernels, tmp_path)
    capsys.readouterr()
    kernels.kernels.mkdir(parents=True, mode=0o700)
    os.chmod(kernels.root, 0o700)
    entry = kernels.kernels / name
    entry.write_bytes(_entry_bytes(PLANTED))
    os.chmod(entry, 0o600)
    make_untrusted(entry, tmp_path)
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, False, 1)
    assert entry.read_bytes() == _entry_bytes(PLANTED)  # through the link, if it is one: untouched
    warnings = _warnings(capsys)
    assert len(warnings) == 1 and str(entry) in warnings[0], warnings


# -- writing -----------------------------------------------------------------------------------------
def test_a_symlink_at_the_temporary_name_is_not_followed(
    kernels: Kernels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = _entry_name(kernels, tmp_path)
    kernels.kernels.mkdir(parents=True, mode=0o700)
    os.chmod(kernels.root, 0o700)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"a file of the victim's")
    entry = kernels.kernels / name
    # the temporary names an attacker would plant: the old predictable one, and the new one made predictable
    entry.with_suffix(f".tmp{os.getpid()}").symlink_to(victim)
    (kernels.kernels / "planted-temp").symlink_to(victim)
    monkeypatch.setattr("mpigpu.core.privatefs._temp_name", lambda name: "planted-temp", raising=False)
    cubin, _ = kernels.load()
    assert cubin == GENUINE
    assert victim.read_bytes() == b"a file of the victim's"
    assert not entry.is_symlink()


@pytest.mark.parametrize("damage", ["truncate", "flip-a-byte", "empty"])
def test_a_corrupt_entry_is_recompiled_and_replaced(
    kernels: Kernels, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    _, stats = kernels.load()
    entry = Path(stats.path)
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) - 100])
    elif damage == "flip-a-byte":
        entry.write_bytes(data[:-10] + bytes([data[-10] ^ 0x40]) + data[-9:])
    else:
        entry.write_bytes(b"")
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, False, 2)
    assert entry.read_bytes() == data  # replaced by an intact entry ...
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, True, 2)  # ... that the next run uses


def test_a_failed_write_compiles_once_and_leaves_no_temporary_file(
    kernels: Kernels, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    monkeypatch.setattr(os, "rename", no_space)
    cubin, stats = kernels.load()
    assert (cubin, stats.cached, len(kernels.compiles)) == (GENUINE, False, 1)
    assert [p.name for p in kernels.kernels.iterdir() if ".tmp" in p.name] == []
    warnings = _warnings(capsys)
    assert len(warnings) == 1 and "No space left" in warnings[0], warnings


def test_a_lock_held_by_another_user_does_not_stall_the_load(kernels: Kernels, tmp_path: Path) -> None:
    """Another user creates the directory first and holds the entry's lock: the load must not wait."""
    name = _entry_name(kernels, tmp_path)
    kernels.kernels.mkdir(parents=True, mode=0o777)
    os.chmod(kernels.kernels, 0o777)
    lock_path = kernels.kernels / f".{name}.lock"
    held = open(lock_path, "a+")  # noqa: SIM115 - released in finally
    fcntl.flock(held, fcntl.LOCK_EX)
    if os.geteuid() == 0:
        os.chown(kernels.kernels, OTHER_UID, OTHER_UID)
        os.chown(lock_path, OTHER_UID, OTHER_UID)
    result: list[bytes] = []
    loader = threading.Thread(target=lambda: result.append(kernels.load()[0]), daemon=True)
    try:
        loader.start()
        loader.join(timeout=10)
        stalled = loader.is_alive()
    finally:
        held.close()
        loader.join(timeout=10)
    assert not stalled, "the load waited for a lock another user holds"
    assert result == [GENUINE]
