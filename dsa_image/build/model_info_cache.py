"""vLLM's model-class info, cached at build time for GLM-5.x and its MTP drafter.

Before a server starts, vLLM inspects each model class it resolves (the model's, and with MTP
the drafter's) in a fresh Python subprocess, unless VLLM_CACHE_ROOT/modelinfos holds that
class's info keyed by the hash of its module's source (vllm/model_executor/models/registry.py,
`_LazyRegisteredModel.inspect_model_cls`): 18-19 s for the two in the 0.33.0 image on a 2-core
CPU (docs/image.md); on an H200 the 8x B200 recipe's start had 42 s and 44 s before each class
resolved (docs/validation/h200-2026-11-30-vllm0_33_0-run3). The image
ships the files under /home/vllm/.cache/vllm, so a container starts with them, and so does a new
named volume there (Docker fills it from the image).

    python -m dsa_image.build.model_info_cache fill  --model DIR --cache-root DIR   # build time
    python -m dsa_image.build.model_info_cache check --model DIR --cache-root DIR   # fresh for this site?
    python -m dsa_image.build.model_info_cache time  --model DIR --cache-root DIR   # vLLM's lookup, timed

`check` runs vLLM's own lookup with its subprocess fallback disabled: an entry whose module
changed since `fill` (an overlay over the model's module, another vLLM) is stale and fails it.
The architectures are the model's `architectures[0]` and the drafter's, as vLLM's
`SpeculativeConfig.hf_config_override` renames it (GLM-5.x checkpoints carry an MTP layer).

Exit codes: --help lists them.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsa_image.core.compile_caches import cache_env
from dsa_image.core import status

TOOL_ROOT = Path(__file__).resolve().parents[2]  # the directory holding dsa_image/

FRESH, STALE, BAD_INPUT = status.SUCCESS, status.FAILED, status.USAGE
EXIT_CODES = status.epilog((FRESH, "done / fresh"), (STALE, "an entry missing or stale"),
                           (BAD_INPUT, "bad input: no config.json, an architecture vLLM does not register"))


class ModelInfoError(status.DsaImageError):
    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def architectures(model_dir: Path) -> list[str]:
    """The model's architecture and its MTP drafter's, as vLLM resolves them."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelInfoError(BAD_INPUT, f"{config_file}: expected a Hugging Face config.json; point --model at a model directory")
    from transformers import AutoConfig
    from vllm.config.speculative import SpeculativeConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    drafter = SpeculativeConfig.hf_config_override(copy.deepcopy(config))
    return list(dict.fromkeys([config.architectures[0], drafter.architectures[0]]))


def _registered(arch: str):
    from vllm.model_executor.models.registry import ModelRegistry

    model = ModelRegistry.models.get(arch)
    if model is None or not hasattr(model, "_get_cache_filename"):
        raise ModelInfoError(BAD_INPUT, f"{arch}: not a model class vLLM registers lazily (expected an entry of "
                                        "ModelRegistry.models with a model-info cache file)")
    return ModelRegistry, model


def _inspect(arch: str):
    """vLLM's start-up lookup of one architecture (from the cache, else inspecting it); its
    registry entry."""
    registry, model = _registered(arch)
    if registry._try_inspect_model_cls(arch) is None:
        raise ModelInfoError(STALE, f"{arch}: vLLM could not inspect the model class (its log above says why)")
    return model


@contextlib.contextmanager
def inspections_run_by(runner):
    """vLLM's registry with `runner` in place of the subprocess it inspects a model class in."""
    from vllm.model_executor.models import registry

    original = registry._run_in_subprocess
    registry._run_in_subprocess = runner
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def fill(archs: list[str]) -> list[Path]:
    """Inspect each architecture as vLLM does at start-up, which writes its cache file. In this
    process, not one subprocess per class: vLLM's subprocess keeps CUDA uninitialised in a
    server, and this process serves nothing."""
    written = []
    with inspections_run_by(lambda inspect: inspect()):
        for arch in archs:
            model = _inspect(arch)
            path = model._get_cache_dir() / model._get_cache_filename()
            if not path.is_file():
                raise ModelInfoError(STALE, f"{arch}: inspected, but vLLM wrote no {path}")
            written.append(path)
    return written


def stale(archs: list[str]) -> list[str]:
    """The architectures vLLM would inspect again in a subprocess: no entry, or one for other sources."""
    def refuse(_inspect):
        raise RuntimeError("the model-info cache missed")

    with inspections_run_by(refuse):
        return [arch for arch in archs if _registered(arch)[0]._try_inspect_model_cls(arch) is None]


def timed(archs: list[str]) -> dict[str, float]:
    """Seconds vLLM's start-up lookup takes per architecture: from the cache, or inspecting in a
    subprocess (and caching) when it misses."""
    seconds = {}
    for arch in archs:
        started = time.perf_counter()
        _inspect(arch)
        seconds[arch] = round(time.perf_counter() - started, 2)
    return seconds


# What fill_with raises: the fill failed, the environment could not run it, or it hung.
FILL_ERRORS = (RuntimeError, OSError, subprocess.TimeoutExpired)


def fill_with(python: str, env: dict, model: Path, cache_root: Path, timeout: float = 900) -> Path:
    """The entries the image ships, made by `fill` in another Python environment (`env`: a GPU
    validation's stock or overlay site on PYTHONPATH) unless `cache_root` has them already;
    returns their directory."""
    entries = cache_root / "modelinfos"
    if not entries.is_dir():
        path = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(TOOL_ROOT)) if p)
        result = subprocess.run([python, "-m", "dsa_image.build.model_info_cache", "fill", "--model", str(model),
                                 "--cache-root", str(cache_root)], env={**env, "PYTHONPATH": path},
                                capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"model_info_cache fill exited with {result.returncode}: {result.stderr[-2000:]}")
    return entries


def shipped_dir(home: Path) -> Path:
    """Where the image has the entries: VLLM_CACHE_ROOT/modelinfos of this HOME."""
    return Path(cache_env(str(home))["VLLM_CACHE_ROOT"]) / "modelinfos"


def ship_into(home: Path, entries: Path) -> None:
    shutil.copytree(entries, shipped_dir(home))


def image_home(home: Path, entries: Path) -> Path:
    """HOME as the image's at a first `docker run`: no compile cache, the shipped model info.
    One kept from an earlier run is removed first: its compile caches may be half-written (a
    killed call), and an empty DeepGEMM JIT cache directory in it made vLLM's `import deep_gemm`
    find a namespace package and report DeepGEMM unavailable."""
    shutil.rmtree(home, ignore_errors=True)
    ship_into(home, entries)
    return home


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("fill", "check", "time"))
    parser.add_argument("--model", type=Path, required=True, help="a model directory (its config.json)")
    parser.add_argument("--cache-root", type=Path, required=True, help="VLLM_CACHE_ROOT (modelinfos/ below it)")
    args = parser.parse_args(argv)
    # vLLM reads VLLM_CACHE_ROOT when the registry builds a path, from the environment.
    os.environ["VLLM_CACHE_ROOT"] = str(args.cache_root)
    try:
        archs = architectures(args.model)
        if args.mode == "fill":
            written = fill(archs)
            print(json.dumps({"architectures": archs, "written": [str(p) for p in written]}))
            return FRESH
        if args.mode == "time":
            print(json.dumps({"cache_root": str(args.cache_root), "seconds": timed(archs)}))
            return FRESH
        missing = stale(archs)
        if missing:
            raise ModelInfoError(STALE, f"{args.cache_root}/modelinfos: expected a fresh entry for {', '.join(archs)}; "
                                        f"missing or stale: {', '.join(missing)} (no entry, or one for other module sources than "
                                        "this site's); run `python -m dsa_image.build.model_info_cache fill` against this site")
        print(f"model info fresh for {', '.join(archs)} in {args.cache_root}/modelinfos")
        return FRESH
    except ModelInfoError as exc:
        print(f"model_info_cache: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
