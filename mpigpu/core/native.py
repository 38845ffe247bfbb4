"""Host code compiled at run time: the compiler, the build, the load, and the library functions it calls.

mpigpu compiles two small host libraries on first use: mpigpu.jax's FFI handler (C++) and the check
board's exchange (C, mpigpu.job.native_board). Both are built into the private kernel cache
(mpigpu.core.build_cache: ours, intact, or rebuilt) and loaded from the verified bytes through an
anonymous memory file, so the library that runs is the one whose hash was checked, never a file
someone could swap after the check. They call MPI or NCCL through the functions this process already
loaded (``library_functions``), so they link against nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from mpigpu.core.build_cache import cached_build
from mpigpu.core.config import settings

__all__ = [
    "BuildFailed", "build_library", "compiler", "compiler_identity", "library_functions", "load_from_memory",
    "loaded_libraries", "run",
]  # fmt: skip

# the compilers tried per language, after the variable that names one
_COMPILERS = {"c": ("CC", ("cc", "gcc", "clang")), "c++": ("CXX", ("c++", "g++", "clang++"))}


class BuildFailed(Exception):
    """A compiled helper cannot be built here (no compiler, or its output is the message)."""


def compiler(language: str) -> list[str]:
    """The command of the ``language`` ("c" or "c++") compiler: the one ``CC``/``CXX`` names, else the
    first found on PATH; BuildFailed where there is none."""
    variable, names = _COMPILERS[language]
    named = os.environ.get(variable, "").split()
    if named:
        if shutil.which(named[0]) is None:
            raise BuildFailed(f"{variable}={named[0]!r} is not a command here")
        return named
    for name in names:
        found = shutil.which(name)
        if found:
            return [found]
    raise BuildFailed(f"no {language.upper()} compiler found: install one ({names[1]}) or set {variable}")


def compiler_identity(command: list[str]) -> str:
    """What names this compiler in a cache entry's name: its resolved path, size and modification time (a
    new compiler is a new entry). Read from the file, not by running it: a rank that finds its entry in the
    cache starts no process (some MPI stacks warn at, or are harmed by, a fork in an MPI process)."""
    path = shutil.which(command[0]) or command[0]
    real = os.path.realpath(path)
    info = os.stat(real)
    return f"{real} {info.st_size} {info.st_mtime_ns} {' '.join(command[1:])}"


def run(command: list[str]) -> str:
    """``command``'s standard output; BuildFailed with its error output where it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildFailed(f"{command[0]}: {exc}") from None
    if done.returncode != 0:
        raise BuildFailed(f"{' '.join(command[:2])}... exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


def build_library(language: str, package: str, source_name: str, flags: Sequence[str], *, stem: str, subdir: str,
                  magic: bytes, what: str, versions: Sequence[str] = (),
                  extra: Sequence[str] = ()) -> tuple[bytes, bool]:  # fmt: skip
    """(the shared library built from ``package``'s ``source_name`` with the ``language`` compiler and
    ``flags`` (then ``extra``), whether it came from the cache): one entry of the private kernel cache's
    ``subdir`` per source, compiler, ``versions`` (of what the source is built against), flags and machine,
    named ``stem``-<hash>.v1.so; built in a private temporary directory where the entry is missing or not
    ours. ``what`` names the cache in messages. BuildFailed off Linux, without a compiler, or where it fails."""
    if not sys.platform.startswith("linux"):
        raise BuildFailed("it is built and loaded on Linux only")
    command = compiler(language)
    text = resources.files(package).joinpath(source_name).read_text()
    inputs = "\0".join([text, compiler_identity(command), *versions, " ".join(flags), platform.machine()])
    name = f"{stem}-{hashlib.sha256(inputs.encode()).hexdigest()[:20]}.v1.so"

    def build() -> bytes:
        with tempfile.TemporaryDirectory(prefix=f"mpigpu-{stem}-") as scratch:  # created 0700
            source, built = Path(scratch) / source_name, Path(scratch) / "library.so"
            source.write_text(text)
            run([*command, *flags, *extra, str(source), "-o", str(built)])
            return built.read_bytes()

    return cached_build(settings().cache_dir, subdir, name, magic, build, what)


_loaded_fds: list[int] = []  # the memory files of the libraries loaded so far, open for the process's life


def load_from_memory(data: bytes, name: str) -> ctypes.CDLL:
    """The shared library ``data``, loaded through an anonymous memory file called ``name``. The file stays
    open: the loader knows a library by its path (/proc/self/fd/N), and a descriptor number freed and given
    to the next library would make the loader hand back the first one."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:  # a write may take less than it is given
            view = view[os.write(fd, view) :]
        library_ = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _loaded_fds.append(fd)
    return library_


# (library prefix, names) -> the functions' addresses, or why not
_functions: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, int] | str] = {}


def library_functions(prefix: str, names: dict[str, str]) -> dict[str, int] | str:
    """The addresses of ``names``' functions in the one library of this process named ``prefix``* (e.g.
    "libnccl.so"), or why not: none loaded, or several (a communicator made by one must not reach another's
    functions, and which one made it cannot be told here). ``names``: key -> symbol."""
    key = (prefix, tuple(names.items()))
    found = _functions.get(key)
    if found is None:
        paths = loaded_libraries(prefix)
        if len(paths) != 1:
            found = f"{len(paths)} {prefix}* libraries are loaded in this process ({', '.join(sorted(paths))})"
        else:
            library_ = ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD)
            found = {c: ctypes.cast(getattr(library_, name), ctypes.c_void_p).value or 0 for c, name in names.items()}
        _functions[key] = found
    return found


def loaded_libraries(prefix: str) -> set[str]:
    """The real paths of the libraries mapped in this process whose file name starts with ``prefix``."""
    with open("/proc/self/maps") as maps:
        return {os.path.realpath(p) for p in (line.split()[-1] for line in maps if "/" in line)
                if os.path.basename(p).startswith(prefix)}  # fmt: skip
