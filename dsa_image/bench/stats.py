"""The paired benchmark's statistics: a round's ratios B/A per metric, and over a workload's
rounds the median of those ratios with a seeded percentile-bootstrap interval.

Ratios are B/A: above 1 means B is faster for output tokens/s and B is slower for TTFT and TPOT.
"""

from __future__ import annotations

import math
import random
import statistics

# name -> (label, +1 when higher is better / -1 when lower is better)
METRICS = {
    "output_tok_s": ("output tokens/s", +1),
    "ttft_p50_s": ("TTFT p50", -1),
    "ttft_p99_s": ("TTFT p99", -1),
    "tpot_s": ("TPOT (median)", -1),
}


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def bootstrap_median_ci(values: list[float], resamples: int = 10_000, confidence: float = 0.95,
                        seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the percentile bootstrap interval of the median, seeded."""
    if not values:
        raise ValueError("no values to bootstrap")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    return statistics.median(values), quantile(medians, tail), quantile(medians, 1.0 - tail)


def verdict(low: float, high: float, direction: int) -> str:
    """Where B stands against A, given the interval of B/A."""
    if low <= 1.0 <= high:
        return "within interval"
    b_higher = low > 1.0
    return "B ahead" if b_higher == (direction > 0) else "B behind"


def summarize(rounds: list[dict], resamples: int, confidence: float, seed: int) -> dict:
    """Per metric: the median of the per-round ratios B/A with its bootstrap interval."""
    valid = [r for r in rounds if r.get("ratios")]
    summary = {}
    for metric, (label, direction) in METRICS.items():
        ratios = [r["ratios"][metric] for r in valid if r["ratios"].get(metric) is not None]
        if not ratios:
            summary[metric] = {"label": label, "n": 0}
            continue
        median, low, high = bootstrap_median_ci(ratios, resamples, confidence, seed)
        summary[metric] = {"label": label, "n": len(ratios), "median_ratio": median,
                           "ci_low": low, "ci_high": high, "confidence": confidence,
                           "direction": "higher is better" if direction > 0 else "lower is better",
                           "verdict": verdict(low, high, direction)}
    return summary


def texts_compared(a: list[dict], b: list[dict]) -> dict:
    """How many of a round's prompts got the same text from A and B. Greedy, the same prompts:
    two builds that compute the same tokens answer alike, MTP drafts accepted or not."""
    pairs = [(x["text_sha256"], y["text_sha256"]) for x, y in zip(a, b, strict=False)
             if not x["error"] and not y["error"] and "text_sha256" in x and "text_sha256" in y]
    return {"compared": len(pairs), "equal": sum(x == y for x, y in pairs)}


def round_ratios(a: dict, b: dict) -> dict | None:
    """B/A per metric, or None when either side had an error (the round does not count)."""
    if a.get("errors") or b.get("errors"):
        return None
    return {m: (b[m] / a[m] if a.get(m) and b.get(m) is not None else None) for m in METRICS}
