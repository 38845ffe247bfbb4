"""scripts/scaling_fit.py, the cost model of docs/scaling.md: on figures made from the model itself
it recovers the model and extrapolates exactly (no miss, no spread); on noisy figures the
uncertainty it reports covers the miss; and it runs on the committed issue-45 figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import ROOT, load_script

SCRIPT = ROOT / "scripts" / "scaling_fit.py"
LAYOUTS = ("1x8", "2x4", "2x1", "4x2", "1x16", "4x4")


def _module():
    return load_script(SCRIPT, "scaling_fit_under_test")


def _rows(noise: float = 0.0) -> list[dict[str, object]]:
    module, rows = _module(), []
    for i, layout in enumerate(LAYOUTS):
        n, m, per = module.parse_layout(layout)
        wobble = 1 + noise * (-1) ** i
        for nbytes in (8, 1 << 20, 8 << 20):
            if nbytes == 8:
                us = 3.0 + 2.0 * math.log2(n)
            else:
                us = 5.0 * math.log2(n) + nbytes * (1e-4 + 2e-4 * (per - 1) / per + 8e-4 * (m - 1) / m)
            rows.append({"layout": layout, "bytes": nbytes, "mpi_us": us * wobble})
    return rows


def test_figures_made_from_the_model_are_recovered_and_extrapolated_exactly() -> None:
    lines = _module().fit_all(_rows(), ["64x8"])
    by_size = {line["bytes"]: line for line in lines if line["path"] == "mpi"}
    assert math.isclose(by_size[8]["us"], 3 + 2 * 9, abs_tol=0.05)
    want = 5 * 9 + (8 << 20) * (1e-4 + 2e-4 * 7 / 8 + 8e-4 * 63 / 64)
    assert math.isclose(by_size[8 << 20]["us"], want, rel_tol=1e-3)
    assert all(line["loo_miss"] is not None and line["loo_miss"] < 1e-6 for line in lines)


def test_noisy_figures_report_an_uncertainty_that_covers_the_miss() -> None:
    lines = _module().fit_all(_rows(noise=0.1), ["64x8"])
    small = next(line for line in lines if line["bytes"] == 8)
    assert small["loo_miss"] > 0.05 and small["fit_2se_us"] > 0
    assert abs(small["us"] - 21) <= small["fit_2se_us"] + small["loo_miss"] * small["us"]


def test_it_runs_on_the_committed_issue_figures(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    assert _module().main([str(ROOT / "bench/results/cpu-nodes-issue45.json"), "--json", str(out)]) == 0
    lines = json.loads(out.read_text())["lines"]
    assert {line["path"] for line in lines} == {"auto", "mpi", "host"}
    assert all(line["layout"] == "64x8" and line["us"] > 0 for line in lines if line["path"] != "host")
