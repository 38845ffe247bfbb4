"""Fit the per-call cost model of docs/scaling.md to a results file of scripts/cpu_nodes.py and
extrapolate it, beside MPI's, to a larger layout (default 64 nodes x 8 ranks).

    python scripts/scaling_fit.py bench/results/cpu-nodes-issue45.json
    python scripts/scaling_fit.py bench/results/cpu-nodes-2026-11-29.json --to 64x8 --to 16x8 --json fit.json

The model, per path (auto, mpi, cpu, host: each ``<path>_us`` column), with N ranks on M nodes of L
ranks (the largest node) and S bytes per rank:

  small calls (S <= 64 KiB, fitted at each size):  t = a + b log2 N
  large calls (S >= 1 MiB, fitted over the sizes): t = c log2 N + S (d + e (L - 1) / L + f (M - 1) / M)

(a latency per round; the bandwidth-optimal algorithms' per-byte costs inside a node and between nodes,
which tend to constants as L and M grow). Least squares (NumPy's lstsq), a term left out where the
points cannot tell it apart (fewer points than terms, or a column with no spread). The uncertainty of
a prediction is given two ways: the fit's own (2 standard errors from the residuals, where the points
outnumber the terms) and leave-one-layout-out: refit without each layout, predict that layout, and
take the largest relative miss, applied to the prediction. With the handful of layouts one machine
gives, the second is the honest one; both are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

SMALL_MAX = 64 << 10
LARGE_MIN = 1 << 20
PATHS = ("auto", "mpi", "cpu", "host")


def parse_layout(text: str) -> tuple[int, int, int]:
    """(N ranks, M nodes, L ranks on the largest node) of "2x4" or "2+1"."""
    if "x" in text:
        nodes, per = (int(v) for v in text.split("x"))
        return nodes * per, nodes, per
    sizes = [int(v) for v in text.split("+")]
    return sum(sizes), len(sizes), max(sizes)


def _features(kind: str, layout: str, nbytes: int) -> list[float]:
    n, m, per = parse_layout(layout)
    if kind == "small":
        return [1.0, math.log2(n)]
    return [math.log2(n), nbytes, nbytes * (per - 1) / per, nbytes * (m - 1) / m]


def _fit(rows: list[tuple[str, int, float]], kind: str) -> dict[str, Any] | None:
    """Least squares of ``kind``'s model over (layout, bytes, us) rows; the terms kept, the
    coefficients, and the covariance (None where the points do not outnumber the terms)."""
    x = np.array([_features(kind, layout, nbytes) for layout, nbytes, _ in rows], float)
    y = np.array([us for _, _, us in rows], float)
    keep = [j for j in range(x.shape[1]) if np.ptp(x[:, j]) > 0 or (kind == "small" and j == 0)]
    keep = keep[: len(rows)]
    if not keep:
        return None
    xk = x[:, keep]
    coef, *_ = np.linalg.lstsq(xk, y, rcond=None)
    dof = len(rows) - len(keep)
    cov = None
    if dof > 0:
        resid = y - xk @ coef
        s2 = float(resid @ resid) / dof
        cov = s2 * np.linalg.pinv(xk.T @ xk)
    return {"keep": keep, "coef": coef, "cov": cov, "dof": dof}


def _predict(model: dict[str, Any], kind: str, layout: str, nbytes: int) -> tuple[float, float | None]:
    """(prediction, 2 standard errors of the fit, or None)."""
    x0 = np.array(_features(kind, layout, nbytes), float)[model["keep"]]
    value = float(x0 @ model["coef"])
    if model["cov"] is None:
        return value, None
    return value, 2 * math.sqrt(max(0.0, float(x0 @ model["cov"] @ x0)))


def _loo_miss(rows: list[tuple[str, int, float]], kind: str) -> float | None:
    """The largest relative miss predicting a layout from a fit without it (None: too few layouts)."""
    layouts = sorted({layout for layout, _, _ in rows})
    misses = []
    for out in layouts:
        rest = [r for r in rows if r[0] != out]
        if len({r[0] for r in rest}) < 2:
            return None
        model = _fit(rest, kind)
        if model is None:
            return None
        for layout, nbytes, us in rows:
            if layout == out:
                misses.append(abs(_predict(model, kind, layout, nbytes)[0] - us) / us)
    return max(misses) if misses else None


def fit_all(results: list[dict[str, Any]], targets: list[str]) -> list[dict[str, Any]]:
    """One line per (path, size, target layout): the prediction and its uncertainties."""
    by_path: dict[str, list[tuple[str, int, float]]] = defaultdict(list)
    for row in results:
        for path in PATHS:
            if isinstance(row.get(f"{path}_us"), (int, float)):
                by_path[path].append((row["layout"], int(row["bytes"]), float(row[f"{path}_us"])))
    lines = []
    for path, rows in by_path.items():
        sizes = sorted({nbytes for _, nbytes, _ in rows})
        groups = [("small", [s]) for s in sizes if s <= SMALL_MAX] + [("large", [s for s in sizes if s >= LARGE_MIN])]
        for kind, group in groups:
            chosen = [r for r in rows if r[1] in group]
            if len({r[0] for r in chosen}) < 2:
                continue  # one layout: nothing to fit a dependence on N from
            model = _fit(chosen, kind)
            if model is None:
                continue
            loo = _loo_miss(chosen, kind)
            for target in targets:
                for nbytes in group:
                    value, stderr2 = _predict(model, kind, target, nbytes)
                    lines.append({
                        "path": path, "bytes": nbytes, "layout": target, "us": round(value, 1),
                        "fit_2se_us": None if stderr2 is None else round(stderr2, 1),
                        "loo_miss": None if loo is None else round(loo, 3), "points": len(chosen),
                        "terms": len(model["keep"]), "model": kind,
                    })  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a results file of scripts/cpu_nodes.py")
    parser.add_argument("--to", action="append", help="target layouts, NxL (default 64x8)")
    parser.add_argument("--json", help="also write the lines as JSON here")
    args = parser.parse_args(argv)
    document = json.loads(Path(args.results).read_text())
    targets = args.to or ["64x8"]
    lines = fit_all(document["results"], targets)
    print(f"# {args.results}: {document.get('machine', '?')}, {document.get('mpi', '?')}, {document.get('date', '?')}")
    print(f"{'path':>5} {'bytes':>9} {'layout':>6} {'us':>9} {'fit 2se':>9} {'LOO miss':>9}  points/terms")
    for line in lines:
        se = "-" if line["fit_2se_us"] is None else f"{line['fit_2se_us']:.1f}"
        loo = "-" if line["loo_miss"] is None else f"{100 * line['loo_miss']:.0f}%"
        print(f"{line['path']:>5} {line['bytes']:>9} {line['layout']:>6} {line['us']:>9.1f} {se:>9} {loo:>9}"
              f"  {line['points']}/{line['terms']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"source": args.results, "lines": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
