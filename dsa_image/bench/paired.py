"""Paired serving benchmark: two vLLM builds (A, B) side by side on one GPU, in alternating rounds.

A shared GPU drifts by more than the differences worth finding (single runs swung +-15% on the
H200), so A and B are never compared across separate runs. Both servers run at once, each with
its own HOME (compile caches) and the same fixed KV-cache size, and take turns: a round runs a
fixed, seeded set of requests on one and then the same set on the other, and the order flips
every round so that a drift within a pair of rounds cancels. Each round gives one ratio B/A per
metric; the summary is the median of those ratios with a seeded percentile-bootstrap interval.

Ratios are B/A: above 1 means B is faster for output tokens/s and B is slower for TTFT and TPOT.
A workload of an MTP group also records each side's draft acceptance (vLLM's spec-decode counters
on /metrics) and fails when a side counted no drafts: it would not have measured MTP. Every
workload counts the prompts whose texts A and B answered alike (reported, not judged: two bases
may compute differently).

    python3 scripts/bench.py plan [--workloads ...]            # what would run, estimated time
    python3 scripts/bench.py run --a-site S --b-site O --model DIR --out DIR [...]
    python3 scripts/bench.py run --a-site S --b-site S --b-name NAME --b-env KEY=VALUE ...  # a setting
    python3 scripts/bench.py plot RESULTS.json [...] [--out DIR] # PNGs, no GPU needed
    python3 scripts/bench.py table RESULTS.json [...]           # markdown rows for a README
    python3 scripts/bench.py table --levels RESULTS.json [...]  # each build's medians, order effect

`run` needs only the standard library (it starts vLLM with another Python's site-packages);
`plot` needs matplotlib.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import hashlib
import http.client
import json
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsa_image.build import model_info_cache
from dsa_image.core.site_path import pythonpath
from dsa_image.runtime.spec_decode_metrics import (
    SPEC_COUNTERS,
    acceptance,
    counter_delta,
    scrape_spec_counters,
    settled_spec_counters,
)
from dsa_image.harness import server as serving
from dsa_image.harness.prompts import long_context_model, model_prompt_ids, prompt_token_ids
from dsa_image.harness.server import wait_each_healthy

SCHEMA = "dsa-image-bench/1"
SIDES = ("A", "B")

# name -> (label, +1 when higher is better / -1 when lower is better)
METRICS = {
    "output_tok_s": ("output tokens/s", +1),
    "ttft_p50_s": ("TTFT p50", -1),
    "ttft_p99_s": ("TTFT p99", -1),
    "tpot_s": ("TPOT (median)", -1),
}


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
# With --deadline-s: what stopping the servers and writing the results may take after it.
STOP_MARGIN_S = 60.0
PREFILL_S_PER_TOKEN = 2.5e-5
DECODE_STEP_S = 5e-3


# -- statistics ---------------------------------------------------------------------------------


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


# -- the schedule and the prompts ---------------------------------------------------------------


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


# -- one request, one round ---------------------------------------------------------------------


@dataclass
class Sample:
    """One streamed request, times in seconds from perf_counter."""

    start: float
    end: float
    tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    error: str | None = None
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.tokens < 2 or self.first_token is None:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


def _completion_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    # Greedy and ignore_eos: every request produces exactly max_tokens on both builds.
    # continuous_usage_stats counts the tokens of each chunk (MTP sends several at once)
    # without return_token_ids, whose first chunk would echo a 32k-token prompt.
    return json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }).encode()


def _read_stream(response, sample: Sample) -> None:
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        now = time.perf_counter()
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"error event: {event['error']}")
        sample.text += "".join(c.get("text") or "" for c in event.get("choices") or [])
        seen = _tokens_so_far(event, sample.tokens)
        if seen > sample.tokens:
            sample.first_token = sample.first_token or now
            sample.last_token = now
            sample.tokens = seen
    raise RuntimeError("the stream ended without data: [DONE]")


def _tokens_so_far(event: dict, before: int) -> int:
    usage = event.get("usage") or {}
    if "completion_tokens" in usage:
        return int(usage["completion_tokens"])
    # A server without continuous usage: the chunk's token ids where it has them, else one token
    # per choice chunk. Not "a chunk that carries text": a token may detokenize to nothing (a
    # lone byte of a byte-level tokenizer; see serving.answered) and still arrives as a chunk.
    choices = event.get("choices") or []
    return before + sum(len(c["token_ids"]) if c.get("token_ids") is not None else 1 for c in choices)


def stream_completion(port: int, model: str, prompt: list[int], max_tokens: int,
                      timeout: float = 600.0, host: str = "127.0.0.1") -> Sample:
    """POST a streaming completion; time the first and last token. Never raises: a failed
    request is a Sample with an error (a round with errors is left out of the statistics)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    sample = Sample(start=time.perf_counter(), end=0.0)
    try:
        connection.request("POST", "/v1/completions", _completion_body(model, prompt, max_tokens),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        _read_stream(response, sample)
        if sample.tokens != max_tokens:
            raise RuntimeError(f"{sample.tokens} tokens, expected {max_tokens}")
    except (OSError, ValueError, RuntimeError, http.client.HTTPException) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        sample.end = time.perf_counter()
        connection.close()
    return sample


def run_round(port: int, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
              timeout: float = 600.0) -> list[Sample]:
    """Closed loop: `concurrency` clients, each taking the next prompt when its request ends."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: stream_completion(port, model, p, max_tokens, timeout), prompts))


def side_stats(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.error is None]
    stats = {"requests": len(samples), "errors": len(samples) - len(ok),
             "output_tokens": sum(s.tokens for s in ok)}
    if not ok:
        return stats
    wall = max(s.end for s in samples) - min(s.start for s in samples)
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
    tpots = [s.tpot for s in ok if s.tpot is not None]
    stats.update(wall_s=wall, output_tok_s=stats["output_tokens"] / wall if wall > 0 else None,
                 ttft_p50_s=quantile(ttfts, 0.50) if ttfts else None,
                 ttft_p99_s=quantile(ttfts, 0.99) if ttfts else None,
                 tpot_s=statistics.median(tpots) if tpots else None)
    return stats


def sample_record(sample: Sample) -> dict:
    return {"ttft_s": sample.ttft, "tpot_s": sample.tpot, "latency_s": sample.end - sample.start,
            "tokens": sample.tokens, "error": sample.error,
            "text_sha256": hashlib.sha256(sample.text.encode()).hexdigest()}


def texts_compared(a: list[dict], b: list[dict]) -> dict:
    """How many of a round's prompts got the same text from A and B. Greedy, the same prompts:
    two builds that compute the same tokens answer alike, MTP drafts accepted or not."""
    pairs = [(x["text_sha256"], y["text_sha256"]) for x, y in zip(a, b)
             if not x["error"] and not y["error"] and "text_sha256" in x and "text_sha256" in y]
    return {"compared": len(pairs), "equal": sum(x == y for x, y in pairs)}


def round_ratios(a: dict, b: dict) -> dict | None:
    """B/A per metric, or None when either side had an error (the round does not count)."""
    if a.get("errors") or b.get("errors"):
        return None
    return {m: (b[m] / a[m] if a.get(m) and b.get(m) is not None else None) for m in METRICS}


# -- speculative decoding: vLLM's counters, summed over a workload's rounds -----------------------


def sum_deltas(deltas: list[dict | None]) -> dict | None:
    present = [d for d in deltas if d]
    if not present:
        return None
    total = {k: sum(d[k] for d in present) for k in SPEC_COUNTERS}
    width = max(len(d["accepted_per_position"]) for d in present)
    total["accepted_per_position"] = [sum(d["accepted_per_position"][i] for d in present
                                          if i < len(d["accepted_per_position"])) for i in range(width)]
    return total


# -- the plan -----------------------------------------------------------------------------------


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


# -- the environment ----------------------------------------------------------------------------

_VERSIONS_SNIPPET = ("import importlib.metadata as m, json, sys\n"
                     "out = {'python': sys.version.split()[0]}\n"
                     "for d in ('vllm', 'torch', 'triton', 'flashinfer-python', 'deep-gemm'):\n"
                     "    try: out[d] = m.version(d)\n"
                     "    except m.PackageNotFoundError: pass\n"
                     "print(json.dumps(out))")


def build_versions(python: str, site: str) -> dict:
    """Package versions as that build's server sees them (its site-packages first)."""
    env = dict(os.environ, PYTHONPATH=pythonpath(site))
    done = subprocess.run([python, "-c", _VERSIONS_SNIPPET], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tempfile.gettempdir())
    versions = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}
    receipt = Path(site) / "vllm_overlay_receipt.json"
    if receipt.is_file():
        versions["overlay_receipt_sha256"] = hashlib.sha256(receipt.read_bytes()).hexdigest()
    return versions


def gpu_info() -> dict:
    query = "name,driver_version,memory.total,compute_cap"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"nvidia-smi: {exc}"}
    rows = [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    return {"gpus": [dict(zip(query.split(","), row)) for row in rows]} if rows else {"error": done.stderr[-300:]}


# -- running ------------------------------------------------------------------------------------


@dataclass
class Build:
    side: str  # "A" or "B"
    name: str
    site: str
    python: str
    # Variables this build's servers get on top of the harness's own (--a-env, --b-env): one
    # build with a setting against the same build without it.
    env: dict[str, str] = field(default_factory=dict)


def _server_args(args, group: Group) -> list[str]:
    # A fixed KV-cache size: memory profiling would count the other server's allocations. The
    # low utilisation only passes vLLM's start-up check of free memory with two servers.
    return ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *group.server_args, *shlex.split(args.server_args)]


def _home(work_dir: Path, group: str, build: Build) -> Path:
    # Named for the build, not its side: a run comparing other builds on the same work
    # directory gets its own HOMEs, never another build's caches or model info.
    return work_dir / f"home-{group}-{build.name}"


def caches_present(homes: list[Path]) -> bool:
    """Every HOME holds compile caches: a file besides the model info the image ships."""
    def compiled(home: Path) -> bool:
        shipped = model_info_cache.shipped_dir(home)
        return home.is_dir() and any(p.is_file() and shipped not in p.parents for p in home.rglob("*"))

    return all(compiled(h) for h in homes)


def model_dirs(args, work_dir: Path, plan: Plan) -> dict[str, str]:
    dirs = {"base": args.model}
    kinds = {g.model for g in plan.groups}
    if "long" in kinds:
        longest = max(g.max_model_len for g in plan.groups if g.model == "long")
        dirs["long"] = str(long_context_model(Path(args.model), work_dir / "model-long", longest))
    if "mtp" in kinds:
        if not args.mtp_model:
            raise SystemExit("MTP workloads need --mtp-model DIR (the tiny GLM-5 with its MTP layer)")
        dirs["mtp"] = args.mtp_model
    return dirs


def image_homes(plan: Plan, builds: list[Build], work_dir: Path, dirs: dict[str, str], root: Path) -> None:
    """Each HOME without caches starts as the image's first `docker run` does: with the model info
    the image ships (serving.image_model_info), made once per build from the MTP model where a
    group serves it (its classes include the base model's), keyed by the build's name as the other
    harnesses key theirs (stock, overlay). A HOME with caches is kept as it is."""
    empty = [(home, build) for group in plan.groups for build in builds
             if not caches_present([home := _home(work_dir, group.name, build)])]
    if not empty:
        return
    entries = serving.require_image_model_info({b.name: (b.python or sys.executable, b.site) for b in builds},
                                               Path(dirs.get("mtp", dirs["base"])), root)
    for home, build in empty:
        model_info_cache.image_home(home, entries[build.name])


def start_servers(args, plan: Plan, builds: list[Build], work_dir: Path, out_dir: Path) -> list[dict]:
    dirs = model_dirs(args, work_dir, plan)
    image_homes(plan, builds, work_dir, dirs, serving.model_info_root(args, work_dir))
    servers = []
    for gi, group in enumerate(plan.groups):
        for si, build in enumerate(builds):
            home = _home(work_dir, group.name, build)
            server = serving.start_server(
                f"bench-{group.name}-{build.side}", build.site, dirs[group.model],
                args.port_base + 2 * gi + si, str(out_dir), _server_args(args, group),
                home=str(home), max_model_len=group.max_model_len, python=build.python, env_extra=build.env)
            servers.append({**server, "group": group.name, "side": build.side})
    return servers


def _run_side(server: dict, prompts, w: Workload, timeout: float) -> dict:
    before = scrape_spec_counters(server["port"])
    samples = run_round(server["port"], serving.SERVED_NAME, prompts, w.output_len, w.concurrency, timeout)
    # Settled only where there are counters (MTP): the wait is outside the timed requests.
    after = settled_spec_counters(server["port"]) if before is not None else None
    spec = counter_delta(before, after)
    return {"stats": side_stats(samples), "samples": [sample_record(s) for s in samples], "spec_decode": spec}


def run_one_round(pair: dict, w: Workload, index: int, token_ids: list[int], seed: int, timeout: float) -> dict:
    prompts = round_prompts(w, index, token_ids, seed)
    order = round_order(index)
    sides = {side: _run_side(pair[side], prompts, w, timeout) for side in order}
    return {"index": index, "order": list(order), "sides": sides,
            "ratios": round_ratios(sides["A"]["stats"], sides["B"]["stats"]),
            "texts": texts_compared(sides["A"]["samples"], sides["B"]["samples"])}


def run_workload(pair: dict, w: Workload, token_ids: list[int], args, deadline: float | None) -> dict:
    t0 = time.monotonic()
    # One unrecorded round per side first: the shapes of this workload compile here, not in
    # the first measured round.
    warmup = run_one_round(pair, w, -1, token_ids, args.seed, args.request_timeout)
    warm_round_s = (time.monotonic() - t0) / 2
    print(f"  {w.name}: warm-up round {warm_round_s:.1f} s per side; projected "
          f"{2 * w.rounds * warm_round_s:.0f} s for {w.rounds} rounds", flush=True)
    rounds, truncated = [], False
    for index in range(w.rounds):
        if index % 2 == 0 and deadline and time.monotonic() + 4 * warm_round_s * 1.2 > deadline:
            truncated = True  # whole pairs only: each build keeps going first equally often
            break
        rounds.append(run_one_round(pair, w, index, token_ids, args.seed, args.request_timeout))
    texts = workload_texts(rounds)
    print(f"  {w.name}: texts equal for {texts['equal']} of {texts['compared']} prompts", flush=True)
    return {**asdict(w), "rounds_planned": w.rounds, "rounds_done": len(rounds), "truncated": truncated,
            "warmup_errors": {s: warmup["sides"][s]["stats"]["errors"] for s in SIDES},
            "rounds": rounds, "seconds": round(time.monotonic() - t0, 1),
            "summary": summarize(rounds, args.resamples, args.confidence, args.seed),
            "spec_decode": workload_acceptance(rounds), "texts": texts}


def workload_texts(rounds: list[dict]) -> dict:
    counts = [r.get("texts") or {"compared": 0, "equal": 0} for r in rounds]
    return {k: sum(c[k] for c in counts) for k in ("compared", "equal")}


def workload_acceptance(rounds: list[dict]) -> dict | None:
    per_side = {s: acceptance(sum_deltas([r["sides"][s]["spec_decode"] for r in rounds])) for s in SIDES}
    return per_side if any(per_side.values()) else None


def missing_drafts(result: dict) -> str | None:
    """Why an MTP workload's rounds do not measure speculative decoding, or None when both sides
    drafted. An MTP server registers vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py,
    the same names in 0.24.0 and 0.33.0) and counts every draft; a side without counters, or with
    no draft tokens over the rounds, served without its draft path, and comparing it would pass
    for an MTP result."""
    if not result["rounds_done"]:
        return None
    spec = result.get("spec_decode") or {}
    problems = []
    for side in SIDES:
        if not (spec.get(side) or {}).get("draft_tokens"):
            deltas = [r["sides"][side]["spec_decode"] for r in result["rounds"]]
            problems.append(f"{side}: " + ("no spec-decode counters on /metrics" if not any(deltas)
                                           else "no draft tokens counted"))
    return "; ".join(problems) or None


def new_results(args, plan: Plan, builds: list[Build], argv: list[str]) -> dict:
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["scripts/bench.py", *argv]),
        "environment": {"gpu": gpu_info(), "platform": platform.platform(),
                        "builds": {b.side: {"name": b.name, "site": b.site, "python": b.python, "env": b.env,
                                            "versions": build_versions(b.python, b.site)} for b in builds}},
        "settings": {"seed": args.seed, "resamples": args.resamples, "confidence": args.confidence,
                     "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                     "gpu_memory_utilization": args.gpu_memory_utilization, "server_args": args.server_args,
                     "ratio": "B/A per round; output tokens/s: above 1 is B faster; times: above 1 is B slower",
                     "prompts": "token ids, new in every round, the same for A and B; greedy, ignore_eos"},
        "groups": {g.name: {**asdict(g), "server_args": _server_args(args, g)} for g in plan.groups},
        "workloads": [],
    }


def write_json(doc: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def run(args, argv: list[str]) -> int:
    plan = Plan.select(args.workloads, args.rounds_scale, args.requests_scale)
    out_dir, work_dir = Path(args.out), Path(args.work_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    builds = [Build("A", args.a_name, args.a_site, args.a_python, dict(args.a_env)),
              Build("B", args.b_name, args.b_site, args.b_python, dict(args.b_env))]
    homes = [_home(work_dir, g.name, b) for g in plan.groups for b in builds]
    if args.fresh_caches:
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    print(describe(plan, estimate(plan, caches_present(homes))), flush=True)
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    doc = new_results(args, plan, builds, argv)
    doc["caches_warm_at_start"] = caches_present(homes)
    path = out_dir / "results.json"
    servers = start_servers(args, plan, builds, work_dir, out_dir)
    try:
        run_groups(args, plan, servers, doc, path, deadline)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, then servers stop
        doc["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in servers:
            serving.stop(server)
    doc["jit_during_inference"] = {s["name"]: serving.jit_kernels_during_inference(s["log"]) for s in servers}
    write_json(doc, path)
    print(table([doc]))
    print(f"results: {path}")
    failed = "error" in doc or doc.get("group_errors") or any(w.get("failed") for w in doc["workloads"])
    return 1 if failed else 0


def run_groups(args, plan: Plan, servers: list[dict], doc: dict, path: Path, deadline: float | None) -> None:
    health_deadline = time.monotonic() + args.timeout
    if deadline:  # a call cut off by its time limit keeps nothing: leave time to stop and write
        health_deadline = min(health_deadline, deadline - STOP_MARGIN_S)
    doc["healthy_after_s"] = wait_each_healthy(servers, health_deadline)
    token_ids = prompt_token_ids(args.model)
    for group in plan.groups:
        pair = {s["side"]: s for s in servers if s["group"] == group.name}
        failed = {s["name"]: doc["healthy_after_s"][s["name"]] for s in pair.values()
                  if isinstance(doc["healthy_after_s"][s["name"]], str)}
        if failed:  # the other groups still run
            doc.setdefault("group_errors", {})[group.name] = failed
            continue
        for w in (w for w in plan.workloads if w.group == group.name):
            result = run_workload(pair, w, token_ids, args, deadline)
            if speculative(_server_args(args, group)) and (problem := missing_drafts(result)):
                result["spec_decode_problem"] = problem
                print(f"  {w.name}: not an MTP measurement: {problem}", flush=True)
            result["failed"] = bool(result["rounds_done"] > 0 and not any(r["ratios"] for r in result["rounds"])
                                    or result.get("spec_decode_problem"))
            doc["workloads"].append(result)
            write_json(doc, path)  # a run cut short still leaves every finished workload


# -- the results file ---------------------------------------------------------------------------

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
            def pair(metric: str, scale: float, digits: int) -> str:
                return " / ".join(_fmt(_side_median(w, side, metric), scale, digits) for side in SIDES)
            row = (f"| {w['name']} | {pair('output_tok_s', 1, 0)} | {pair('ttft_p50_s', 1e3, 1)} "
                   f"| {pair('tpot_s', 1e3, 2)} | {_fmt(_order_median(w, 'A'))} | {_fmt(_order_median(w, 'B'))} |")
            if texts:
                t = w.get("texts")
                row += f" {t['equal']} of {t['compared']} |" if t else " n/a |"
            lines.append(row)
    return "\n".join(lines)


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
    for ax, (metric, (label, direction)) in zip(axes, METRICS.items()):
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
    for ax, (metric, (label, _)) in zip(axes, METRICS.items()):
        for first, marker, color in (("A", "o", "tab:blue"), ("B", "^", "tab:orange")):
            points = [(r["index"], r["ratios"][metric]) for r in w["rounds"]
                      if r["ratios"] and r["order"][0] == first and r["ratios"].get(metric) is not None]
            if points:
                ax.scatter(*zip(*points), marker=marker, color=color, label=f"{first} first")
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


# -- command line -------------------------------------------------------------------------------


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", nargs="*", metavar="NAME",
                        help=f"workloads or groups ({', '.join(GROUPS)}); default all: "
                             + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--rounds-scale", type=float, default=1.0,
                        help="multiply each workload's rounds (rounded up to an even number, at least 2)")
    parser.add_argument("--requests-scale", type=float, default=1.0,
                        help="multiply each workload's requests per round (at least its concurrency)")


def env_assignment(text: str) -> tuple[str, str]:
    """KEY=VALUE, as --a-env / --b-env take it."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY an environment variable name, got {text!r}")
    return key, value


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a-site", required=True, help="site-packages of build A (e.g. stock vLLM)")
    parser.add_argument("--b-site", required=True, help="site-packages of build B (e.g. with the overlay)")
    parser.add_argument("--a-name", default="stock")
    parser.add_argument("--b-name", default="overlay")
    parser.add_argument("--a-python", default=sys.executable, help="the Python that serves A")
    parser.add_argument("--b-python", default=sys.executable, help="the Python that serves B")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-env", action="append", type=env_assignment, default=[], metavar="KEY=VALUE",
                            help=f"an environment variable for build {side.upper()}'s servers (repeatable), "
                                 "e.g. one build with a vLLM setting against itself without it")
    parser.add_argument("--model", required=True, help="the tiny GLM-5 directory (scripts/make_tiny_model.py)")
    parser.add_argument("--mtp-model", help="the tiny GLM-5 with its MTP layer, for the mtp groups")
    parser.add_argument("--out", required=True, help="results.json and the server logs go here")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "dsa-bench"),
                        help="the servers' HOMEs (compile caches, kept between runs) and derived models")
    parser.add_argument("--fresh-caches", action="store_true", help="empty the servers' HOMEs first")
    serving.add_model_info_root(parser)
    parser.add_argument("--port-base", type=int, default=8200)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--server-args", default="", help="more vllm serve arguments for every server, one string")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for all servers to become healthy")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--deadline-s", type=float,
                        help="stop starting round pairs when the next pair would end past this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--confidence", type=float, default=0.95)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="serve A and B side by side and run the paired rounds")
    _add_selection(run_parser)
    _add_run(run_parser)
    _add_selection(commands.add_parser("plan", help="print the workloads, rounds and an estimated time"))
    plot_parser = commands.add_parser("plot", help="PNG plots from results files (matplotlib, no GPU)")
    plot_parser.add_argument("results", nargs="+")
    plot_parser.add_argument("--out", help="directory for the PNGs (default: beside the first file)")
    table_parser = commands.add_parser("table", help="markdown table of the ratios")
    table_parser.add_argument("results", nargs="+")
    table_parser.add_argument("--levels", action="store_true",
                              help="each build's medians and the ratio by which build went first, "
                                   "instead of the ratios with their intervals")
    args = parser.parse_args(argv)
    if args.command == "run" and args.a_name == args.b_name:
        # The names label the results and key each build's model info (shared with other harnesses).
        run_parser.error(f"--a-name and --b-name must differ; both are {args.a_name!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "plan":
        plan = Plan.select(args.workloads, args.rounds_scale, args.requests_scale)
        print(describe(plan, estimate(plan, warm_caches=False)))
        return 0
    if args.command == "run":
        return run(args, argv)
    docs = [load_results(p) for p in args.results]
    if args.command == "table":
        print(levels_table(docs) if args.levels else table(docs))
        return 0
    for path in plot(args.results, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
