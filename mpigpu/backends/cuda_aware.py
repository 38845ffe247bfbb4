"""temp"""

from __future__ import annotations

from typing import ClassVar

from mpigpu.backends.base import Availability, Backend


class CudaAwareBackend(Backend):
    name: ClassVar[str] = "cuda-aware"
    code: ClassVar[int] = 3
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True

    @classmethod
    def probe(cls, ctx):
        return Availability(False, "not written yet")

    def allreduce(self, x, out, op, stream):
        raise NotImplementedError
