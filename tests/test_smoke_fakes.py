"""The smoke tests' fakes around the fake vLLM server (tests/fake_vllm.py): what vLLM logs at
start-up, a fake `vllm` package whose `python -m vllm.entrypoints.cli.main serve` starts the
server as a real process (with a child in its process group, as vLLM's engine core is), a fake
`ray` and `nvidia-smi`.

The other smoke tests import this module (also inside a bare container: stdlib only at import
time); the tests here prove the fakes themselves behave.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from fake_vllm import FakeServer, FakeVllm

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


# What `selftest --json -` prints when the kernels agree: the table, then the JSON document.
SELFTEST_OUTPUT = (
    "| case | kernel | shapes | max error | top-k agreement (min row) | time | result |\n"
    "|---|---|---|---|---|---|---|\n"
    "| decode-bs32 | fp8_paged_mqa_logits + vLLM top-k | 32 rows | 1.7e-04 | 99.9985% (99.95%) | 0.16 ms | ok |\n"
    'SELFTEST: PASS\n{"ok": true, "kernels": "deepgemm"}\n'
)


# --- the fake `vllm` package, for the local runtime as a real subprocess -------------------

FAKE_CLI = textwrap.dedent('''\
    """Fake `vllm serve`: the smoke test's fake server in a real process (group)."""
    import argparse, json, os, subprocess, sys, time
    sys.path.insert(0, {tests_dir!r})
    import fake_vllm, test_smoke_fakes as fakes

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
        server = fake_vllm.FakeServer(fake_vllm.FakeVllm(args.served_model_name, faults), args.port)
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
    assert good.tokens(**body) == good.tokens(**body)
    assert bad.tokens(**body) != bad.tokens(**body)


def test_fake_serves_nan_as_a_json_nan_literal():
    import urllib.request

    with FakeServer(FakeVllm(faults={"nan_logprob"})) as server:
        request = urllib.request.Request(server.base_url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "x", "max_tokens": 16, "logprobs": 1}).encode())
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
