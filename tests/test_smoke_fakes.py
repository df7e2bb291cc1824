"""A fake OpenAI-compatible vLLM server for the smoke tests, good or broken on demand, and a
fake `vllm` package whose `python -m vllm.entrypoints.cli.main serve` starts it as a real
process (with a child in its process group, as vLLM's engine core is).

The other smoke tests import this module (also inside a bare container: stdlib only at import
time); the tests here prove the fake itself behaves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FAULTS = {
    "empty_text",          # completions answer ""
    "nan_logprob",         # one token logprob is NaN
    "null_logprob",        # one token logprob is null (what pydantic writes for NaN)
    "nondeterministic",    # each request gives other tokens
    "short",               # fewer tokens than max_tokens
    "no_done",             # the stream ends without data: [DONE]
    "stream_other_tokens", # the stream gives other tokens than the plain request
    "chat_empty",          # chat answers no content
    "wrong_model",         # /v1/models lists another name
    "no_tokenize",         # /tokenize answers 404
    "http_500",            # /v1/completions answers 500
    "usage_chunk",         # not a fault: the stream ends with a usage-only chunk before [DONE]
}

# What vLLM 0.24.0 + the overlay log at start-up: the Ray instance and placement group (with
# the Ray executor), each rank's assignment, the attention and indexer backends.
def startup_log(attention: str, indexer_kernels: str, indexer_backend: str = "DEEPSEEK_V32_INDEXER",
                tp: int = 1, pp: int = 1, ray: bool = False) -> list[str]:
    lines = []
    if ray:
        lines += ["(EngineCore pid=40) INFO worker.py:2004 -- Started a local Ray instance.",
                  "(EngineCore pid=40) INFO [ray_utils.py:624] No current placement group found. "
                  "Creating a new placement group."]
    for rank in range(tp * pp):
        pp_rank, tp_rank = divmod(rank, tp)
        # The prefix each worker's lines carry; Ray's is coloured when it thinks it has a terminal.
        prefix = ("(EngineCore pid=40) \x1b[36m(RayWorkerProc pid=%d)\x1b[0m " % (50 + rank) if ray else
                  "(Worker_PP%d_TP%d pid=%d) " % (pp_rank, tp_rank, 50 + rank) if tp * pp > 1 else
                  "(EngineCore pid=40) ")
        lines.append(prefix + "INFO [parallel_state.py:1923] rank %d in world size %d is assigned as DP rank 0, "
                     "PP rank %d, PCP rank 0, TP rank %d, EP rank %d, EPLB rank N/A" % (rank, tp * pp, pp_rank,
                                                                                       tp_rank, rank))
    return lines + [
        "INFO [cuda.py:480] Using %s attention backend out of potential backends: ['%s']." % (attention, attention),
        "INFO [indexer.py:320] DSA indexer decode path: use_flattening=False (next_n=1, use_fp4_indexer_cache=False)",
        "INFO [indexer.py:358] DSA sparse indexer kernels: %s (indexer backend %s)" % (indexer_kernels, indexer_backend),
    ]


def fake_tokens(prompt, count: int, salt: int = 0) -> list[int]:
    digest = hashlib.sha256(json.dumps([prompt, salt]).encode()).digest()
    return [8 + (digest[i % len(digest)] * 7 + i) % 1016 for i in range(count)]


# What `selftest --json -` prints when the kernels agree: the table, then the JSON document.
SELFTEST_OUTPUT = (
    "| case | kernel | shapes | max error | top-k agreement (min row) | time | result |\n"
    "|---|---|---|---|---|---|---|\n"
    "| decode-bs32 | fp8_paged_mqa_logits + vLLM top-k | 32 rows | 1.7e-04 | 99.9985% (99.95%) | 0.16 ms | ok |\n"
    'SELFTEST: PASS\n{"ok": true, "kernels": "deepgemm"}\n'
)


class FakeVllm:
    """State of one fake server: its faults, and what it was asked."""

    def __init__(self, served_name: str = "glm-5", faults: set[str] = frozenset(), max_model_len: int = 8192):
        unknown = set(faults) - FAULTS
        assert not unknown, f"unknown faults {unknown}"
        self.served_name = served_name
        self.faults = set(faults)
        self.max_model_len = max_model_len
        self.requests: list[tuple[str, dict]] = []
        self._calls = 0
        self._lock = threading.Lock()

    def salt(self) -> int:
        with self._lock:
            self._calls += 1
            return self._calls if "nondeterministic" in self.faults else 0

    def completion(self, body: dict, stream: bool = False) -> dict:
        count = body.get("max_tokens", 16) - (3 if "short" in self.faults else 0)
        salt = self.salt() + (1000 if stream and "stream_other_tokens" in self.faults else 0)
        ids = fake_tokens(body.get("prompt"), count, salt)
        logprobs = [-1.0 - i / 10 for i in range(count)]
        if "nan_logprob" in self.faults:
            logprobs[3] = float("nan")
        if "null_logprob" in self.faults:
            logprobs[3] = None
        text = "" if "empty_text" in self.faults else "".join(f" w{i}" for i in ids)
        return {"ids": ids, "text": text, "logprobs": logprobs}


def make_handler(state: FakeVllm):
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
            self.wfile.write(data)

        def do_GET(self):
            state.requests.append((self.path, {}))
            if self.path == "/health":
                return self._send(200, b"", "text/plain")
            if self.path == "/v1/models":
                name = "other-model" if "wrong_model" in state.faults else state.served_name
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            state.requests.append((self.path, body))
            if body.get("model") not in (None, state.served_name):
                return self._send(404, {"error": f"model {body.get('model')} does not exist"})
            if self.path == "/tokenize":
                if "no_tokenize" in state.faults:
                    return self._send(404, {"error": "not found"})
                tokens = [8 + b for b in body["prompt"].encode()]
                return self._send(200, {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens})
            if self.path == "/v1/completions":
                if "http_500" in state.faults:
                    return self._send(500, {"error": "EngineCore died"})
                if body.get("stream"):
                    return self._stream(body)
                out = state.completion(body)
                return self._send(200, {"object": "text_completion", "choices": [{
                    "index": 0, "text": out["text"], "finish_reason": "length", "token_ids": out["ids"],
                    "logprobs": {"token_logprobs": out["logprobs"], "tokens": [f"w{i}" for i in out["ids"]]}}]})
            if self.path == "/v1/chat/completions":
                out = state.completion({**body, "prompt": body.get("messages")})
                content = "" if "chat_empty" in state.faults else out["text"] or "x"
                return self._send(200, {"object": "chat.completion", "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length",
                    "logprobs": {"content": [{"token": f"w{i}", "logprob": lp}
                                             for i, lp in zip(out["ids"], out["logprobs"], strict=True)]}}]})
            self._send(404, {"error": "not found"})

        def _stream(self, body: dict):
            out = state.completion(body, stream=True)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for token in out["ids"]:
                piece = "" if "empty_text" in state.faults else f" w{token}"
                chunk = {"choices": [{"index": 0, "text": piece, "token_ids": [token]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if "usage_chunk" in state.faults:
                usage = {"choices": [], "usage": {"completion_tokens": len(out["ids"])}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
            if "no_done" not in state.faults:
                self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


class FakeServer:
    """The fake on a thread of this process, on a free port of 127.0.0.1."""

    def __init__(self, state: FakeVllm, port: int = 0):
        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
        self.port = self.httpd.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


# --- the fake `vllm` package, for the local runtime as a real subprocess -------------------

FAKE_CLI = textwrap.dedent('''\
    """Fake `vllm serve`: the smoke test's fake server in a real process (group)."""
    import argparse, json, os, subprocess, sys, time
    sys.path.insert(0, {tests_dir!r})
    import test_smoke_fakes as fakes

    def main():
        argv = sys.argv[1:]
        with open(os.environ["FAKE_VLLM_ARGV_FILE"], "w") as f:
            json.dump(argv, f)
        if os.environ.get("FAKE_VLLM_ENV_FILE"):  # what of the environment it was started with
            with open(os.environ["FAKE_VLLM_ENV_FILE"], "w") as f:
                json.dump({{k: os.environ.get(k) for k in ("RAY_DEDUP_LOGS", "PYTHONPATH")}}, f)
        parser = argparse.ArgumentParser()
        parser.add_argument("cmd"); parser.add_argument("model")
        parser.add_argument("--port", type=int); parser.add_argument("--served-model-name")
        parser.add_argument("--tensor-parallel-size", type=int, default=1)
        parser.add_argument("--pipeline-parallel-size", type=int, default=1)
        parser.add_argument("--distributed-executor-backend")
        args, _ = parser.parse_known_args(argv)
        if os.environ.get("FAKE_VLLM_MODEL_FILE"):  # what the model directory held at start
            with open(os.environ["FAKE_VLLM_MODEL_FILE"], "w") as f:
                json.dump(sorted(os.listdir(args.model)), f)
        # A child in the same process group, as vLLM's engine core: it ignores SIGTERM.
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"])
        with open(os.environ["FAKE_VLLM_CHILD_FILE"], "w") as f:
            f.write(str(child.pid))
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        if os.environ.get("FAKE_GPU_APPS_FILE"):  # the child "holds" one GPU per rank (fake nvidia-smi reads it)
            with open(os.environ["FAKE_GPU_APPS_FILE"], "w") as f:
                f.writelines(f"GPU-fake-{{i}}, {{child.pid}}, 1024\\n" for i in range(world))
        print("INFO fake vllm serve", args.model, flush=True)
        if os.environ.get("FAKE_VLLM_EXIT_CODE"):
            print("ERROR RuntimeError: No CUDA GPUs are available", flush=True)
            sys.exit(int(os.environ["FAKE_VLLM_EXIT_CODE"]))
        time.sleep(float(os.environ.get("FAKE_VLLM_START_DELAY", "0")))
        for line in fakes.startup_log(os.environ["FAKE_VLLM_ATTENTION"], os.environ["FAKE_VLLM_KERNELS"],
                                      tp=args.tensor_parallel_size, pp=args.pipeline_parallel_size,
                                      ray=args.distributed_executor_backend == "ray"):
            print(line, flush=True)
        faults = set(json.loads(os.environ.get("FAKE_VLLM_FAULTS", "[]")))
        server = fakes.FakeServer(fakes.FakeVllm(args.served_model_name, faults), args.port)
        print("INFO Application startup complete.", flush=True)
        server.httpd.serve_forever()

    if __name__ == "__main__":
        main()
''')


def make_fake_vllm_site(site: Path, version: str = "0.24.0") -> Path:
    """A site dir with a fake `vllm` (and its dist-info, so importlib.metadata finds it)."""
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_CLI.format(tests_dir=str(Path(__file__).resolve().parent)))
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return site


# A fake `ray`: importable (or broken, as an install missing a library is), with what the smoke's
# Ray probe calls: the address ray.init(address=None) resolves to, and a cluster's nodes.
FAKE_RAY = textwrap.dedent('''\
    import json, os
    if os.environ.get("FAKE_RAY_BROKEN"):
        raise ImportError("libgcs_server.so: cannot open shared object file")
    __version__ = "2.52.0"

    def init(address=None, **kwargs):
        if os.environ.get("FAKE_RAY_DEAD"):
            raise ConnectionError("Could not read 'session_name' from GCS. Did GCS start successfully?")

    def nodes():
        return json.loads(os.environ.get("FAKE_RAY_NODES", "[]"))

    def shutdown():
        pass
''')
FAKE_RAY_SERVICES = textwrap.dedent('''\
    import os

    def canonicalize_bootstrap_address(addr, temp_dir=None):
        return os.environ.get("RAY_ADDRESS") or None
''')


def make_fake_ray(site: Path) -> Path:
    private = site / "ray" / "_private"
    private.mkdir(parents=True)
    (site / "ray" / "__init__.py").write_text(FAKE_RAY)
    (private / "__init__.py").write_text("")
    (private / "services.py").write_text(FAKE_RAY_SERVICES)
    return site


# A fake nvidia-smi: FAKE_NVIDIA_SMI_GPUS H200s (GPU-fake-0 ...); the compute processes are what
# FAKE_GPU_APPS_FILE holds (the fake `vllm serve` writes it).
FAKE_NVIDIA_SMI = textwrap.dedent('''\
    import os, sys
    query = " ".join(sys.argv[1:])
    gpus = int(os.environ.get("FAKE_NVIDIA_SMI_GPUS", "2"))
    if "--query-gpu=index,uuid,name" in query:
        print("".join(f"{i}, GPU-fake-{i}, NVIDIA H200\\n" for i in range(gpus)), end="")
    elif "--query-gpu=name,compute_cap,driver_version" in query:
        print("NVIDIA H200, 9.0, 580.95.05\\n" * gpus, end="")
    elif "--query-compute-apps" in query:
        path = os.environ.get("FAKE_GPU_APPS_FILE", "")
        print(open(path).read() if os.path.exists(path) else "", end="")
    else:
        sys.exit(2)
''')


def make_fake_nvidia_smi(bin_dir: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n" + FAKE_NVIDIA_SMI)
    path.chmod(0o755)
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


# --- tests of the fake ----------------------------------------------------------------------


def test_fake_is_deterministic_unless_told_otherwise():
    good, bad = FakeVllm(), FakeVllm(faults={"nondeterministic"})
    body = {"prompt": "x", "max_tokens": 16}
    assert good.completion(body)["ids"] == good.completion(body)["ids"]
    assert bad.completion(body)["ids"] != bad.completion(body)["ids"]


def test_fake_serves_nan_as_a_json_nan_literal():
    import urllib.request

    with FakeServer(FakeVllm(faults={"nan_logprob"})) as server:
        request = urllib.request.Request(server.base_url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "x", "max_tokens": 16}).encode())
        raw = urllib.request.urlopen(request, timeout=10).read().decode()
    assert "NaN" in raw


def test_fake_rejects_unknown_faults():
    import pytest  # imported here: the fake itself also runs in a bare container, without pytest

    with pytest.raises(AssertionError):
        FakeVllm(faults={"typo"})


def test_fake_vllm_site_is_importable(tmp_path):
    import subprocess

    site = make_fake_vllm_site(tmp_path / "site")
    done = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, vllm.entrypoints.cli.main; "
                           "print(m.version('vllm'))"], env={**os.environ, "PYTHONPATH": str(site)},
                          capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.24.0"
