"""temp"""

from __future__ import annotations

from typing import ClassVar

from mpigpu.backends.base import Availability, Backend


class NcclBackend(Backend):
    name: ClassVar[str] = "nccl"
    code: ClassVar[int] = 4
    host_arrays: ClassVar[bool] = False
    device_arrays: ClassVar[bool] = True

    @classmethod
    def probe(cls, ctx):
        return Availability(False, "not written yet")

    def allreduce(self, x, out, op, stream):
        raise NotImplementedError
