"""The kernel cache with NVRTC and the driver (tests/core/test_cache_security.py covers its decisions on
a CPU with a fake compiler): a real cubin is stored with its hash in a 0700 directory, loaded
from there by the next process, and a damaged entry is recompiled into a working module."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _fresh_load(monkeypatch: pytest.MonkeyPatch, arch: str) -> object:
    from mpigpu.kernels import compile as kc

    monkeypatch.setattr(kc, "_modules", {})  # as a new process would
    return kc.load_module("arith.cu", arch)


def test_a_real_cubin_is_cached_verified_and_reloaded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mpigpu.core._cuda import set_device
    from mpigpu.kernels import compile as kc

    device = set_device(0)
    cc = device.compute_capability
    arch = f"{cc.major}{cc.minor}"
    monkeypatch.setenv("MPIGPU_CACHE_DIR", str(tmp_path / "cache"))

    first = _fresh_load(monkeypatch, arch)
    assert not first.stats.cached
    entry = Path(first.stats.path)
    assert entry.parent.stat().st_mode & 0o777 == 0o700 and (tmp_path / "cache").stat().st_mode & 0o777 == 0o700
    stored = entry.read_bytes()
    from mpigpu.core import build_cache

    assert build_cache.unpack(kc.MAGIC, stored) is not None
    assert [p.name for p in entry.parent.iterdir() if ".tmp" in p.name] == []

    second = _fresh_load(monkeypatch, arch)
    assert second.stats.cached
    second.kernel("finish_avg_float32")  # the loaded cubin is usable

    entry.write_bytes(stored[: len(stored) // 2])  # truncated: recompiled, replaced, usable
    third = _fresh_load(monkeypatch, arch)
    assert not third.stats.cached and entry.read_bytes() == stored
    third.kernel("finish_avg_float32")
