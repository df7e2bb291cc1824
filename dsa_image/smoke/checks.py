"""The smoke checks, each a function returning a `Check` (pass/fail with the reason).

They catch what breaks in the field: a server that does not list its model, empty or NaN
output, nondeterministic greedy decoding, a stream without its end marker, an indexer that
never scores a prefill (prompts of at most index_topk tokens take the dense path), an
overlay that is not the code running, the wrong backends for the GPU.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dsa_image.smoke.expect import Expected, backend_problems
from dsa_image.harness.client import Client, HttpError
from dsa_image.smoke.layout import Layout, layout_problems
from dsa_image.build.tiny_model import CONFIG as TINY_CONFIG
from dsa_image.core import status

# Over index_topk, so the indexer scores the prefill; well inside max_model_len (8192).
LONG_PROMPT_TOKENS = 3000
assert LONG_PROMPT_TOKENS > TINY_CONFIG["index_topk"]
MAX_TOKENS = 16
SHORT_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name three colours."}]
# Text the long prompt is tokenized from (by the server: its tokenizer gives valid ids for any
# model) and repeated until it is LONG_PROMPT_TOKENS long.
LONG_PROMPT_SEED = (
    "Sparse attention reads only the keys the indexer selects; the indexer scores every key of "
    "a prefill longer than its top-k budget. "
)


@dataclass
class Check:
    name: str
    passed: bool
    reason: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "reason": self.reason,
                "seconds": round(self.seconds, 3), "details": self.details}


class CheckFailed(status.DsaImageError):
    """Raised inside a check: the message is the reason it failed."""


def run_check(name: str, body: Callable[[], tuple[str, dict]]) -> Check:
    """Run `body` (returns (reason, details) on success); any failure becomes a failed Check."""
    start = time.monotonic()
    try:
        reason, details = body()
        return Check(name, True, reason, time.monotonic() - start, details)
    except (CheckFailed, HttpError) as e:
        return Check(name, False, str(e), time.monotonic() - start)
    except Exception as e:  # a response of an unexpected shape: a failure, not a crash
        return Check(name, False, f"{type(e).__name__}: {e}", time.monotonic() - start)


def not_run(name: str, why: str) -> Check:
    return Check(name, False, f"not run: {why}")


# --- response inspection --------------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _first_choice(body: Any, what: str) -> dict:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices:
        raise CheckFailed(f"{what}: response has no choices: {json.dumps(body)[:300]}")
    return choices[0]


def completion_tokens(body: Any, what: str) -> tuple[str, list[int]]:
    """Text and token ids of a greedy completion; fails on empty text, NaN or missing logprobs,
    or fewer tokens than asked for (ignore_eos: a short answer means the server stopped early)."""
    choice = _first_choice(body, what)
    text = choice.get("text")
    if not isinstance(text, str) or text == "":
        raise CheckFailed(f"{what}: empty text (a tokenizer smaller than vocab_size decodes to '')")
    token_ids = choice.get("token_ids")
    if not isinstance(token_ids, list) or len(token_ids) != MAX_TOKENS:
        raise CheckFailed(f"{what}: expected {MAX_TOKENS} token ids (return_token_ids, ignore_eos), "
                          f"found {token_ids!r}")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(token_ids):
        raise CheckFailed(f"{what}: expected {len(token_ids)} token logprobs, found {logprobs!r}")
    bad = [i for i, lp in enumerate(logprobs) if not _finite(lp)]
    if bad:
        raise CheckFailed(f"{what}: logprobs not finite at positions {bad}: {[logprobs[i] for i in bad]} "
                          "(NaN reaches JSON as NaN or null)")
    return text, token_ids


def completion_request(model: str, prompt: str | list[int], stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,  # vLLM: always MAX_TOKENS tokens, whatever random weights say
        "return_token_ids": True,  # vLLM: the generated ids, to compare runs token for token
        "stream": stream,
    }


# --- the checks -----------------------------------------------------------------------------


def check_models(client: Client, served_name: str) -> Check:
    def body():
        r = client.get("/v1/models")
        ids = [m.get("id") for m in r.body.get("data", [])] if isinstance(r.body, dict) else []
        if served_name not in ids:
            raise CheckFailed(f"/v1/models lists {ids}, expected {served_name!r} among them")
        return f"lists {served_name!r}", {"models": ids, "latency_s": round(r.seconds, 3)}

    return run_check("models", body)


def long_prompt_ids(client: Client, served_name: str, length: int = LONG_PROMPT_TOKENS) -> list[int]:
    """`length` token ids of real text, tokenized by the server itself (valid for any model)."""
    r = client.post("/tokenize", {"model": served_name, "prompt": LONG_PROMPT_SEED, "add_special_tokens": False})
    tokens = r.body.get("tokens") if isinstance(r.body, dict) else None
    if not tokens or not all(isinstance(t, int) for t in tokens):
        raise CheckFailed(f"/tokenize gave no token ids: {json.dumps(r.body)[:300]}")
    limit = r.body.get("max_model_len")
    if isinstance(limit, int) and limit < length + MAX_TOKENS:
        raise CheckFailed(f"max_model_len {limit} cannot hold a {length}-token prompt; serve with a larger one")
    return (tokens * (length // len(tokens) + 1))[:length]


class Completions:
    """Greedy completions, kept so later checks compare against the first answers."""

    def __init__(self, client: Client, served_name: str):
        self.client = client
        self.served_name = served_name
        self.answers: dict[str, list[int]] = {}
        self.prompts: dict[str, str | list[int]] = {}

    def check(self, name: str, prompt: str | list[int], note: str) -> Check:
        def body():
            r = self.client.post("/v1/completions", completion_request(self.served_name, prompt))
            text, token_ids = completion_tokens(r.body, name)
            self.answers[name] = token_ids
            self.prompts[name] = prompt
            return note, {"text": text, "token_ids": token_ids, "latency_s": round(r.seconds, 3)}

        return run_check(name, body)

    def check_short(self) -> Check:
        return self.check("completion_short", SHORT_PROMPT, f"{MAX_TOKENS} tokens, finite logprobs")

    def check_long(self) -> Check:
        def body():
            ids = long_prompt_ids(self.client, self.served_name)
            inner = self.check("completion_long", ids,
                               f"{len(ids)}-token prompt (over index_topk: the indexer scores it), "
                               f"{MAX_TOKENS} tokens, finite logprobs")
            if not inner.passed:
                raise CheckFailed(inner.reason)
            return inner.reason, {**inner.details, "prompt_tokens": len(ids)}

        return run_check("completion_long", body)

    def check_repeat(self) -> Check:
        """Each earlier greedy request, sent again, gives the same tokens."""
        def body():
            if not self.answers:
                raise CheckFailed("no earlier completion passed: nothing to repeat")
            latencies = {}
            for name, first in self.answers.items():
                r = self.client.post("/v1/completions", completion_request(self.served_name, self.prompts[name]))
                _, again = completion_tokens(r.body, f"{name} (repeated)")
                latencies[name] = round(r.seconds, 3)
                if again != first:
                    raise CheckFailed(f"{name}: greedy tokens differ between two identical requests: "
                                      f"{first} then {again}")
            return f"same tokens twice for {', '.join(self.answers)}", {"latency_s": latencies}

        return run_check("deterministic", body)

    def check_stream(self) -> Check:
        """A streamed greedy completion ends with [DONE] and gives the non-streamed tokens."""
        def body():
            r = self.client.post_stream("/v1/completions", completion_request(self.served_name, SHORT_PROMPT, True))
            if not r.events or r.events[-1] != "[DONE]":
                last = r.events[-1][:200] if r.events else "no event at all"
                raise CheckFailed(f"stream did not end with 'data: [DONE]'; last event: {last}")
            text, token_ids = "", []
            for event in r.events[:-1]:
                chunk = json.loads(event)
                if "error" in chunk:
                    raise CheckFailed(f"stream carried an error: {event[:300]}")
                if not chunk.get("choices") and "usage" in chunk:
                    continue  # the usage chunk (--enable-force-include-usage) has no choices
                choice = _first_choice(chunk, "stream chunk")
                text += choice.get("text") or ""
                token_ids += choice.get("token_ids") or []
            if text == "":
                raise CheckFailed("streamed text is empty")
            if len(token_ids) != MAX_TOKENS:
                raise CheckFailed(f"stream gave {len(token_ids)} token ids, expected {MAX_TOKENS} (ignore_eos)")
            expected = self.answers.get("completion_short")
            if expected is not None and token_ids != expected:
                raise CheckFailed(f"streamed tokens {token_ids} differ from the non-streamed {expected}")
            return (f"{len(r.events) - 1} chunks then [DONE]", {"text": text, "token_ids": token_ids,
                                                                "latency_s": round(r.seconds, 3)})

        return run_check("stream", body)


def check_chat(client: Client, served_name: str) -> Check:
    def body():
        r = client.post("/v1/chat/completions", {
            "model": served_name, "messages": CHAT_MESSAGES, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "logprobs": True,
        })
        message = _first_choice(r.body, "chat").get("message") or {}
        content = message.get("content")
        if not isinstance(content, str) or content == "":
            raise CheckFailed(f"chat answered no content: {json.dumps(message)[:300]}")
        entries = ((_first_choice(r.body, "chat").get("logprobs") or {}).get("content")) or []
        bad = [e.get("logprob") for e in entries if not _finite(e.get("logprob"))]
        if bad:
            raise CheckFailed(f"chat logprobs not finite: {bad}")
        if len(entries) != MAX_TOKENS:
            raise CheckFailed(f"chat gave {len(entries)} token logprobs, expected {MAX_TOKENS} (ignore_eos)")
        return "answered", {"content": content, "latency_s": round(r.seconds, 3)}

    return run_check("chat", body)


def check_backends(log: str, expected: Expected, gpu_problem: str | None) -> Check:
    def body():
        problems = ([gpu_problem] if gpu_problem else []) + backend_problems(log, expected)
        if problems:
            raise CheckFailed("; ".join(problems))
        return (f"log names {expected.attention_backend}, {expected.indexer_backend}, "
                f"indexer kernels {expected.indexer_kernels}", expected.as_dict())

    return run_check("backends", body)


def check_parallel_layout(log: str, layout: Layout, gpus_used: dict | None) -> Check:
    """The server ran the layout asked for: every rank of its world size joined vLLM's world
    group, the TP/PP assignments logged (each node's first rank) and the workers' names fit the
    layout, Ray placed the workers when asked for (and not otherwise), and its processes hold
    that many GPUs (when nvidia-smi can tell)."""
    def body():
        problems = layout_problems(log, layout, gpus_used)
        if problems:
            raise CheckFailed("; ".join(problems))
        held = (gpus_used or {}).get("gpus")
        gpus = (f"its processes hold GPUs {', '.join(str(g['index']) for g in held)}" if held is not None
                else f"which GPUs it holds is unknown ({(gpus_used or {}).get('error', 'not read')})")
        return (f"{layout.describe()}: ranks 0-{layout.world_size - 1} logged; {gpus}",
                {**layout.as_dict(), "gpus_used": held})

    return run_check("parallel_layout", body)


def check_verify(run_verify: Callable[[], tuple[int, str]], command: str) -> Check:
    """The overlay tool's `verify` against the code the server runs: exit 0 or the failure."""
    def body():
        code, output = run_verify()
        tail = output.strip()[-1500:]
        if code != 0:
            raise CheckFailed(f"`{command}` exited {code}: {tail}")
        return f"`{command}` passed", {"output": tail}

    return run_check("overlay_verify", body)


def check_selftest(run_selftest: Callable[[], tuple[int, str]]) -> Check:
    """The image's indexer self-test on this GPU (dsa_image.runtime.selftest): its table goes in the report."""
    def body():
        code, output = run_selftest()
        lines = output.splitlines()
        table = "\n".join(line for line in lines if line.startswith("|"))
        doc = next((json.loads(line) for line in reversed(lines) if line.startswith("{")), None)
        if code != 0:
            raise CheckFailed(f"selftest exited {code}:\n{table or output.strip()[-1500:]}")
        return "the indexer kernels agree with the torch reference", {"table": table, "selftest": doc}

    return run_check("indexer_selftest", body)


def run_http_checks(client: Client, served_name: str) -> list[Check]:
    """The checks against a healthy server, in an order where later ones reuse earlier answers."""
    completions = Completions(client, served_name)
    return [
        check_models(client, served_name),
        completions.check_short(),
        completions.check_long(),
        completions.check_repeat(),
        completions.check_stream(),
        check_chat(client, served_name),
    ]


HTTP_CHECKS = ("models", "completion_short", "completion_long", "deterministic", "stream", "chat")
ALL_CHECKS = ("server_healthy",) + HTTP_CHECKS + ("overlay_verify", "indexer_selftest", "backends", "parallel_layout")
