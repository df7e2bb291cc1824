"""Every serving recipe scaled down to one H200 (sm_90) and the tiny GLM-5, served and asked.

A scaled-down recipe keeps the recipe's flags where sm_90 can run them (KV dtype, block size,
MTP and its speculative tokens, parsers, batching limits, prefix caching, the IndexShare
override, GPU memory fraction, the environment workarounds) and says, for every flag it changes,
what and why: the model becomes the tiny GLM-5 with random weights (with its MTP layer where the
recipe uses MTP), the layout shrinks to the GPUs there, max_model_len to the tiny model's, and
what only runs on sm_100 / sm_120 is replaced by the sm90 image's choice. Recipes whose
scaled-down forms are identical are served once.

    python -m dsa_image.validation.recipes --list
    python -m dsa_image.validation.recipes --out DIR [--only NAME ...] [--site-packages S] [--timeout 480]
        [--work DIR]

Per run: the server's time to /health, a short and a 3000-token greedy completion (both must
generate tokens; their text may be empty), and a chat completion with a tool offered (recorded: it exercises the
recipe's tool-call and reasoning parsers on the tiny tokenizer, which has none of GLM's
<think>/<tool_call> tokens). Writes DIR/<run>.json, DIR/<run>.log and DIR/summary.json (gathered
across calls); exits 0 when every run of this call served and answered, 2 without starting a server
when --port already accepts connections (a server left by an earlier call would answer instead). Stdlib only, like the other validation scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dsa_image.build import model_info_cache, tiny_model
from dsa_image.core.compile_caches import cache_env
from dsa_image.serving.memory_plan import backends
from dsa_image.core.recipe import RECIPES_DIR, Recipe, load_recipe
from dsa_image.core.site_path import pythonpath
from dsa_image.serving.launch import environment, vllm_args
from dsa_image.serving.recipes import ServeRecipe, attention_backend, kv_cache_dtype, load_serve_recipe, serve_recipe_names
from dsa_image.core import health
from dsa_image.harness.client import Client, HttpError
from dsa_image.harness.server import answered, prompts, stop
from dsa_image.core import status

SCALED_TARGET = "sm90"
LONG_PROMPT = 3000  # > index_topk (2048): the prefill reaches the indexer
SHORT_PROMPT = 20
MAX_TOKENS = 16
B12X_ENV = "VLLM_USE_B12X_SPARSE_INDEXER"
# Seconds a server may take to answer /health. A cold vLLM 0.33.0 start is far longer than
# 0.24.0's (whose MTP recipes were healthy in 144-152 s: docs/validation/
# h200-2026-11-30-overlay-f1d4805b/recipes/*.json). Every run starts from an empty HOME, so 0.33.0
# JIT-compiles FlashInfer's sampling module (85-108 s on the H200: run2 README section 3). The
# 8x B200 recipe scaled down (MTP 3) spent 88 s resolving its two models' architectures, reached
# that compilation about 180 s after its start and was still in it when --timeout 270 ran out
# (docs/validation/h200-2026-11-30-vllm0_33_0-run2/recipe-glm-5-fp8-8xb200.log); the smoke's
# server took 169 s from that compilation's start to healthy (smoke-server.log there): about
# 350 s before MTP's own graphs. 480 leaves room for those and, with the requests and the stop,
# stays inside one 600-s device call; the former default, 600, was that whole call, so a late
# server got the call killed before its result was written.
DEFAULT_TIMEOUT_S = 480.0


@dataclass(frozen=True)
class Change:
    what: str
    recipe: str
    scaled: str
    reason: str
    sm90: bool  # True: changed because sm_90 cannot run it (not because the host is smaller)


@dataclass(frozen=True)
class ScaledRun:
    name: str  # the first recipe's name
    recipes: tuple[str, ...]
    mtp: bool
    args: list[str]  # vllm serve arguments after the model
    env: dict[str, str]
    changes: tuple[Change, ...]

    @property
    def key(self) -> str:
        return json.dumps([self.mtp, self.args, sorted(self.env.items())])


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


def sm90_backend_for(table: dict, default: str, kv: str) -> tuple[str, str]:
    """The sm_90 sparse-MLA backend for a recipe whose own does not run there, and why: the sm90
    image's when it takes the recipe's KV dtype, else the first of the release's that does (vLLM
    0.33.0's sm_90 default, FLASH_ATTN_MLA_SPARSE, takes bf16 caches only: an fp8 recipe keeps
    its fp8 cache on FLASHMLA_SPARSE)."""
    if kv in table[default].kv_cache_dtypes_on(9):
        return default, "the sm90 image's sparse-MLA backend instead"
    takes = [name for name, spec in table.items() if kv in spec.kv_cache_dtypes_on(9)]
    if takes:
        return takes[0], f"{takes[0]}, the sm_90 sparse-MLA backend that takes {kv}, instead"
    return default, "the sm90 image's sparse-MLA backend instead"


def scale_down(recipe: ServeRecipe, build: Recipe, gpus: int = 1) -> ScaledRun:
    """The recipe's flags on `gpus` H200s with the tiny GLM-5."""
    target = SCALED_TARGET if SCALED_TARGET in recipe.targets else recipe.targets[0]
    sm90 = build.target(SCALED_TARGET)
    tiny = tiny_model.CONFIG
    changes: list[Change] = []
    vllm = dict(recipe.vllm)

    table = backends(build.vllm_version)
    backend = attention_backend(recipe, target, build)
    kv = kv_cache_dtype(recipe, target, build)
    if 9 not in table[backend].capability_majors:
        instead, why = sm90_backend_for(table, sm90.attention_backend, kv)
        changes.append(Change("--attention-backend", backend, instead,
                              f"{backend} runs on compute capability "
                              f"{'/'.join(map(str, table[backend].capability_majors))}.x only (vLLM "
                              f"{build.vllm_version} supports_compute_capability); {why}", True))
        backend = instead
    vllm["attention_backend"] = backend
    if kv not in table[backend].kv_cache_dtypes_on(9):
        changes.append(Change("--kv-cache-dtype", kv, sm90.kv_cache_dtype,
                              f"{backend} does not take {kv}", True))
        kv = sm90.kv_cache_dtype
    elif kv == "fp8" and target == "sm100":
        changes.append(Change("--kv-cache-dtype", kv, kv,
                              "kept, but FLASHMLA_SPARSE stores fp8 as fp8_ds_mla (656 B/token), not the 576-byte "
                              "e4m3 layout FLASHINFER_MLA_SPARSE uses on sm_100", True))
    vllm["kv_cache_dtype"] = kv
    block = vllm.get("block_size")
    if block is not None and not table[backend].takes_block_size(block):
        changes.append(Change("--block-size", str(block), str(table[backend].first_block_size),
                              f"{backend} takes block sizes {', '.join(map(str, table[backend].block_sizes))}",
                              True))
        vllm["block_size"] = table[backend].first_block_size

    tp = _largest_divisor(tiny["num_attention_heads"], min(recipe.tp, gpus))
    if tp != recipe.tp or recipe.pp != 1 or recipe.nodes != 1:
        changes.append(Change("layout", f"{recipe.nodes} node(s), TP {recipe.tp}, PP {recipe.pp}",
                              f"1 node, TP {tp}, PP 1",
                              f"reduced to the {gpus} GPU(s) of one H200 host", False))
    if recipe.nodes > 1:
        changes.append(Change("cluster", recipe.layout["cluster_backend"], "none",
                              "one host; the cluster form (Ray or --nnodes) is checked by the argument parser test",
                              False))
    limit = tiny["max_position_embeddings"]
    if vllm["max_model_len"] > limit:
        changes.append(Change("--max-model-len", str(vllm["max_model_len"]), str(limit),
                              "the tiny GLM-5's max_position_embeddings", False))
        vllm["max_model_len"] = limit
    if recipe.model.id == "tiny-glm5":
        why = "the same model, written by tiny_model.write_model here instead of the image's copy"
    else:
        why = (f"no real weights here; --load-format dummy. The checkpoint's quantisation ({recipe.quantization}) "
               f"is not exercised: the tiny model is bf16")
    changes.append(Change("model", recipe.hf_id, "tiny GLM-5" + (" with an MTP layer" if recipe.uses_mtp else ""),
                          why, False))
    vllm["load_format"] = "dummy"

    env = environment(recipe, target, build)
    if B12X_ENV in env:
        changes.append(Change(B12X_ENV, env.pop(B12X_ENV), "unset",
                              "b12x has kernels for compute capability 12.0/12.1 only; the overlay refuses it at "
                              "start-up on 9.0 (docs/validation/h200-2026-11-30-overlay-c2b8469b §3)", True))

    scaled = replace(recipe, hf_id="MODEL", cluster_only=False, vllm=vllm,
                     layout={**recipe.layout, "nodes": 1, "gpus_per_node": tp, "tensor_parallel_size": tp,
                             "pipeline_parallel_size": 1})
    args = vllm_args(scaled, target, build)[1:]
    return ScaledRun(recipe.name, (recipe.name,), recipe.uses_mtp, args, env, tuple(changes))


def scaled_runs(names: list[str], build: Recipe, gpus: int, recipes_dir: Path = RECIPES_DIR) -> list[ScaledRun]:
    runs: dict[str, ScaledRun] = {}
    for name in names:
        run = scale_down(load_serve_recipe(name, recipes_dir, build), build, gpus)
        if run.key in runs:
            first = runs[run.key]
            runs[run.key] = ScaledRun(first.name, (*first.recipes, name), first.mtp, first.args, first.env,
                                      first.changes)
        else:
            runs[run.key] = run
    return list(runs.values())


# -- serving -------------------------------------------------------------------------------


def _post(port: int, path: str, body: dict, timeout: float = 300) -> dict:
    """The answer as {"status", "body"}; a failed request's status (None: nothing answered) and
    the client's message, so that the run's record says what went wrong."""
    try:
        answer = Client.local(port, timeout_s=timeout).post(path, body)
    except HttpError as exc:
        return {"status": exc.status, "body": str(exc)}
    return {"status": answer.status, "body": answer.body}


def completion(port: int, served: str, prompt: list[int]) -> dict:
    answer = _post(port, "/v1/completions", {"model": served, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                              "temperature": 0.0, "ignore_eos": True})
    body = answer["body"]
    if answer["status"] == 200:
        choice = body["choices"][0]
        # Answered: generated tokens. Their text may be empty (serving.answered says why).
        return {"ok": answered(choice, body["usage"]), "prompt_tokens": body["usage"]["prompt_tokens"],
                "completion_tokens": body["usage"]["completion_tokens"], "text": choice["text"],
                "finish_reason": choice["finish_reason"]}
    return {"ok": False, "status": answer["status"], "error": body}


def chat_with_tool(port: int, served: str) -> dict:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}
    answer = _post(port, "/v1/chat/completions", {
        "model": served, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool],
        "tool_choice": "auto", "max_tokens": MAX_TOKENS, "temperature": 0.0})
    if answer["status"] == 200:
        message = answer["body"]["choices"][0]["message"]
        return {"ok": True, "content": message.get("content"), "reasoning": message.get("reasoning_content",
                                                                                        message.get("reasoning")),
                "tool_calls": message.get("tool_calls")}
    return {"ok": False, "status": answer["status"], "error": answer["body"]}


def _healthy(port: int) -> bool:
    return Client.local(port).status("/health") == 200


class PortBusy(status.DsaImageError, RuntimeError):
    """The port already accepts connections: a server (one left by an earlier, killed call?) would
    answer in place of the one this call starts."""

    exit_code = status.USAGE


def port_accepts(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        return sock.connect_ex((host, port)) == 0


def last_log_line(log_path: Path, tail_bytes: int = 65536) -> str | None:
    """The last non-blank line a server has logged so far (at most 400 characters)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    # splitlines also splits at the carriage returns tqdm redraws its bar with: the last redraw wins.
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:400] if lines else None


def wait_healthy(proc: subprocess.Popen, port: int, log_path: Path, timeout: float, poll_s: float = 2) -> float:
    """Seconds until /health answers from the server `proc` started. An answer counts only while
    that process is alive and has written to its log: anything else is another server's answer.
    Out of time, the error names the server's last log line before it is stopped: what it was
    still doing (e.g. vLLM 0.33.0's "flashinfer.jit: Building JIT module sampling"), since the
    log's end afterwards is the traceback the stop itself causes (ninja "interrupted by user")."""
    started = time.monotonic()
    alive = health.Watch("server", lambda: _healthy(port) and proc.poll() is None and log_path.stat().st_size > 0,
                  proc.poll, started)
    outcome = health.wait([alive], started + timeout, poll_s)["server"]
    if outcome.exit_code is not None:
        raise RuntimeError(f"the server exited with {outcome.exit_code} before /health answered")
    if outcome.healthy_s is None:
        raise TimeoutError(f"not healthy after {timeout:.0f} s; still running, its last log line: "
                           f"{last_log_line(log_path) or '(none)'}")
    return round(outcome.healthy_s, 1)


def serve_one(run: ScaledRun, model: Path, out: Path, work: Path, python: str, site: str | None, port: int,
              timeout: float) -> dict:
    served = run.args[run.args.index("--served-model-name") + 1]
    args = list(run.args)
    args[args.index("--port") + 1] = str(port)
    if port_accepts(port):
        raise PortBusy(f"port {port} already accepts connections before {run.name}'s server is started: another "
                       f"server (one left running by an earlier call?) would answer for it; stop it or pass --port")
    # Compile caches per run, laid out as the image's (dsa_image.core.compile_caches), outside the results,
    # from empty each run but for what the image ships: the model info (model_info_cache.py).
    home = work / f"home-{run.name}"
    env = {**os.environ, **run.env, "HOME": str(home), **cache_env(str(home))}
    if site:
        env["PYTHONPATH"] = pythonpath(site)
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model), *args]
    result: dict[str, Any] = {"run": run.name, "recipes": list(run.recipes), "command": cmd[3:], "env": run.env,
              "changes": [asdict(c) for c in run.changes]}
    log_path = out / f"{run.name}.log"
    with open(log_path, "w") as log:
        server: dict[str, subprocess.Popen | None] = {"proc": None}
        try:
            model_info_cache.image_home(home, model_info_cache.fill_with(python, env, model, work / "model-info"))
            server["proc"] = proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=home,
                                                     start_new_session=True)
            result["healthy_after_s"] = wait_healthy(proc, port, log_path, timeout)
            batch = prompts()
            short, long_ = batch[0][:SHORT_PROMPT], batch[3][:LONG_PROMPT]
            result["short"] = completion(port, served, short)
            result["long"] = completion(port, served, long_)
            result["chat_with_tool"] = chat_with_tool(port, served)
        except Exception as exc:  # noqa: BLE001 - recorded; the server is stopped below
            result["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            if server["proc"] is not None:
                stop(server)
    result["ok"] = bool("error" not in result and result.get("short", {}).get("ok")
                        and result.get("long", {}).get("ok"))
    result["log"] = log_path.name
    with open(log_path, errors="replace") as f:
        result["log_tail"] = f.read()[-3000:]
    (out / f"{run.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def prepare_models(directory: Path) -> dict[bool, Path]:
    """The tiny GLM-5 without and with its MTP layer, written (or checked) under `directory`."""
    paths = {}
    for mtp, config in ((False, tiny_model.CONFIG), (True, tiny_model.MTP_CONFIG)):
        path = directory / ("tiny-glm5-mtp" if mtp else "tiny-glm5")
        if path.exists():
            differences = tiny_model.model_dir_differences(path, config)
            if differences:
                raise SystemExit(f"{path}: not the tiny GLM-5 this script writes: {'; '.join(differences)}")
        else:
            tiny_model.write_model(path, config)
        paths[mtp] = path
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the scaled-down runs and what each changes")
    parser.add_argument("--out", type=Path, help="results directory")
    parser.add_argument("--only", nargs="*", help="recipes (default: all)")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--python", default=sys.executable, help="the Python that has vLLM")
    parser.add_argument("--site-packages", help="the site the servers import vLLM from (e.g. the overlaid vLLM, a `pip install --target` tree; its CuTe DSL packages are added)")
    parser.add_argument("--work", type=Path, help="tiny models and per-run HOMEs (default: a new temporary "
                                                  "directory); kept out of --out, which keeps only results")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for a server to become healthy (default {DEFAULT_TIMEOUT_S:.0f}: a cold vLLM "
                             "0.33.0 start with MTP, inside one 600-s device call)")
    args = parser.parse_args(argv)
    build = load_recipe()
    names = args.only or serve_recipe_names()
    runs = scaled_runs(names, build, args.gpus)
    if args.list:
        for run in runs:
            print(f"{run.name} (serves for: {', '.join(run.recipes)}; tiny model{' + MTP' if run.mtp else ''})")
            print(f"  vllm serve MODEL {' '.join(run.args)}")
            print(f"  env: {' '.join(f'{k}={v}' for k, v in run.env.items()) or '(none)'}")
            for c in run.changes:
                print(f"  {'sm_90' if c.sm90 else 'scale'}: {c.what}: {c.recipe} -> {c.scaled}: {c.reason}")
        return 0
    if args.out is None:
        parser.error("--out is required unless --list")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dsa-recipes-"))
    models = prepare_models(work / "models")
    try:
        results = [serve_one(run, models[run.mtp], args.out, work, args.python, args.site_packages, args.port,
                             args.timeout) for run in runs]
    except PortBusy as exc:
        print(f"RECIPES: refused: {exc}", file=sys.stderr)
        return status.REFUSED
    # One device call may serve only some runs (--only): summary.json gathers them across calls.
    summary_path = args.out / "summary.json"
    previous = json.loads(summary_path.read_text())["runs"] if summary_path.is_file() else []
    fresh = [{k: r.get(k) for k in ("run", "recipes", "ok", "healthy_after_s", "error")}
             | {"chat_with_tool_ok": r.get("chat_with_tool", {}).get("ok")} for r in results]
    done = {r["run"] for r in fresh}
    runs_so_far = [r for r in previous if r["run"] not in done] + fresh
    summary = {"ok": all(r["ok"] for r in runs_so_far), "runs": runs_so_far}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    this_call = all(r["ok"] for r in results)
    print("RECIPES SCALED DOWN (this call):", "PASS" if this_call else "FAIL")
    return status.SUCCESS if this_call else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
