"""The paired benchmark's results file (results.json: its schema, read back checked) and the
markdown tables `scripts/bench.py table` prints from it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dsa_image.bench.schedule import SIDES
from dsa_image.bench.stats import METRICS

SCHEMA = "dsa-image-bench/1"
_REQUIRED = {"schema": str, "created": str, "command": str, "environment": dict, "settings": dict,
             "groups": dict, "workloads": list}
_WORKLOAD_REQUIRED = {"name": str, "group": str, "input_len": int, "output_len": int, "concurrency": int,
                      "requests": int, "rounds_planned": int, "rounds_done": int, "rounds": list, "summary": dict}


def schema_problems(doc: dict) -> list[str]:
    """How a results document breaks the schema `plot` and `table` rely on (empty: fine)."""
    problems = [f"{k}: missing or not {t.__name__}" for k, t in _REQUIRED.items() if not isinstance(doc.get(k), t)]
    if doc.get("schema") not in (None, SCHEMA) and isinstance(doc.get("schema"), str):
        problems.append(f"schema: {doc['schema']!r}, expected {SCHEMA!r}")
    for i, w in enumerate(doc.get("workloads") or []):
        problems += [f"workloads[{i}].{k}: missing or not {t.__name__}"
                     for k, t in _WORKLOAD_REQUIRED.items() if not isinstance(w.get(k), t)]
        problems += _round_problems(i, w.get("rounds") or [])
        if isinstance(w.get("rounds"), list) and w.get("rounds_done") != len(w["rounds"]):
            problems.append(f"workloads[{i}]: rounds_done {w.get('rounds_done')} != {len(w['rounds'])} rounds")
    return problems


def _round_problems(i: int, rounds: list) -> list[str]:
    problems = []
    for j, r in enumerate(rounds):
        where = f"workloads[{i}].rounds[{j}]"
        if sorted(r.get("order") or []) != list(SIDES):
            problems.append(f"{where}.order: {r.get('order')!r}")
        if set(r.get("sides") or {}) != set(SIDES):
            problems.append(f"{where}.sides: needs A and B")
        if r.get("ratios") is not None and set(r["ratios"]) != set(METRICS):
            problems.append(f"{where}.ratios: keys {sorted(r['ratios'])}")
    return problems


def load_results(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    problems = schema_problems(doc)
    if problems:
        raise ValueError(f"{path}: not a benchmark results file: " + "; ".join(problems[:5]))
    return doc


# -- reporting ----------------------------------------------------------------------------------


def _cell(summary: dict) -> str:
    if not summary.get("n"):
        return "n/a"
    return f"{summary['median_ratio']:.3f} [{summary['ci_low']:.3f}, {summary['ci_high']:.3f}]"


def table(docs: list[dict]) -> str:
    """Markdown: one row per workload, each metric's median B/A and its interval."""
    header = "| workload | rounds | " + " | ".join(f"{label} B/A [95% CI]" for label, _ in METRICS.values()) + " |"
    lines = [header, "|" + "---|" * (2 + len(METRICS))]
    for doc in docs:
        for w in doc["workloads"]:
            cells = " | ".join(_cell(w["summary"].get(m, {})) for m in METRICS)
            lines.append(f"| {w['name']} | {w['rounds_done']} | {cells} |")
    return "\n".join(lines)


def _side_median(w: dict, side: str, metric: str) -> float | None:
    values = [r["sides"][side]["stats"].get(metric) for r in w["rounds"] if r["ratios"]]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _order_median(w: dict, first: str) -> float | None:
    values = [r["ratios"]["output_tok_s"] for r in w["rounds"]
              if r["ratios"] and r["order"][0] == first and r["ratios"].get("output_tok_s") is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def levels_table(docs: list[dict]) -> str:
    """Markdown: what each build measured (medians over the counted rounds), and the output
    tokens/s ratio split by which build went first. The split shows the order effect that
    alternating cancels: a ratio that moves with the order is the GPU, not the build."""
    # Results from before the texts were compared have no "texts": no column then.
    texts = any("texts" in w for doc in docs for w in doc["workloads"])
    lines = ["| workload | output tokens/s A / B | TTFT p50 ms A / B | TPOT ms A / B "
             "| tokens/s B/A, A first | tokens/s B/A, B first |" + (" texts equal |" if texts else ""),
             "|" + "---|" * (6 + texts)]
    for doc in docs:
        for w in doc["workloads"]:
            def pair(metric: str, scale: float, digits: int, w: dict = w) -> str:
                return " / ".join(_fmt(_side_median(w, side, metric), scale, digits) for side in SIDES)
            row = (f"| {w['name']} | {pair('output_tok_s', 1, 0)} | {pair('ttft_p50_s', 1e3, 1)} "
                   f"| {pair('tpot_s', 1e3, 2)} | {_fmt(_order_median(w, 'A'))} | {_fmt(_order_median(w, 'B'))} |")
            if texts:
                t = w.get("texts")
                row += f" {t['equal']} of {t['compared']} |" if t else " n/a |"
            lines.append(row)
    return "\n".join(lines)
