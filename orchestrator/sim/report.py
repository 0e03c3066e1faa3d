"""Tables for the terminal and JSON for files: the shapes every `swarm-sim` command prints and writes."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

SUMMARY_HEADERS = (
    "policy", "runs", "resp mean s", "median", "P95", "P99", "wait mean s", "wait P95", "service mean s", "note",
)


def seconds(value_ms: float) -> str:
    """Gives a time in ms as seconds with 2 decimals, or '-' when it is not finite."""
    return "-" if value_ms is None or not math.isfinite(value_ms) else f"{value_ms / 1000.0:.2f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Gives a Markdown table with columns padded to their widest cell."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def summary_row(name: str, summary: Mapping | None, note: str = "") -> list[object]:
    """Gives one row of SUMMARY_HEADERS from a pooled or single-run summary (None: the policy could not run)."""
    if summary is None:
        return [name, 0, "-", "-", "-", "-", "-", "-", "-", note]
    response, waiting, service = summary["response_ms"], summary["waiting_ms"], summary["service_ms"]
    return [
        name,
        summary.get("runs", 1),
        seconds(response["mean"]),
        seconds(response["median"]),
        seconds(response["p95"]),
        seconds(response["p99"]),
        seconds(waiting["mean"]),
        seconds(waiting["p95"]),
        seconds(service["mean"]),
        note,
    ]


def jsonable(value: object) -> object:
    """Gives `value` with numpy scalars/arrays as plain numbers/lists and non-finite floats as None."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [jsonable(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str | Path, payload: Mapping) -> None:
    """Writes `payload` as indented JSON with sorted keys (same input, same bytes)."""
    Path(path).write_text(json.dumps(jsonable(payload), indent=2, sort_keys=True) + "\n")
