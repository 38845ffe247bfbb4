"""mpigpu.bench.enqueue without a GPU (issue 48, goal 5): the ``handler`` record scripts/jax_step_bench.py writes
(the handler's cost per call beside NCCL's enqueue of the same bytes, or None with the reason), the goal's
verdict at its edges, and that nothing is enqueued where the platform or NCCL rules it out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpigpu.bench.enqueue import HANDLER_OVER_NCCL_US, HANDLER_US, handler_beside_nccl, handler_goal, handler_record

ROW = {"handler": "compiled", "calls_per_step": 2.0, "us_per_call": 31.5, "cpu_us_per_call": 12.25}
ENQUEUE = {"us": 10.5, "cpu_us": 10.0, "median_us": 10.25, "calls": 200, "bytes": 1 << 20}


def test_the_record_sets_the_handler_beside_nccls_enqueue() -> None:
    record = handler_record(ROW, 2 << 20, ENQUEUE)
    assert record["us_per_call"] == 31.5 and record["cpu_us_per_call"] == 12.25 and record["handler"] == "compiled"
    assert record["bytes_per_call"] == 1 << 20  # two calls per step share the step's bytes
    assert record["nccl_enqueue_us"] == 10.5 and record["nccl_enqueue_cpu_us"] == 10.0
    assert record["over_nccl_enqueue_cpu_us"] == pytest.approx(2.25) and record["nccl_enqueue"] == ENQUEUE
    assert "nccl_enqueue_reason" not in record


def test_without_the_enqueue_the_record_says_why() -> None:
    record = handler_record(ROW, 2 << 20, None, "no GPU")
    assert record["nccl_enqueue_us"] is None and record["over_nccl_enqueue_cpu_us"] is None
    assert record["nccl_enqueue_reason"] == "no GPU" and record["us_per_call"] == 31.5


@pytest.mark.parametrize(
    ("cpu_us", "enqueue_cpu_us", "met"),
    [
        (HANDLER_US, None, True),  # at most 10 us: met, enqueue or not
        (HANDLER_US + 0.5, None, False),  # above, and nothing to compare with
        (HANDLER_US + 5, HANDLER_US + 5 - HANDLER_OVER_NCCL_US, True),  # exactly 3 us over NCCL's enqueue
        (HANDLER_US + 5, HANDLER_US + 1, False),  # 4 us over
        (HANDLER_US - 1, HANDLER_US + 1, True),  # under 10 us even though NCCL's enqueue is slower
    ],
)
def test_the_goal_is_ten_us_or_three_over_nccl(cpu_us: float, enqueue_cpu_us: float | None, met: bool) -> None:
    enqueue = None if enqueue_cpu_us is None else {**ENQUEUE, "cpu_us": enqueue_cpu_us}
    goal = handler_goal(handler_record({**ROW, "cpu_us_per_call": cpu_us}, 1 << 20, enqueue))
    assert goal["met"] is met, goal
    assert goal["target"] == 10.0 and goal["target_over_nccl_enqueue"] == 3.0


def test_no_enqueue_off_the_gpu_or_without_nccl() -> None:
    """Neither case touches the GPU: the context is a stand-in without ``activate_gpu``."""
    in_jit = {"handler": ROW, "bytes_reduced_per_step": 2 << 20}
    no_nccl = SimpleNamespace(nccl=SimpleNamespace(available=False, reason="libnccl.so.2 not found"))
    assert handler_beside_nccl(no_nccl, "cpu", {"bytes_reduced_per_step": 8}) is None  # no handler row
    off = handler_beside_nccl(no_nccl, "cpu", in_jit)
    assert off is not None and "no GPU (JAX on cpu)" in off["nccl_enqueue_reason"]
    missing = handler_beside_nccl(no_nccl, "gpu", in_jit)
    assert missing is not None and missing["nccl_enqueue_reason"] == "NCCL is not available: libnccl.so.2 not found"
