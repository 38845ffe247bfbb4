"""Files that only this user can have written: the kernel cache and the tuning table.

What mpigpu loads from disk decides what runs on the GPU (a cubin) or which path every call takes (a
tuning table), so a file is used only if it is a regular file owned by this user and not writable
by group or others, and a cache directory only if the same holds for it (mpigpu creates its own
0700). Files are opened relative to a descriptor of their directory with ``O_NOFOLLOW``, so a
symbolic link planted where a file should be is refused, never followed. Writes go to a fresh
``O_EXCL`` temporary name, are fsynced and renamed into place: a reader sees the old file or the
new one, never half of one, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path
from types import TracebackType

__all__ = ["FileLock", "PrivateDir", "UntrustedPath", "read_file", "write_file"]

_NOT_OURS = 0o022  # group- or world-writable


class UntrustedPath(Exception):
    """A file or directory that another user could have written (or a symbolic link): not used."""


def _check(st: os.stat_result, path: Path, kind: str) -> None:
    """Raise UntrustedPath unless ``st`` is a ``kind`` ("directory" or "file") of ours that only we can write."""
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not is_kind(st.st_mode):
        raise UntrustedPath(f"{path} is not a {'regular file' if kind == 'file' else kind}")
    if st.st_uid != os.geteuid():
        raise UntrustedPath(f"{path} is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & _NOT_OURS:
        raise UntrustedPath(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _open_checked(name: str, flags: int, path: Path, kind: str, dir_fd: int | None, mode: int = 0o600) -> int:
    """``os.open`` without following a final symbolic link, then ``_check`` on the open descriptor."""
    try:
        # O_NONBLOCK: a FIFO planted at the name must not block the open (it is then refused below)
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # what O_NOFOLLOW gives for a link
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    raise UntrustedPath(f"{path} is a symbolic link") from None
        raise
    try:
        _check(os.fstat(fd), path, kind)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at(dir_fd: int, name: str, path: Path) -> bytes | None:
    """The content of ``name`` in ``dir_fd`` (None if there is none), if the file is trusted."""
    try:
        fd = _open_checked(name, os.O_RDONLY, path, "file", dir_fd)
    except FileNotFoundError:
        return None
    with open(fd, "rb") as file:
        return file.read()


def _temp_name(name: str) -> str:
    """A fresh, unguessable name beside ``name`` for an atomic write."""
    return f".{name}.tmp{os.getpid()}.{secrets.token_hex(8)}"


def _write_at(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data`` atomically; no temporary file is left on failure."""
    temp = _temp_name(name)
    # O_EXCL: fails on any existing entry, a symbolic link included, instead of writing through it
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    renamed = False
    try:
        with open(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a link, never follows it
        renamed = True
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)


class FileLock:
    """An exclusive ``flock`` on a lock file, held until ``release`` (or the end of a ``with``)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the lock
            self._fd = None

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class PrivateDir:
    """A directory of ours that only we can write, held open; every file access goes through it."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def open(cls, path: Path) -> PrivateDir:
        """Open ``path``, creating it 0700 (and missing parents) if needed.

        Raises UntrustedPath if it is a symbolic link, not ours, or writable by group or others, and
        OSError if it cannot be created or opened (a read-only home, say)."""
        path = Path(os.path.abspath(path))
        if path == path.parent:
            raise UntrustedPath(f"{path} is the root directory")
        os.makedirs(path.parent, exist_ok=True)
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return cls._at(parent, path.name, path)
        finally:
            os.close(parent)

    @classmethod
    def _at(cls, dir_fd: int, name: str, path: Path) -> PrivateDir:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        return cls(_open_checked(name, os.O_RDONLY | os.O_DIRECTORY, path, "directory", dir_fd), path)

    def _dir_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: the directory was closed")
        return self._fd

    def subdir(self, name: str) -> PrivateDir:
        """The private directory ``name`` inside this one (created 0700 if needed)."""
        return PrivateDir._at(self._dir_fd(), name, self.path / name)

    def read(self, name: str) -> bytes | None:
        """The content of file ``name``, or None if there is none; UntrustedPath if it is not trusted."""
        return _read_at(self._dir_fd(), name, self.path / name)

    def write(self, name: str, data: bytes, mode: int = 0o600) -> None:
        """Replace file ``name`` with ``data`` atomically."""
        _write_at(self._dir_fd(), name, data, mode)

    def lock(self, name: str) -> FileLock:
        """Wait for, then hold, an exclusive lock on the lock file ``name`` in this directory."""
        fd = _open_checked(name, os.O_RDWR | os.O_CREAT, self.path / name, "file", self._dir_fd())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return FileLock(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def read_file(path: Path) -> bytes | None:
    """The content of ``path`` (None if it does not exist), if it is a regular file of ours that only
    we can write; UntrustedPath otherwise. Its directory may be shared: the file's owner is what counts."""
    path = Path(os.path.abspath(path))
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return _read_at(parent, path.name, path)
    finally:
        os.close(parent)


def write_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically, without following a symbolic link at ``path`` or at
    the temporary name; missing parent directories are created 0700."""
    path = Path(os.path.abspath(path))
    os.makedirs(path.parent, mode=0o700, exist_ok=True)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_at(parent, path.name, data, mode)
    finally:
        os.close(parent)
