"""vLLM's speculative-decoding counters on /metrics: read, settled, and turned into acceptance.

The warm-up (in the image), the benchmark and the GPU validation all tell whether and how well
MTP drafted by these counters. Stdlib only: the image's warm-up imports it.
"""

from __future__ import annotations

import http.client
import re
import time
from typing import Callable

from dsa_image.core.endpoint import Endpoint

# vllm/v1/spec_decode/metrics.py (vLLM 0.24.0): prometheus counters, exposed with `_total`.
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_counters(text: str) -> dict | None:
    """The spec-decode counters, summed over engines; None when the server has none."""
    names = {name: key for key, name in SPEC_COUNTERS.items()}
    totals = {key: 0.0 for key in SPEC_COUNTERS}
    per_position: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if not match:
            continue
        name, labels, value = match.group(1), match.group(3) or "", float(match.group(4))
        if name in names:
            totals[names[name]] += value
            found = True
        elif name == SPEC_PER_POSITION and (pos := _POSITION.search(labels)):
            per_position[int(pos.group(1))] = per_position.get(int(pos.group(1)), 0.0) + value
    if not found:
        return None
    return {**totals, "accepted_per_position": [per_position[p] for p in sorted(per_position)]}


def scrape_spec_counters(port: int, host: str = "127.0.0.1") -> dict | None:
    try:
        code, body = Endpoint(host=host, port=port).request("/metrics", timeout=30)
    except (OSError, http.client.HTTPException):
        return None
    return parse_spec_counters(body.decode(errors="replace")) if code == 200 else None


def settle(read: Callable[[], dict | None], pause_s: float, attempts: int) -> dict | None:
    """The counters `read` returns once two reads agree (None at once: a server without them):
    vLLM's API server records a step's statistics after it has sent that step's tokens, so a
    read right after the last response can miss them."""
    last = read()
    for _ in range(attempts if last is not None else 0):
        time.sleep(pause_s)
        now = read()
        if now == last:
            break
        last = now
    return last


def settled_spec_counters(port: int, pause_s: float = 0.5, attempts: int = 10) -> dict | None:
    return settle(lambda: scrape_spec_counters(port), pause_s, attempts)


def counter_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    positions = after["accepted_per_position"]
    earlier = before["accepted_per_position"] + [0.0] * len(positions)
    delta["accepted_per_position"] = [p - earlier[i] for i, p in enumerate(positions)]
    return delta


def acceptance(delta: dict | None) -> dict | None:
    """Acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted /
    drafts, the bonus token included), as vLLM's metrics documentation defines them."""
    if not delta or not delta.get("draft_tokens"):
        return None
    drafts = delta["drafts"] or float("nan")
    return {**delta, "acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"],
            "mean_acceptance_length": 1.0 + delta["accepted_tokens"] / drafts,
            "per_position_rate": [p / drafts for p in delta["accepted_per_position"]]}


def log_warmup_drafts(spec: dict | None, log: Callable[[str], None]) -> None:
    """The warm-up's line on what its requests drafted (spec: its counters' difference; None: a
    server without speculative decoding, nothing to say)."""
    if spec is None:
        return
    if spec["drafts"] > 0:
        log(f"dsa-image warmup: speculative decoding (MTP) ran in the warm-up: {spec['drafts']:.0f} drafts, "
            f"{spec['draft_tokens']:.0f} draft tokens, {spec['accepted_tokens']:.0f} accepted")
    else:  # recorded, not a failure: the server serves, its draft path just did not run here
        log("dsa-image warmup: WARNING: speculative decoding is configured (its counters are on /metrics) "
            "but the warm-up's requests made no drafts: the draft path was not warmed")
