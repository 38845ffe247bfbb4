"""The sharded-gradients example of docs/collectives.md runs as written, on 2 ranks and on 3 (where
the shards are uneven), and its sharded step (reduce_scatter, update the shard, allgather) equals
the allreduce step bit for bit."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_mpi

DOC = ROOT / "docs" / "collectives.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    found = [b for b in blocks if b.startswith("# mpiexec -n 2 python sharded_sgd.py")]
    assert len(found) == 1, "the sharded SGD example is not in docs/collectives.md"
    return found[0]


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_sgd_example(tmp_path, n: int) -> None:
    pytest.importorskip("torch", reason="torch is not installed (the CI test script installs it)")
    script = tmp_path / "sharded_sgd.py"
    script.write_text(_example())
    result = run_mpi(n, [str(script)], timeout=240)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    for rank in range(n):
        assert f"rank {rank}: sharded step equals the allreduce step: True" in result.stdout, text
