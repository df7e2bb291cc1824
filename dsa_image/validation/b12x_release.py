"""The b12x release a vLLM base's overlay calls, and the emulation's facts for it.

Each base's overlay calls the b12x release its recipe pins (0.30.2 for vLLM 0.24.0, 1.5.1 for
0.33.0); the emulation stands in for that release only (emulation/b12x/_release.py), whose
variables the harnesses must set (B12X_NSA_* or B12X_DSA_*).

Stdlib only (and the recipe): usable without torch or vLLM.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from dsa_image.core.recipe import load_recipe


def pinned_b12x(vllm: str) -> str:
    """The b12x release the base's sm120 image installs (its recipe's extra)."""
    extras = load_recipe(vllm=vllm).targets["sm120"].extras
    return next(extra.version for extra in extras if extra.name == "b12x")


def emulated_release(emulation_dir: str, version: str):
    """The emulation's facts (``_release.Release``) for b12x ``version``, read without importing
    the emulated package (which would decide this process's release)."""
    module = load_release_module(emulation_dir)
    if version not in module.RELEASES:
        raise RuntimeError(f"b12x {version} is not emulated (emulated: {', '.join(module.RELEASES)})")
    return module.RELEASES[version]


def load_release_module(emulation_dir: str):
    """emulation/b12x/_release.py as a module of its own name (registered: dataclasses needs it)."""
    path = Path(emulation_dir).resolve() / "b12x" / "_release.py"
    name = "b12x_emulated_release"
    loaded = sys.modules.get(name)
    # A module without a file (__file__ None) is not the one we load: load ours over it.
    if loaded is not None and loaded.__file__ is not None and Path(loaded.__file__) == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
