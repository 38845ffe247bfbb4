"""The benchmark on GPU buffers, in process under mpirun (scripts/gpu-check.sh runs tests/gpu with
2 and 4 ranks, Open MPI and Intel MPI): every available backend and anchor is verified and timed at
a few sizes, every backend has its anchor beside it, and a damaged result makes the exit status 1.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mpigpu.bench import main as bench
from mpigpu.runtime.context import Context

pytestmark = [pytest.mark.gpu, pytest.mark.mpi(min_size=1)]

QUICK = ["-b", "8", "-e", "1M", "-f", "8", "--iters", "5", "--repeats", "2", "--warmup", "2", "--quiet"]


def _bench(comm: Any, *args: str) -> tuple[int, dict[str, Any]]:
    """Run the benchmark collectively; (exit status, the JSON document) on every rank."""
    folder = comm.bcast(tempfile.mkdtemp(prefix="mpigpu-bench-") if comm.Get_rank() == 0 else None, root=0)
    out = Path(folder) / "run.json"
    argv = [*QUICK, "--placement", "gpu", "--json", str(out), *args]
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    statuses = comm.allgather(status)
    assert len(set(statuses)) == 1, f"ranks disagree on the exit status: {statuses}"
    doc = comm.bcast(json.loads(out.read_text()) if comm.Get_rank() == 0 else None, root=0)
    return status, doc


def test_every_gpu_path_is_verified_and_paired_with_its_anchor(comm) -> None:
    ctx = Context.get(comm)
    status, doc = _bench(comm, "--dtypes", "float32,bfloat16", "--ops", "sum,avg")
    failures = [(r["path"], r["dtype"], r["op"], r["inplace"], r["bytes"], r["wrong"]) for r in doc["failures"]]
    assert status == 0 and doc["ok"], f"wrong elements: {failures}"
    rows = doc["results"]
    assert rows and all(r["placement"] == "device" and r["wrong"] == 0 for r in rows)
    measured = {r["path"] for r in rows}
    assert "seed-staging" in measured
    assert ("nccl-raw" in measured) == ctx.nccl.available
    assert ("mpi-device" in measured) == ctx.cuda_aware.aware
    for name in ("ipc", "nccl", "cuda-aware", "host"):  # every available backend takes GPU buffers
        assert (name in measured) == ctx.availability[name].ok, (name, ctx.availability[name])
    anchors = {(r["path"], r["dtype"], r["op"], r["inplace"], r["bytes"]) for r in rows if r["kind"] == "anchor"}
    for row in rows:
        if (
            row["kind"] == "backend"
            and row["anchor"] in measured
            and not (
                row["anchor"] != "nccl-raw" and row["dtype"] == "bfloat16"  # MPI has no bfloat16
            )
        ):
            assert (row["anchor"], row["dtype"], row["op"], row["inplace"], row["bytes"]) in anchors, row
    assert doc["machine"]["gpu_count"] >= 1 and doc["machine"]["gpu_model"]
    assert doc["versions"]["cuda"], "the CUDA driver/runtime versions belong in the JSON"


def test_user_calls_keep_the_benchmark_stream_after_the_staging_anchor(comm) -> None:
    """Regression (2 x H200, CuPy arrays): the seed-staging anchor's ``with stream:`` block ended by
    making CuPy's legacy stream current (CuPy goes back to the innermost *entered* stream, and the
    sweep had made its stream current with ``.use()``). Every later user call and request on CuPy
    arrays then ran on the legacy stream, racing the fills and checks (poisoned or unreduced
    results, some half written) and escaping the timing's synchronisation. The sweep now enters its
    stream, and binding a call refuses a current stream other than the benchmark's."""
    ctx = Context.get(comm)
    backends = [b for b in ("nccl", "ipc") if ctx.availability[b].ok]
    args = ["--sizes", "8,64K,1M", "--dtypes", "float32", "--ops", "sum,avg", "--framework", "native",
            "--backends", ",".join(["seed-staging", *backends, "auto"])]  # fmt: skip
    status, doc = _bench(comm, *args)
    assert status == 0 and doc["ok"], doc["failures"]
    columns = {r["column"] for r in doc["results"]}
    assert {"seed-staging", "auto", "auto:req", *backends, *(f"{b}:req" for b in backends)} <= columns


def test_a_damaged_device_result_exits_1(comm) -> None:
    status, doc = _bench(comm, "-b", "64", "-e", "512", "--backends", "seed-staging", "--corrupt", "3")
    assert status == 1 and not doc["ok"]
    assert doc["failures"] and all(r["wrong"] == 3 for r in doc["results"])


def test_user_call_request_prepared_and_torch_anchor_are_verified_side_by_side(comm) -> None:
    """The rows of issue 14's table: allreduce(x) and req() for auto, nccl and ipc, the prepared
    diagnostic, raw NCCL and torch.distributed (NCCL) where torch is installed; every row checked,
    and a damaged result seen in every one of them."""
    import importlib.util

    ctx = Context.get(comm)
    backends = [b for b in ("nccl", "ipc") if ctx.availability[b].ok]
    if not backends or not ctx.nccl.available:
        pytest.skip("neither nccl nor ipc can run here")
    torch_ok = importlib.util.find_spec("torch") is not None
    anchors = ["nccl-raw", *(["torch-nccl"] if torch_ok else [])]
    args = ["--sizes", "8,64K,1M", "--calls", "all", "--backends", ",".join(["auto", *backends, *anchors]),
            "--framework", "torch" if torch_ok else "native", "--inplace"]  # fmt: skip
    status, doc = _bench(comm, *args)
    assert status == 0 and doc["ok"], doc["failures"]
    columns = {r["column"] for r in doc["results"]}
    calls = [f"{name}{suffix}" for name in ("auto", *backends) for suffix in ("", ":req", ":prep")]
    assert columns == {*calls, *anchors}
    for column in columns:
        assert sorted(r["bytes"] for r in doc["results"] if r["column"] == column) == [8, 65536, 1 << 20], column
    autos = [r for r in doc["results"] if r["path"] == "auto"]
    assert all(r["chosen"] in backends for r in autos)
    for size in (8, 65536, 1 << 20):  # the three calls of auto choose alike
        assert len({r["chosen"] for r in autos if r["bytes"] == size}) == 1

    status, doc = _bench(comm, *args, "--corrupt", "2")
    assert status == 1
    assert {r["column"] for r in doc["results"]} == {*calls, *anchors}
    assert all(r["wrong"] == 2 for r in doc["results"])


@pytest.mark.parametrize("framework", ["native", "torch"])
@pytest.mark.parametrize("collective", ["broadcast", "allgather"])
def test_broadcast_and_allgather_rows_beside_raw_nccl(comm, collective: str, framework: str) -> None:
    """--collective: mpigpu.broadcast(x, root=0) / mpigpu.allgather(x) for auto and every backend
    that implements it on GPU buffers (nccl, host, cuda-aware; not ipc), beside raw NCCL and
    torch.distributed (NCCL); every row verified byte for byte, then a damaged result seen in every row."""
    import importlib.util

    ctx = Context.get(comm)
    torch_ok = importlib.util.find_spec("torch") is not None
    if framework == "torch" and not torch_ok:
        pytest.skip("torch is not installed")
    backends = [b for b in ("nccl", "host", "cuda-aware") if ctx.availability[b].ok]
    anchors = ["nccl-raw", "torch-nccl", "mpi-device"]
    args = ["--collective", collective, "--sizes", "8,64K,1M,3M", "--dtypes", "float32,bfloat16", "--framework",
            framework, "--backends", ",".join(["auto", "ipc", *backends, *anchors])]  # fmt: skip
    status, doc = _bench(comm, *args)
    assert status == 0 and doc["ok"], doc["failures"]
    assert doc["collective"] == collective
    rows = doc["results"]
    columns = {r["column"] for r in rows}
    expected = {"auto", *backends}
    expected |= {f"{b}:out" for b in ("auto", *backends)} if collective == "allgather" else set()  # out=o, made once
    expected |= {"nccl-raw"} if ctx.nccl.available else set()
    expected |= {"torch-nccl"} if torch_ok and ctx.nccl.available else set()
    expected |= {"mpi-device"} if ctx.cuda_aware.aware else set()
    assert columns == expected, doc["skipped"]
    assert "ipc" not in columns and any(line.startswith("ipc: does not implement") for line in doc["skipped"])
    n = ctx.size
    for row in rows:
        assert row["placement"] == "device" and row["collective"] == collective and row["wrong"] == 0
        assert row["out_bytes"] == row["bytes"] * (n if collective == "allgather" else 1)
    for column in columns:
        mine = sorted((r["dtype"], r["bytes"]) for r in rows if r["column"] == column)
        assert mine == sorted((d, s) for d in ("float32", "bfloat16") for s in (8, 65536, 1 << 20, 3 << 20)), column
    if "nccl" in backends:
        assert all(r["anchor"] == "nccl-raw" for r in rows if r["path"] == "nccl")

    status, doc = _bench(comm, *args, "--corrupt", "1")  # one element of rank 0's result, in every row
    assert status == 1 and {r["column"] for r in doc["results"]} == expected
    assert all(r["wrong"] == 1 for r in doc["results"])


@pytest.mark.parametrize("item", [1, 2, 4, 8])
def test_device_wrong_counts_elements_as_numpy_does_at_every_size(comm, item: int) -> None:
    """The verifiers' device check of changed elements (one mpigpu kernel for every size and dtype: no
    CuPy reduction compiled per size, whose NVRTC memory a soak would count) counts the elements with
    any wrong byte exactly as the NumPy reference, at any byte offset."""
    from mpigpu.bench.workload import count_changed_device
    from mpigpu.core._cuda import cupy

    cp, gpu = cupy(), Context.get(comm).gpu
    stream = 0  # the legacy default stream: ordered after cp.asarray's copies
    rng = np.random.default_rng(item)
    for count, offset in ((1, 0), (2, 3), (7, 1), (2048, 0), (16384, 5), (262145, 0)):
        want = rng.integers(0, 251, count * item + offset, dtype=np.uint8)
        got = want.copy()
        hit = offset + rng.choice(count * item, size=min(count * item, 37), replace=False)
        got[hit] = 0xFF  # the poison: never a pattern byte
        expected = int((got[offset:].reshape(count, item) != want[offset:].reshape(count, item)).any(axis=1).sum())
        assert expected > 0
        dgot, dwant = cp.asarray(got), cp.asarray(want)
        at = (int(dgot.data.ptr) + offset, int(dwant.data.ptr) + offset)
        assert count_changed_device(*at, count, item, gpu, stream) == expected, count
        assert count_changed_device(at[1], at[1], count, item, gpu, stream) == 0, count


def test_every_collective_in_one_run_beside_torch_and_raw_nccl(comm) -> None:
    """Issue 36 (the gpu-check collectives stage, small): ``--collective all`` on torch CUDA tensors at
    two sizes, in one job: for each of the five, the user's call under auto and each backend that has
    it, raw NCCL and torch.distributed's own call (NCCL), every row verified; a JSON document per
    collective named <gpu>x<n>-<collective>-<date>.json and the table of them all; then a damaged
    result seen in every row of every collective."""
    import importlib.util

    ctx = Context.get(comm)
    if not ctx.nccl.available:
        pytest.skip(f"NCCL is not available: {ctx.nccl.reason}")
    torch_ok = importlib.util.find_spec("torch") is not None
    backends = [b for b in ("nccl", "host") if ctx.availability[b].ok]
    anchors = ["nccl-raw", *(["torch-nccl"] if torch_ok else [])]
    folder = Path(comm.bcast(tempfile.mkdtemp(prefix="mpigpu-bench-") if comm.Get_rank() == 0 else None, root=0))
    small = 4 * max(2, comm.Get_size())  # a float32 row per rank
    argv = [*QUICK, "--placement", "gpu", "--collective", "all", "--inplace", "--sizes", f"{small},64K",
            "--framework", "torch" if torch_ok else "native", "--backends", ",".join(["auto", *backends, *anchors]),
            "--json-dir", str(folder), "--tag", "t"]  # fmt: skip
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    assert set(comm.allgather(status)) == {0}
    comm.Barrier()
    docs = {json.loads(p.read_text())["collective"]: json.loads(p.read_text()) for p in folder.glob("t-*.json")}
    assert sorted(docs) == sorted(["allreduce", "reduce_scatter", "alltoall", "broadcast", "allgather"])
    for name, doc in docs.items():
        assert doc["ok"], (name, doc["failures"])
        columns = {r["column"] for r in doc["results"]}
        calls = {"auto", *backends, *([f"{b}:req" for b in ("auto", *backends)] if name == "allreduce" else [])}
        calls |= {f"{b}:out" for b in ("auto", *backends)} if name in ("allgather", "alltoall") else set()
        brought = {"seed-staging"} if name == "allreduce" and "host" in backends else set()  # host's anchor
        assert columns == calls | set(anchors) | brought, (name, doc["skipped"], doc["not_timed"])
        assert all(r["placement"] == "device" and r["wrong"] == 0 for r in doc["results"])
        assert {r["bytes"] for r in doc["results"]} == {small, 65536}
    table = next(folder.glob("t-collectives-*.md")).read_text()
    if torch_ok:
        assert "torch `reduce_scatter_tensor`" in table and "torch `all_to_all_single`" in table
    assert "raw NCCL allGather" in table

    argv = [*argv[: argv.index("--json-dir")], "--corrupt", "1", "--json-dir", str(folder / "bad"), "--tag", "t"]
    status = bench.run(bench.build_parser().parse_args(argv), ["test", *argv])
    assert set(comm.allgather(status)) == {1}
    comm.Barrier()
    for path in (folder / "bad").glob("t-*.json"):
        doc = json.loads(path.read_text())
        assert not doc["ok"] and all(r["wrong"] == 1 for r in doc["results"]), doc["collective"]
