"""The paired benchmark's requests: one streamed completion timed to its first and last token
(over the harness client's event stream), a closed-loop round of them, and what a round's
samples give per side.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import statistics
import time
from dataclasses import dataclass

from dsa_image.bench.stats import quantile
from dsa_image.harness.client import Client, HttpError

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
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


def _completion_payload(model: str, prompt: list[int], max_tokens: int) -> dict:
    # Greedy and ignore_eos: every request produces exactly max_tokens on both builds.
    # continuous_usage_stats counts the tokens of each chunk (MTP sends several at once)
    # without return_token_ids, whose first chunk would echo a 32k-token prompt.
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def _read_stream(events, sample: Sample) -> None:
    """Fold (arrival, data) events into `sample`, to the stream's [DONE]."""
    for now, data in events:
        if data == "[DONE]":
            return
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
    sample = Sample(start=time.perf_counter(), end=0.0)
    try:
        stream = Client(f"http://{host}:{port}", timeout).open_stream(
            "/v1/completions", _completion_payload(model, prompt, max_tokens))
        with stream as (_, events):
            _read_stream(events, sample)
        if sample.tokens != max_tokens:
            raise RuntimeError(f"{sample.tokens} tokens, expected {max_tokens}")
    except (HttpError, OSError, ValueError, RuntimeError, http.client.HTTPException) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
    finally:
        sample.end = time.perf_counter()
    return sample


def run_round(port: int, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
              timeout: float = 600.0) -> list[Sample]:
    """Closed loop: `concurrency` clients, each taking the next prompt when its request ends."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: stream_completion(port, model, p, max_tokens, timeout), prompts))


def side_stats(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.error is None]
    stats: dict[str, float | None] = {"requests": len(samples), "errors": len(samples) - len(ok),
             "output_tokens": sum(s.tokens for s in ok)}
    if not ok:
        return stats
    wall = max(s.end for s in samples) - min(s.start for s in samples)
    ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
    tpots = [s.tpot for s in ok if s.tpot is not None]
    stats.update(wall_s=wall, output_tok_s=sum(s.tokens for s in ok) / wall if wall > 0 else None,
                 ttft_p50_s=quantile(ttfts, 0.50) if ttfts else None,
                 ttft_p99_s=quantile(ttfts, 0.99) if ttfts else None,
                 tpot_s=statistics.median(tpots) if tpots else None)
    return stats


def sample_record(sample: Sample) -> dict:
    return {"ttft_s": sample.ttft, "tpot_s": sample.tpot, "latency_s": sample.end - sample.start,
            "tokens": sample.tokens, "error": sample.error,
            "text_sha256": hashlib.sha256(sample.text.encode()).hexdigest()}
