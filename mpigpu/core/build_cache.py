"""Built artifacts cached on disk, trusted only if this user wrote them and they are intact.

Used for the CUDA kernels' cubins (mpigpu.kernels.compile) and mpigpu.jax's compiled FFI handler
(mpigpu.jax._native): what is loaded from here runs in the process, so an entry is used only if
privatefs trusts its directory and file (ours, a real file, not writable by others), and only if
the sha256 stored in its header matches its bytes; a corrupt or truncated one is rebuilt and
replaced. A file lock makes one rank of a node build while the others wait and then read its entry.
Where the cache cannot be used (another user's directory, a read-only home) the artifact is built in
memory, after one line on stderr saying why.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from pathlib import Path

from mpigpu.core.privatefs import PrivateDir, UntrustedPath

__all__ = ["cached_build", "pack", "unpack", "warn_once"]

_HASH_BYTES = 32
_warned: set[str] = set()


def warn_once(message: str) -> None:
    """One line on stderr, once per process for each distinct message."""
    if message not in _warned:
        _warned.add(message)
        sys.stderr.write(f"mpigpu: {message}\n")
        sys.stderr.flush()


def pack(magic: bytes, data: bytes) -> bytes:
    """A cache entry: ``magic``, the sha256 of ``data``, then ``data``."""
    return magic + hashlib.sha256(data).digest() + data


def unpack(magic: bytes, entry: bytes) -> bytes | None:
    """The data stored in a cache entry, or None if the entry is truncated, corrupt or of another format."""
    head = len(magic) + _HASH_BYTES
    if len(entry) <= head or not entry.startswith(magic):
        return None
    data = entry[head:]
    return data if hashlib.sha256(data).digest() == entry[len(magic) : head] else None


def cached_build(root: Path, subdir: str, name: str, magic: bytes, build: Callable[[], bytes],
                 what: str = "kernel cache") -> tuple[bytes, bool]:  # fmt: skip
    """(data, True) from the entry ``root/subdir/name`` if it is trusted and intact, else (``build()``,
    False), stored for next time where the cache can be used. ``what`` names the cache in messages."""
    where = root / subdir
    fix = "remove it or set MPIGPU_CACHE_DIR to a directory of your own; building in memory"
    try:
        with PrivateDir.open(root) as top:
            cache = top.subdir(subdir)
    except UntrustedPath as exc:
        warn_once(f"not using the {what}: {exc}: {fix}")
        return build(), False
    except OSError as exc:
        warn_once(f"not using the {what} {where} ({exc.strerror or exc}); building in memory")
        return build(), False
    with cache:
        try:
            held = cache.lock(f".{name}.lock")
        except (UntrustedPath, OSError) as exc:
            warn_once(f"not using the {what} {where}: cannot lock it ({exc}): {fix}")
            return build(), False
        with held:
            return _read_or_build(cache, name, magic, build, fix, what)


def _read_or_build(cache: PrivateDir, name: str, magic: bytes, build: Callable[[], bytes], fix: str,
                   what: str) -> tuple[bytes, bool]:  # fmt: skip
    """Under the lock: the entry's data if intact, else new data, stored atomically."""
    try:
        entry = cache.read(name)
    except UntrustedPath as exc:
        warn_once(f"not using the {what} entry: {exc}: {fix}")
        return build(), False
    except OSError as exc:
        warn_once(f"cannot read the {what} entry {cache.path / name} ({exc}); building in memory")
        return build(), False
    if entry is not None:
        data = unpack(magic, entry)
        if data is not None:
            return data, True
        warn_once(f"the {what} entry {cache.path / name} is corrupt or truncated: rebuilding it")
    data = build()
    try:
        cache.write(name, pack(magic, data))
    except OSError as exc:
        warn_once(f"cannot store {cache.path / name} in the {what} ({exc}); it is built again next run")
    return data, False
