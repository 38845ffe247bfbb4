"""Averager's per-bucket interface (begin_step, start_bucket, bucket_members, step_in_flight), the one
integrations.torch drives from backward hooks: buckets started one at a time give the exact averages."""

from __future__ import annotations

import numpy as np
import pytest

from mpigpu.core.errors import InvalidArgument
from mpigpu.training.averager import Averager

pytestmark = pytest.mark.mpi(min_size=1)


def test_buckets_started_one_by_one_average_exactly(comm) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays = [np.full(n, float(rank * 10 + i), np.float64) for i, n in enumerate((300, 5, 700, 64))]
    averager = Averager(arrays, bucket_bytes=4096, first_bucket_bytes=None, comm=comm)
    try:
        members = averager.bucket_members
        assert len(members) > 1, "several buckets, so the order of starts matters"
        assert sorted(i for m in members for i in m) == list(range(len(arrays)))
        assert not averager.step_in_flight
        with pytest.raises(InvalidArgument, match="without begin_step"):
            averager.start_bucket(0)
        averager.begin_step()
        assert averager.step_in_flight
        for index in range(len(members)):
            averager.start_bucket(index)
        result = averager.finish()
        assert not averager.step_in_flight
        for i, got in enumerate(result):
            # mean over ranks of rank * 10 + i: exact in float64
            np.testing.assert_array_equal(got, np.full(arrays[i].size, 10 * (size - 1) / 2 + i))
    finally:
        averager.close()
