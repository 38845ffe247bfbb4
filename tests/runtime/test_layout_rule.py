"""auto's layout rules for host arrays (mpigpu.runtime.plan.layout_rule): the backend per layout and
size that issue 45's runs measured, and, in jobs across MPI nodes (MPICH's fork launcher: 2x2,
2+1, 3+1, 1+1, one node of 3), the choice ``mpigpu.explain`` gives on every rank, with the layout in
its reason; a tuning table is kept per layout (an uneven one has its own signature)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import run_mpi

from mpigpu.runtime.plan import ACROSS_NODES_HOST_FROM, FEW_PER_NODE_HOST_FROM, ONE_NODE_HOST_FROM, layout_rule

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("sizes", "nbytes", "want"),
    [
        ((1, 1), 8, "cpu"), ((1, 1), 8 * MiB, "cpu"), ((1, 1, 1, 1), 64 * MiB, "cpu"),  # one rank per node
        ((2, 1), 8 * MiB, "cpu"), ((3, 1), 8 * MiB, "cpu"),  # a node of one rank
        ((4, 4), 8, "cpu"), ((4, 4), 64 * KiB, "cpu"), ((4, 4), ACROSS_NODES_HOST_FROM - 1, "cpu"),
        ((4, 4), ACROSS_NODES_HOST_FROM, "host"), ((2, 2, 2, 2), 8 * MiB, "host"), ((3, 2), 1 * MiB, "host"),
        ((4, 4, 4, 4), 256 * KiB, "host"), ((5, 3), 256 * KiB, "host"), ((3, 3), 256 * KiB, "host"),  # 3 or more
        ((3, 3), 128 * KiB, "cpu"), ((4, 2), 256 * KiB, "cpu"), ((2, 2, 2, 2), 512 * KiB, "cpu"),
        ((3, 2), FEW_PER_NODE_HOST_FROM - 1, "cpu"), ((4, 2), FEW_PER_NODE_HOST_FROM, "host"),  # 2: from 1 MiB
        ((2, 2), FEW_PER_NODE_HOST_FROM, "host"),
        ((8,), 8, "cpu"), ((8,), 48 * KiB, "cpu"), ((8,), 64 * KiB, "cpu"), ((16,), 32 * KiB, "cpu"),
        ((8,), 128 * KiB, "cpu"), ((8,), ONE_NODE_HOST_FROM - 1, "cpu"), ((8,), ONE_NODE_HOST_FROM, "host"),
        ((16,), ONE_NODE_HOST_FROM, "host"), ((8,), 8 * MiB, "host"),
    ],
)  # fmt: skip
def test_the_backend_per_layout_and_size(sizes: tuple[int, ...], nbytes: int, want: str) -> None:
    choice = layout_rule(sizes, nbytes)
    assert choice is not None and choice.backend == want, choice
    label = f"{len(sizes)}x{sizes[0]}" if len(set(sizes)) == 1 else "+".join(map(str, sizes))
    assert choice.reason.startswith(f"layout {label}: "), choice.reason


@pytest.mark.parametrize("sizes", [(1,), (2,), (4,), (7,)])
def test_one_node_of_few_ranks_keeps_the_backends_own_rules(sizes: tuple[int, ...]) -> None:
    assert layout_rule(sizes, 8) is None and layout_rule(sizes, 8 * MiB) is None


_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import mpigpu
    from mpigpu.runtime.context import Context
    from mpigpu.runtime.tuning import machine_signature
    ctx = Context.get()
    picks = [mpigpu.explain(np.zeros(b // 4, np.float32), "sum") for b in (8, 65536, 256 << 10, 1 << 20, 8 << 20)]
    mine = [[c.backend, c.reason] for c in picks]
    everyone = ctx.comm.gather([mine, machine_signature(ctx)], root=0)
    if ctx.rank == 0:
        print(json.dumps(everyone))
""")


@pytest.mark.parametrize(
    ("hosts", "n", "want"),
    [
        ("nodeA:2,nodeB:2", 4, ["cpu", "cpu", "cpu", "host", "host"]),  # nodes of 2: host from 1 MiB
        ("nodeA:3,nodeB:3", 6, ["cpu", "cpu", "host", "host", "host"]),  # nodes of 3: from 256 KiB
        ("nodeA:2,nodeB:1", 3, ["cpu"] * 5),
        ("nodeA:3,nodeB:1", 4, ["cpu"] * 5),
        ("nodeA:1,nodeB:1", 2, ["cpu"] * 5),
        ("nodeA:3", 3, ["cpu", "host", "cpu", "cpu", "host"]),  # one node of 3: the host backend's own windows
    ],
    ids=["2x2", "3x3", "2+1", "3+1", "1+1", "1x3"],
)
def test_explain_gives_the_layouts_choice_on_every_rank(tmp_path: Path, hosts: str, n: int, want: list[str]) -> None:
    script = tmp_path / "explain.py"
    script.write_text(_SCRIPT)
    result = run_mpi(n, [str(script)], hosts=hosts, timeout=120, env={"MPIGPU_TUNE_FILE": str(tmp_path / "none")})
    assert result.returncode == 0, result.stdout + result.stderr
    everyone = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(everyone) == n and all(rank[0] == everyone[0][0] for rank in everyone), "every rank decides alike"
    picks, signature = everyone[0]
    assert [backend for backend, _ in picks] == want
    if hosts.count(":") > 1:
        assert all(reason.startswith("layout ") for _, reason in picks), picks
    assert ("node_sizes" in signature) == (hosts in ("nodeA:2,nodeB:1", "nodeA:3,nodeB:1")), (
        signature
    )  # rank 0's: the table's key
