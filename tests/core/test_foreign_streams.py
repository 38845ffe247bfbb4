"""Foreign streams reach cuda.core and CuPy in the form each one wants (issue 39: cuda.core deprecates
being handed foreign stream objects, CuPy 14 deprecates ExternalStream), on a CPU with a fake cuda.core
and a fake CuPy that warn as the real ones do: mpigpu's kernel launch hands cuda.core its own Stream,
made once per handle, and a CuPy stream over a handle comes from Stream.from_external where CuPy has it
(tests/gpu/test_stream_warnings_gpu.py runs the real ones with the warnings as errors)."""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import pytest

from mpigpu.core import _cuda
from mpigpu.core.errors import InvalidArgument
from mpigpu.kernels import compile as kc


class _Stream:
    """cuda.core's Stream: made by ``from_handle`` (counted), launched on without a warning."""

    made: list[int]

    def __init__(self, handle: int) -> None:
        self.handle = handle

    @classmethod
    def from_handle(cls, handle: int) -> _Stream:
        cls.made.append(handle)
        return cls(handle)


class _Core:
    """A fake cuda.core: ``launch`` records the stream it was given and, as cuda.core does, warns when
    that is a foreign object it must convert itself."""

    def __init__(self) -> None:
        self.module = types.ModuleType("cuda.core")
        self.launched: list[Any] = []
        stream = type("Stream", (_Stream,), {"made": []})
        self.module.__dict__.update(
            Stream=stream,
            LEGACY_DEFAULT_STREAM=stream(0),
            LaunchConfig=lambda grid, block: (grid, block),
            launch=self._launch,
        )

    def _launch(self, stream: Any, config: Any, kernel: Any, *args: Any) -> None:
        if not isinstance(stream, self.module.Stream):
            warnings.warn("Passing foreign stream objects to this function is deprecated", DeprecationWarning, 2)
        self.launched.append(stream)


class _CupyStream:
    """What a CuPy stream object over a foreign handle looks like (its ``ptr``)."""

    def __init__(self, ptr: int, foreign: Any = None) -> None:
        self.ptr, self.foreign = ptr, foreign

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy(version: int) -> types.SimpleNamespace:
    """A fake CuPy 14 (Stream.from_external; ExternalStream warns) or 13 (ExternalStream only)."""

    def external_stream(ptr: int) -> _CupyStream:
        if version >= 14:
            warnings.warn("ExternalStream is deprecated. Use Stream.from_external() instead", DeprecationWarning, 2)
        return _CupyStream(ptr)

    stream = types.SimpleNamespace()
    if version >= 14:
        stream.from_external = lambda obj: _CupyStream(obj.__cuda_stream__()[1], obj)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=stream, ExternalStream=external_stream))


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> _Core:
    fake = _Core()
    monkeypatch.setattr(_cuda, "require_cuda_core", lambda *args: fake.module)
    monkeypatch.setattr(kc, "require_cuda_core", lambda *args: fake.module)
    # a cache of its own: the fake's streams never reach the real one's
    monkeypatch.setattr(_cuda, "core_stream", functools.cache(_cuda.core_stream.__wrapped__))
    return fake


@pytest.fixture
def strict() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        yield


def test_launch_hands_cuda_core_its_own_stream_once_per_handle(core: _Core, strict: None) -> None:
    refs = [_cuda.StreamRef(0x5000), _cuda.StreamRef(0x5000), _cuda.StreamRef(0x6000), _cuda.StreamRef(0x5000)]
    for ref in refs:
        kc.launch(ref, "kernel", 1000, 1, 2)
    assert [type(s) for s in core.launched] == [core.module.Stream] * 4
    assert [s.handle for s in core.launched] == [0x5000, 0x5000, 0x6000, 0x5000]
    assert core.module.Stream.made == [0x5000, 0x6000]  # a repeated launch wraps nothing again
    assert core.launched[0] is core.launched[1] is core.launched[3]


def test_launch_wraps_any_foreign_stream_and_passes_cuda_cores_own(core: _Core, strict: None) -> None:
    own = core.module.Stream(0x7000)
    kc.launch(_CupyStream(0x8000), "kernel", 1)  # a CuPy stream: __cuda_stream__
    kc.launch(types.SimpleNamespace(cuda_stream=0xA000), "kernel", 1)  # an older PyTorch stream
    kc.launch(0x9000, "kernel", 1)  # an int handle
    kc.launch(own, "kernel", 1)
    kc.launch(_cuda.StreamRef(0), "kernel", 1)  # the legacy default stream: cuda.core's own object
    assert [s.handle for s in core.launched] == [0x8000, 0xA000, 0x9000, 0x7000, 0]
    assert core.launched[3] is own and core.launched[4] is core.module.LEGACY_DEFAULT_STREAM
    assert core.module.Stream.made == [0x8000, 0xA000, 0x9000]
    with pytest.raises(InvalidArgument, match="stream must be"):  # not a stream: refused before cuda.core
        kc.launch("stream 1", "kernel", 1)
    assert len(core.launched) == 5


@pytest.mark.parametrize("version", [14, 13])
def test_cupy_stream_uses_from_external_where_cupy_has_it(
    monkeypatch: pytest.MonkeyPatch, strict: None, version: int
) -> None:
    monkeypatch.setattr(_cuda, "cupy", lambda *args: _cupy(version))
    stream = _cuda.cupy_stream(0x5000)
    assert stream.ptr == 0x5000
    assert stream.foreign == (_cuda.StreamRef(0x5000) if version >= 14 else None)  # else ExternalStream's
