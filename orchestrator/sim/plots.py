"""PNG plots of `swarm-sim` results with matplotlib (Agg: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

RTT_NOTE = "tau_c from an RTT matrix derived from RIPE Atlas anchors (not measured pairwise)"


def _finite(values) -> list[float]:
    return [v / 1000.0 if v is not None and math.isfinite(v) else math.nan for v in values]


def _save(figure, path: str | Path, note: str | None = None) -> None:
    if note:
        figure.text(0.01, 0.005, note, fontsize=7, color="gray")
    figure.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_fig3(result: dict, path: str | Path) -> None:
    figure, axes = plt.subplots(1, len(result["cases"]), figsize=(11, 4), squeeze=False)
    for axis, (case, rows) in zip(axes[0], result["cases"].items(), strict=True):
        data = [np.asarray(row["random_ms"]) / 1000.0 for row in rows]
        positions = range(1, len(rows) + 1)
        axis.boxplot(data, positions=list(positions), widths=0.5, showfliers=False)
        axis.plot(list(positions), _finite(row["gbp_cr_ms"] for row in rows), "r*", markersize=12, label="GBP-CR")
        axis.set_xticks(list(positions), [str(row["c"]) for row in rows])
        axis.set(title=f"{case} memory", xlabel="required capacity c", ylabel="c K(c) / lambda (s)")
        axis.legend()
    _save(figure, path, "boxes: random feasible placements (disjoint chains in random server order)")


def plot_fig4(result: dict, path: str | Path) -> None:
    rows = [row for row in result["rows"] if row["feasible"]]
    rates = [row["rate_per_s"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label, style in (("gbp_cr_disjoint", "GBP-CR chains, c each", "s--"), ("gca", "GCA", "o-"),
                              ("optimal_ilp", "optimal ILP (GCA chains)", "^:"), ("lower_bound", "lower bound", "v-.")):
        axis.plot(rates, [row[key] for row in rows], style, label=label)
    axis.set(xlabel="arrival rate lambda (jobs/s)", ylabel="job servers for rate lambda / rho_bar")
    axis.legend()
    _save(figure, path)


def plot_fig5(result: dict, path: str | Path) -> None:
    rows = result["rows"]
    loads = [row["load"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in rows[0]["policies"]:
        left.plot(loads, _finite(row["policies"][name]["response_ms"] for row in rows), "o-", label=name.upper())
    left.set(xlabel="load factor lambda / nu", ylabel="mean response time (s)", title="(a) load balancing")
    left.legend()
    if "jffc" in rows[0]["policies"]:
        right.plot(loads, _finite(row["policies"]["jffc"]["response_ms"] for row in rows), "o-", label="JFFC (sim)")
    right.plot(loads, _finite(row["lower_ms"] for row in rows), "v--", label="Thm 3.7 lower")
    right.plot(loads, _finite(row["upper_ms"] for row in rows), "^--", label="Thm 3.7 upper")
    right.set(xlabel="load factor lambda / nu", ylabel="mean response time (s)", title="(b) JFFC vs bounds")
    right.legend()
    _save(figure, path, RTT_NOTE)


def plot_fig6(result: dict, path: str | Path) -> None:
    rows = result["rows"]
    cs = [row["c"] for row in rows]
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, label, style in (("simulated_ms", "simulation (JFFC)", "o-"), ("surrogate_ms", "c K(c) / lambda", "s:"),
                              ("lower_ms", "Thm 3.7 lower", "v--"), ("upper_ms", "Thm 3.7 upper", "^--")):
        axis.plot(cs, _finite(row[key] for row in rows), style, label=label)
    axis.set(xlabel="required capacity c", ylabel="mean response time (s)", yscale="log")
    axis.legend()
    _save(figure, path, RTT_NOTE)


def plot_fig7(result: dict, path: str | Path) -> None:
    rows = result["rows"]
    rates = [row["rate_per_s"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    for key, label, style in (("simulated", "simulation", "o-"), ("lower", "Thm 3.7 lower", "v--"),
                              ("upper", "Thm 3.7 upper", "^--"), ("surrogate", "c K(c) (14)", "s:")):
        axis.plot(rates, [row[key]["mean"] for row in rows], style, label=label)
    axis.set(xlabel="arrival rate lambda (jobs/s)", ylabel="best c (mean over seeds)")
    axis.legend()
    _save(figure, path, RTT_NOTE)


def plot_fig8(result: dict, path: str | Path) -> None:
    etas = result["settings"]["etas"]
    servers = result["settings"]["servers"]
    figure, axes = plt.subplots(1, len(etas), figsize=(4 * len(etas), 4), sharey=True, squeeze=False)
    for axis, eta in zip(axes[0], etas, strict=True):
        cells = [c for c in result["cells"] if c["eta"] == eta]
        for name in result["settings"]["policies"]:
            stats = [c["policies"][name] for c in cells]
            values = [s["mean_response_ms"] if s["runs"] else math.nan for s in stats]
            if not all(math.isnan(v) for v in values):
                axis.plot(servers, _finite(values), "o-", label=name)
        axis.set(title=f"eta = {eta}", xlabel="servers J")
    axes[0][0].set_ylabel("mean response time (s)")
    axes[0][-1].legend()
    _save(figure, path, RTT_NOTE)


def plot_run(summaries: dict[str, dict], responses: dict[str, np.ndarray], path: str | Path) -> None:
    """Plots the response-time CDF of each policy of a `swarm-sim run`."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, values in responses.items():
        ordered = np.sort(values) / 1000.0
        axis.plot(ordered, np.arange(1, ordered.size + 1) / ordered.size, label=name)
    axis.set(xlabel="response time (s)", ylabel="CDF")
    axis.legend()
    _save(figure, path)
