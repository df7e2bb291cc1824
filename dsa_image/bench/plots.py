"""The paired benchmark's plots: PNGs from results files, no GPU needed. The only module of
dsa_image.bench that needs matplotlib, imported only when plotting.
"""

from __future__ import annotations

from pathlib import Path

from dsa_image.bench.report import load_results
from dsa_image.bench.schedule import SIDES
from dsa_image.bench.stats import METRICS

def _title(doc: dict) -> str:
    env = doc["environment"]
    gpus = env.get("gpu", {}).get("gpus") or [{}]
    builds = env.get("builds", {})
    names = " vs ".join(f"{s}={builds.get(s, {}).get('name', s)}" for s in SIDES)
    # Two bases name both vLLMs: the plot of a base-vs-base run must not read as one base.
    versions = dict.fromkeys(builds.get(s, {}).get("versions", {}).get("vllm", "?") for s in SIDES)
    return f"{gpus[0].get('name', 'GPU ?')}, vLLM {' vs '.join(versions)}, {names}, {doc['created'][:10]}"


def plot(paths: list[str], out_dir: str | None = None) -> list[Path]:
    """PNGs from results files (no GPU needed): the ratios with intervals, and per workload the
    per-round ratios marked by which build went first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [load_results(p) for p in paths]
    target = Path(out_dir or Path(paths[0]).parent)
    target.mkdir(parents=True, exist_ok=True)
    written = [_plot_ratios(plt, docs, target / "ratios.png")]
    for doc in docs:
        written += [_plot_rounds(plt, doc, w, target / f"rounds-{w['name']}.png") for w in doc["workloads"]]
    if any(w.get("spec_decode") for d in docs for w in d["workloads"]):
        written.append(_plot_acceptance(plt, docs, target / "acceptance.png"))
    return written


def _plot_ratios(plt, docs: list[dict], path: Path) -> Path:
    workloads = [w for d in docs for w in d["workloads"]]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 1 + 0.5 * len(workloads)), sharey=True)
    for ax, (metric, (label, direction)) in zip(axes, METRICS.items(), strict=True):
        for y, w in enumerate(workloads):
            s = w["summary"].get(metric, {})
            if not s.get("n"):
                continue
            color = {"B behind": "tab:red", "B ahead": "tab:green"}.get(s["verdict"], "tab:blue")
            ax.errorbar(s["median_ratio"], y, xerr=[[s["median_ratio"] - s["ci_low"]], [s["ci_high"] - s["median_ratio"]]],
                        fmt="o", color=color, capsize=3)
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{label} B/A\n({'higher' if direction > 0 else 'lower'} is better for B)", fontsize=9)
        ax.set_yticks(range(len(workloads)), [w["name"] for w in workloads])
    axes[0].invert_yaxis()
    fig.suptitle(_title(docs[0]) + " - median of per-round ratios B/A, 95% bootstrap CI; "
                 "green: B ahead, red: B behind, blue: within the interval", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_rounds(plt, doc: dict, w: dict, path: Path) -> Path:
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.2))
    for ax, (metric, (label, _)) in zip(axes, METRICS.items(), strict=True):
        for first, marker, color in (("A", "o", "tab:blue"), ("B", "^", "tab:orange")):
            points = [(r["index"], r["ratios"][metric]) for r in w["rounds"]
                      if r["ratios"] and r["order"][0] == first and r["ratios"].get(metric) is not None]
            if points:
                ax.scatter(*zip(*points, strict=True), marker=marker, color=color, label=f"{first} first")
        s = w["summary"].get(metric, {})
        if s.get("n"):
            ax.axhline(s["median_ratio"], color="black", linewidth=1)
            ax.axhspan(s["ci_low"], s["ci_high"], color="grey", alpha=0.25)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{label} B/A", fontsize=9)
        ax.set_xlabel("round")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{w['name']} (in {w['input_len']}, out {w['output_len']}, c={w['concurrency']}, "
                 f"{w['requests']} req/round) - {_title(doc)}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_acceptance(plt, docs: list[dict], path: Path) -> Path:
    rows = [(w["name"], w["spec_decode"]) for d in docs for w in d["workloads"] if w.get("spec_decode")]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(rows)), 3.2))
    width = 0.38
    builds = docs[0]["environment"].get("builds", {})
    for k, side in enumerate(SIDES):
        rates = [(spec.get(side) or {}).get("acceptance_rate", float("nan")) for _, spec in rows]
        ax.bar([i + (k - 0.5) * width for i in range(len(rows))], rates, width,
               label=f"{side} ({builds.get(side, {}).get('name', side)})")
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], rotation=20, fontsize=7)
    ax.set_ylabel("draft acceptance rate")
    ax.legend(fontsize=7)
    ax.set_title(_title(docs[0]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
