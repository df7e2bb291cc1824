"""The tests' one fake vLLM: an OpenAI-compatible server, good or broken on demand, that records
what it was asked.

It answers /health, /v1/models, /metrics, /tokenize, /v1/completions (plain, batched and
SSE-streamed) and /v1/chat/completions as vLLM does, as far as the harnesses read them; faults,
delays, a refusing queue and per-path scripted answers make it misbehave. It runs on a thread of
the test (FakeServer, port 0 by default) or as a process of its own: `python fake_vllm.py serve
MODEL --port N`, with FakeVllm's keywords as JSON in FAKE_VLLM_OPTIONS (main()); the fake `vllm`
packages of the tests import it and call main().

Stdlib only: tests/test_smoke_docker.py copies it into a bare container.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = {
    "empty_text",           # tokens that detokenize to "" (lone bytes of a byte-level tokenizer)
    "other_text",           # the same tokens, another text: a detokenizer that differs
    "nan_logprob",          # one token logprob is NaN
    "null_logprob",         # one token logprob is null (what pydantic writes for NaN)
    "nondeterministic",     # each request gives other tokens
    "salt",                 # other tokens than an unsalted fake's: a build that computes differently
    "short",                # one token less than max_tokens
    "no_tokens",            # nothing generated
    "no_done",              # the stream ends without data: [DONE]
    "no_usage",             # the stream has no usage, whatever stream_options ask
    "usage_chunk",          # not a fault: the stream ends with a usage-only chunk before [DONE]
    "stream_other_tokens",  # the stream gives other tokens than the plain request
    "chat_empty",           # chat answers no content
    "wrong_model",          # /v1/models lists another name
    "no_tokenize",          # /tokenize answers 404
    "http_500",             # /v1/completions answers 500
}

# vLLM 0.33.0's answer to a full queue (create_error_response of a GracefulHTTPError).
BUSY = {"error": {"message": "The engine is currently busy and cannot accept new requests. Please try again "
                             "later or on a different instance.",
                  "type": "Service Unavailable", "param": None, "code": 503}}


def fake_tokens(prompt, count: int, salt: int = 0) -> list[int]:
    """Deterministic ids of a prompt (and a salt), within a 1024-token vocabulary."""
    digest = hashlib.sha256(json.dumps([prompt, salt]).encode()).digest()
    return [8 + (digest[i % len(digest)] * 7 + i) % 1016 for i in range(count)]


class FakeVllm:
    """What one fake server answers, and what it was asked.

    requests: every request, as (path, JSON body; {} for a GET); completions: the bodies of the
    completions it accepted (not those `busy` refused).

    spec: True: vLLM's spec-decode counters on /metrics, counting drafts; "idle": the counters
    without drafts (a server whose draft path does not run).
    busy: the first `busy` completions are refused with vLLM's HTTP 503 for a full queue.
    enforce_max_model_len: as vLLM, a prompt longer than max_model_len is an HTTP 400 and
    max_tokens is cut to what max_model_len leaves.
    unhealthy_polls: /health answers 503 that many times first; then health_status (settable).
    answers: path -> {"status", "body" (raw text), "delay_s", "trickle_s"}: "status" or "body"
    replace the path's answer; "delay_s" delays it, "trickle_s" sends it a byte at a time.
    """

    def __init__(self, served_name: str = "glm-5", faults=frozenset(), max_model_len: int = 8192, *,
                 ttft_s: float = 0.0, token_s: float = 0.0, spec=False, busy: int = 0,
                 enforce_max_model_len: bool = False, unhealthy_polls: int = 0, health_status: int = 200,
                 jit_line_on_first: bool = False, answers: dict | None = None):
        unknown = set(faults) - FAULTS
        assert not unknown, f"unknown faults {unknown}"
        self.served_name, self.faults, self.max_model_len = served_name, set(faults), max_model_len
        self.ttft_s, self.token_s, self.spec, self.busy = ttft_s, token_s, spec, busy
        self.enforce_max_model_len = enforce_max_model_len
        self.unhealthy_polls, self.health_status = unhealthy_polls, health_status
        self.jit_line_on_first = jit_line_on_first
        self.answers = answers or {}
        self.requests: list[tuple[str, dict]] = []
        self.completions: list[dict] = []
        self.refused = self.active = self.max_active = 0
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos0": 0, "pos1": 0}
        self.lock = threading.Lock()
        self._calls = 0

    # -- what it generates --------------------------------------------------------------------

    def _salt(self, stream: bool) -> int:
        with self.lock:
            self._calls += 1
            salt = self._calls if "nondeterministic" in self.faults else 0
        return salt + ("salt" in self.faults) + (1000 if stream and "stream_other_tokens" in self.faults else 0)

    def tokens(self, prompt, max_tokens: int, stream: bool = False) -> list[int]:
        salt = self._salt(stream)
        if "no_tokens" in self.faults:
            return []
        if self.enforce_max_model_len:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        return fake_tokens(prompt, max_tokens - ("short" in self.faults), salt)

    def text(self, ids: list[int]) -> str:
        if "empty_text" in self.faults:
            return ""
        return "".join(f" {'v' if 'other_text' in self.faults else 'w'}{t}" for t in ids)

    def chosen_logprobs(self, ids: list[int]) -> list:
        logprobs: list = [-1.0 - (t % 7) / 10 for t in ids]
        if "nan_logprob" in self.faults:
            logprobs[3] = float("nan")
        if "null_logprob" in self.faults:
            logprobs[3] = None
        return logprobs

    def logprobs(self, ids: list[int], body: dict) -> dict | None:
        """vLLM's completion logprobs: the chosen tokens' and, per position, the `logprobs` most
        likely tokens (keyed "token_id:N" with return_tokens_as_token_ids)."""
        if body.get("logprobs") is None:
            return None

        def key(t):
            return f"token_id:{t}" if body.get("return_tokens_as_token_ids") else f" w{t}"
        chosen = self.chosen_logprobs(ids)
        top = [{key(t + r): (lp if lp is not None else -1.0) - r for r in range(body["logprobs"])}
               for t, lp in zip(ids, chosen, strict=True)]
        return {"token_logprobs": chosen, "top_logprobs": top, "tokens": [f"w{t}" for t in ids]}

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.served_name}"'
        lines = [f"vllm:num_requests_running{{{labels}}} 0.0"]
        if self.spec:
            c = self.counters
            lines += [f"vllm:spec_decode_num_drafts_total{{{labels}}} {c['drafts']}.0",
                      f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7e9",
                      f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {c['draft_tokens']}.0",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {c['accepted']}.0",
                      f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} {c["pos0"]}.0',
                      f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} {c["pos1"]}.0']
        return "\n".join(["# HELP fake", *lines]) + "\n"

    # -- its bookkeeping ----------------------------------------------------------------------

    def healthy(self) -> int:
        with self.lock:
            self.unhealthy_polls -= 1
            return self.health_status if self.unhealthy_polls < 0 else 503

    def refuse(self) -> bool:
        with self.lock:
            refused = self.refused < self.busy
            self.refused += refused
            return refused

    def begin(self, body: dict) -> None:
        with self.lock:
            self.completions.append(body)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            first = len(self.completions) == 1
        if first and self.jit_line_on_first:
            print("WARNING [jit_monitor.py:99] Triton kernel JIT compilation during inference: "
                  "fake_kernel (key=1).", flush=True)

    def end(self, tokens: int) -> None:
        with self.lock:
            self.active -= 1
            if self.spec is True:  # "idle": the counters are there, no drafts are made
                self.counters["drafts"] += tokens // 2
                self.counters["draft_tokens"] += tokens
                self.counters["accepted"] += tokens // 4
                self.counters["pos0"] += tokens // 4 - tokens // 8
                self.counters["pos1"] += tokens // 8


def _prompts(body: dict) -> list:
    prompt = body["prompt"]
    return prompt if prompt and isinstance(prompt[0], list) else [prompt]


def make_handler(state: FakeVllm):
    """The request handler of `state`, for FakeServer or a server of the test's own (a Unix socket)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status: int, payload, content_type="application/json"):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            trickle = state.answers.get(self.path, {}).get("trickle_s", 0)
            # Trickling, byte by byte: every read of the client gets something in time.
            for chunk in ([data[i:i + 1] for i in range(len(data))] if trickle else [data]):
                time.sleep(trickle)
                self.wfile.write(chunk)
                self.wfile.flush()

        def _scripted(self) -> bool:
            """Delays the answer, or answers what the test scripted for this path; True if answered."""
            how = state.answers.get(self.path, {})
            time.sleep(how.get("delay_s", 0))
            if "status" not in how and "body" not in how:
                return False
            self._send(how.get("status", 200), how.get("body", "").encode(), "text/plain")
            return True

        def do_GET(self):
            state.requests.append((self.path, {}))
            if self._scripted():
                return
            if self.path == "/health":
                return self._send(state.healthy(), b"", "text/plain")
            if self.path == "/v1/models":
                name = "other-model" if "wrong_model" in state.faults else state.served_name
                return self._send(200, {"object": "list", "data": [
                    {"id": name, "object": "model", "max_model_len": state.max_model_len}]})
            if self.path == "/metrics":
                return self._send(200, state.metrics().encode(), "text/plain")
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            state.requests.append((self.path, body))
            if self._scripted():
                return
            if body.get("model") not in (None, state.served_name):
                return self._send(404, {"error": f"model {body.get('model')} does not exist"})
            if self.path == "/tokenize":
                return self._tokenize(body)
            if self.path == "/v1/completions":
                return self._completions(body)
            if self.path == "/v1/chat/completions":
                return self._chat(body)
            self._send(404, {"error": "not found"})

        def _tokenize(self, body: dict):
            if "no_tokenize" in state.faults:
                return self._send(404, {"error": "not found"})
            tokens = [8 + b for b in body["prompt"].encode()]
            self._send(200, {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens})

        def _completions(self, body: dict):
            if state.refuse():
                return self._send(503, BUSY)
            state.begin(body)
            self.ended = False
            try:
                if "http_500" in state.faults:
                    return self._send(500, {"error": "EngineCore died"})
                self._stream(body) if body.get("stream") else self._complete(body)
            finally:
                self._end(0)

        def _end(self, produced: int) -> None:
            """The request leaves the count of those in flight before its last bytes are sent: a
            client that reads them starts its next request at once, and counted afterwards, two
            requests of one client overlapped (max_active 6 at concurrency 4 on a loaded host)."""
            if not self.ended:
                self.ended = True
                state.end(produced)

        def _complete(self, body: dict):
            prompts = _prompts(body)
            if state.enforce_max_model_len and max(map(len, prompts)) > state.max_model_len:
                return self._send(400, {"error": {"message": f"maximum context length is {state.max_model_len}"}})
            outs = [state.tokens(p, body.get("max_tokens", 16)) for p in prompts]
            time.sleep(state.ttft_s + state.token_s * body.get("max_tokens", 16))
            choices = [{"index": i, "text": state.text(ids), "finish_reason": "length",
                        "token_ids": ids if body.get("return_token_ids") else None,
                        "logprobs": state.logprobs(ids, body)}
                       for i, ids in enumerate(outs)]
            produced = sum(len(ids) for ids in outs)
            self._end(produced)
            self._send(200, {"object": "text_completion",
                             "choices": choices[::-1],  # the server's order is not the prompts'
                             "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": produced}})

        def _sse(self, event) -> None:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

        def _stream(self, body: dict):
            ids = state.tokens(body["prompt"], body.get("max_tokens", 16), stream=True)
            # As vLLM: usage only when stream_options ask for it (the bench's client does).
            options = {} if "no_usage" in state.faults else body.get("stream_options") or {}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            time.sleep(state.ttft_s)
            for n, token in enumerate(ids, 1):
                choice = {"index": 0, "text": state.text([token])}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [token]
                self._sse({"choices": [choice], **({"usage": {"completion_tokens": n}}
                                                   if options.get("continuous_usage_stats") else {})})
                self.wfile.flush()
                time.sleep(state.token_s)
            self._end(len(ids))
            if options.get("include_usage") or "usage_chunk" in state.faults:
                self._sse({"choices": [], "usage": {"completion_tokens": len(ids)}})
            if "no_done" not in state.faults:
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

        def _chat(self, body: dict):
            ids = state.tokens(body.get("messages"), body.get("max_tokens", 16))
            content = "" if "chat_empty" in state.faults else state.text(ids) or "x"
            logprobs = {"content": [{"token": f"w{t}", "logprob": lp}
                                    for t, lp in zip(ids, state.chosen_logprobs(ids), strict=True)]}
            self._send(200, {"object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": content, "tool_calls": []},
                "finish_reason": "length", "logprobs": logprobs if body.get("logprobs") else None}]})

    return Handler


class _Httpd(ThreadingHTTPServer):
    request_queue_size = 256  # 32 clients connect at once; the default backlog of 5 resets some
    daemon_threads = True


class FakeServer:
    """The fake on 127.0.0.1:`port` (0: a free one); a context manager serves it on a thread."""

    def __init__(self, state: FakeVllm, port: int = 0):
        self.state = state
        self.httpd = _Httpd(("127.0.0.1", port), make_handler(state))
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def served_name(argv: list[str]) -> str:
    """--served-model-name, else the model argument, as vLLM names what it serves."""
    positional = [a for a in argv if not a.startswith("-")]
    model = positional[positional.index("serve") + 1] if "serve" in positional else positional[0]
    return flag(argv, "--served-model-name") or model


def main(argv: list[str] | None = None) -> None:
    """`serve MODEL --port N ...` (vLLM's arguments, the rest ignored): the fake in this process,
    with FakeVllm's keywords as JSON in FAKE_VLLM_OPTIONS, until it is killed."""
    argv = sys.argv[1:] if argv is None else argv
    options = json.loads(os.environ.get("FAKE_VLLM_OPTIONS", "{}"))
    state = FakeVllm(**{"served_name": served_name(argv), **options})
    FakeServer(state, int(flag(argv, "--port") or 0)).httpd.serve_forever()


if __name__ == "__main__":
    main()
