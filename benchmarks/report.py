"""The result rows, the printed table and the JSON file."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Metric:
    """One line of the table.

    ``ratio`` is the number the target is checked against (project vs baseline, or a measured
    value vs its budget); ``met`` is None when the metric was not measured (``n/a``).
    """

    name: str
    group: str
    title: str
    project: float | None
    baseline: float | None
    unit: str
    ratio: float | None
    target: str
    met: bool | None
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def not_available(name: str, group: str, title: str, target: str, note: str) -> Metric:
    return Metric(name, group, title, None, None, "", None, target, None, note)


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if unit == "rows/s":
        return f"{v / 1e6:.2f}M rows/s" if v >= 1e5 else f"{v / 1e3:.1f}k rows/s"
    if unit == "s":
        return f"{v:.3f} s"
    if unit == "MB":
        return f"{v:.1f} MB"
    if unit == "bytes":
        return f"{v / 1024:.1f} KB"
    if unit == "rows":
        return f"{v:,.0f} rows"
    return f"{v:g} {unit}".strip()


def _fmt_ratio(r: float | None) -> str:
    if r is None or math.isnan(r):
        return "n/a"
    return f"{r:.2f}x" if r < 100 else f"{r:.0f}x"


def _fmt_met(m: bool | None) -> str:
    return "n/a" if m is None else ("yes" if m else "NO")


def table(metrics: list[Metric]) -> str:
    """A Markdown table (prints fine on a terminal and pastes into an issue)."""
    header = ["metric", "project", "baseline", "ratio", "target", "met"]
    rows = [
        [
            m.name,
            _fmt_value(m.project, m.unit),
            _fmt_value(m.baseline, m.unit),
            _fmt_ratio(m.ratio),
            m.target,
            _fmt_met(m.met),
        ]
        for m in metrics
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def notes(metrics: list[Metric]) -> str:
    return "\n".join(f"- {m.name}: {m.note}" for m in metrics if m.note)


def document(metrics: list[Metric], settings: dict[str, Any], seconds: float) -> dict[str, Any]:
    return {
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "settings": settings,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": _cpus(),
            "loadavg_at_end": list(os.getloadavg()),
        },
        "seconds": round(seconds, 1),
        "metrics": [_clean(asdict(m)) for m in metrics],
    }


def write_json(doc: dict[str, Any], directory: Path = RESULTS_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = directory / f"{stamp}.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def _cpus() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    )


def _clean(v: Any) -> Any:
    """NaN is not JSON: turn it into null, recursively."""
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v
