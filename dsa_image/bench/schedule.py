"""The paired benchmark's workloads and their schedule: the server groups, the workloads, the
alternating order of A and B, each round's prompts, and the plan with its time estimate.

A round runs a fixed, seeded set of requests on one build and then the same set on the other;
the order flips every round so that a drift within a pair of rounds cancels.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from dsa_image.harness.prompts import model_prompt_ids

SIDES = ("A", "B")


@dataclass(frozen=True)
class Group:
    """One server configuration: a pair of servers (A and B) is started per group."""

    name: str
    model: str  # which model directory: "base", "long" or "mtp"
    max_model_len: int
    server_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Workload:
    name: str
    group: str
    input_len: int
    output_len: int
    concurrency: int
    requests: int  # per round and per side
    rounds: int


def _mtp(tokens: int) -> tuple[str, ...]:
    return ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": tokens}))


def speculative(server_args: list[str] | tuple[str, ...]) -> bool:
    """Whether servers started with these arguments decode speculatively (MTP)."""
    return any(a == "--speculative-config" or a.startswith("--speculative-config=") for a in server_args)


GROUPS = {
    "base": Group("base", "base", 8192),
    "long": Group("long", "long", 65536),
    "mtp1": Group("mtp1", "mtp", 8192, _mtp(1)),
    # MTP 2 is next_n=3, flattened on sm_90 by both bases; MTP 3 (next_n=4) is flattened by
    # 0.24.0 only: 0.33.0 decodes it natively.
    "mtp2": Group("mtp2", "mtp", 8192, _mtp(2)),
    "mtp3": Group("mtp3", "mtp", 8192, _mtp(3)),
}

# Rounds: at least 20 at concurrency 1 and 10 at 32 (the minimums); c=8 takes 10.
# Requests per round: two waves at c >= 8, so a round has a ramp-down as real load does.
WORKLOADS = (
    Workload("512x128-c1", "base", 512, 128, 1, 4, 20),
    Workload("512x128-c8", "base", 512, 128, 8, 16, 10),
    Workload("512x128-c32", "base", 512, 128, 32, 64, 10),
    Workload("6000x128-c8", "base", 6000, 128, 8, 16, 10),
    Workload("32000x128-c1", "long", 32000, 128, 1, 2, 20),
    Workload("mtp1-512x128-c1", "mtp1", 512, 128, 1, 4, 20),
    Workload("mtp1-512x128-c8", "mtp1", 512, 128, 8, 16, 10),
    Workload("mtp2-512x128-c1", "mtp2", 512, 128, 1, 4, 20),
    Workload("mtp2-512x128-c8", "mtp2", 512, 128, 8, 16, 10),
    Workload("mtp3-512x128-c1", "mtp3", 512, 128, 1, 4, 20),
    Workload("mtp3-512x128-c8", "mtp3", 512, 128, 8, 16, 10),
)

# The time model behind `plan`. Start-up times were measured on the H200 (two servers side by
# side, default flags, vLLM 0.24.0); the per-token costs are assumptions until a run prints its
# measured warm-up rounds, which replace them in the projection it prints. vLLM 0.33.0 with empty
# caches: three servers of the tiny GLM-5 side by side were healthy after 270-281 s, ~100 s of it
# FlashInfer's sampler JIT (docs/validation/h200-2026-11-30-vllm0_33_0-run2, section 3); a server
# with MTP took longer still (it reached that JIT only ~180 s after its start: that run's
# recipe-glm-5-fp8-8xb200.log), so an MTP group's cold start may need more than 280 s.
STARTUP_S = {"empty caches": 280.0, "warm caches": 66.0}
PREFILL_S_PER_TOKEN = 2.5e-5
DECODE_STEP_S = 5e-3


def round_order(index: int) -> tuple[str, str]:
    """A first on even rounds, B first on odd ones: each pair of rounds cancels a linear drift."""
    return ("A", "B") if index % 2 == 0 else ("B", "A")


def even_up(count: float) -> int:
    """At least 2, and even, so each build goes first equally often."""
    n = max(2, math.ceil(count))
    return n + (n % 2)


def round_prompts(workload: Workload, round_index: int, token_ids: list[int], seed: int) -> list[list[int]]:
    """The round's prompts, the same for A and B: new in every round, so that no request of a
    round finds its prompt in the prefix cache from an earlier round."""
    return [model_prompt_ids(token_ids, workload.input_len, f"{seed}:{workload.name}:{round_index}:{i}")
            for i in range(workload.requests)]


@dataclass
class Plan:
    workloads: list[Workload]
    groups: list[Group] = field(default_factory=list)

    @classmethod
    def select(cls, names: list[str] | None, rounds_scale: float = 1.0, requests_scale: float = 1.0) -> "Plan":
        chosen = [w for w in WORKLOADS if not names or w.name in names or w.group in names]
        unknown = set(names or ()) - {w.name for w in WORKLOADS} - set(GROUPS)
        if unknown:
            raise SystemExit(f"unknown workloads or groups: {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(w.name for w in WORKLOADS)}; groups: {', '.join(GROUPS)}")
        scaled = [Workload(w.name, w.group, w.input_len, w.output_len, w.concurrency,
                           max(w.concurrency, round(w.requests * requests_scale)),
                           even_up(w.rounds * rounds_scale)) for w in chosen]
        groups = [GROUPS[g] for g in dict.fromkeys(w.group for w in scaled)]
        return cls(scaled, groups)


def round_seconds(w: Workload) -> float:
    """The assumed time of one side's round (see DECODE_STEP_S)."""
    waves = math.ceil(w.requests / w.concurrency)
    step = DECODE_STEP_S * (1 + w.concurrency / 64)
    return w.requests * w.input_len * PREFILL_S_PER_TOKEN + waves * w.output_len * step


def estimate(plan: Plan, warm_caches: bool) -> dict:
    startup = STARTUP_S["warm caches" if warm_caches else "empty caches"]
    # Each workload: one unrecorded warm-up round per side, then its rounds, both sides.
    per_workload = {w.name: 2 * (w.rounds + 1) * round_seconds(w) for w in plan.workloads}
    return {"startup_s": startup, "workloads_s": per_workload,
            "total_s": startup + sum(per_workload.values())}


def describe(plan: Plan, est: dict) -> str:
    lines = [f"{'workload':<18} {'group':<5} {'in':>6} {'out':>4} {'c':>3} {'req/round':>9} {'rounds':>6} {'est s':>7}"]
    for w in plan.workloads:
        lines.append(f"{w.name:<18} {w.group:<5} {w.input_len:>6} {w.output_len:>4} {w.concurrency:>3} "
                     f"{w.requests:>9} {w.rounds:>6} {est['workloads_s'][w.name]:>7.0f}")
    lines.append(f"server start (all groups at once): {est['startup_s']:.0f} s; estimated total "
                 f"{est['total_s']:.0f} s ({est['total_s'] / 60:.1f} min). Per-token costs are assumed "
                 f"(prefill {PREFILL_S_PER_TOKEN:g} s/token, decode step {DECODE_STEP_S:g} s); the run "
                 "prints a projection from its measured warm-up rounds.")
    return "\n".join(lines)
