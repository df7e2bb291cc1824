"""Run the overlay's b12x path with the emulated b12x, in this process (validation only).

This directory never enters an image (``.dockerignore`` allows only what the Dockerfile copies)
and nothing in the overlay names it. The harness puts it first on ``PYTHONPATH`` (and the
repository after vLLM), so ``import b12x`` finds ``b12x/`` here, then calls ``install()``:

- it checks that ``b12x`` really resolves here (else the run would test something else);
- it bypasses the overlay's compute-capability check, and only that check, when the overlay's
  ``b12x_indexer`` module is imported: the check still runs, its refusal is recorded in
  ``REFUSALS`` and printed, and the start-up goes on. The topk, cache, supertile-variable and
  b12x-release checks run unchanged (the release is that of the b12x wheel installed beside
  vLLM, which the emulation does not replace: it stands in for that release, 0.30.2 for the
  vLLM 0.24.0 overlay or 1.5.1 for the 0.33.0 one, and refuses any other; ``b12x/_release.py``);
- with ``tap_dir``, it records the first long prefill top-k calls (``indexer_tap``).

``sitecustomize.py`` calls ``install()`` in every Python process started with this directory
on ``PYTHONPATH`` and ``DSA_B12X_EMULATION=1``: the servers' engine-core processes too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

OVERLAY_MODULE = "vllm.v1.attention.backends.mla.b12x_indexer"
CAPABILITY_CHECK = "_require_cuda_capability"
BYPASS_LINE = "b12x emulation: compute-capability check bypassed (validation only): "
# The refusals the bypassed check raised, in order.
REFUSALS: list[str] = []


def emulation_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def check_shadowing() -> None:
    spec = importlib.util.find_spec("b12x")
    origin = getattr(spec, "origin", None) or ""
    if not origin.startswith(emulation_dir() + os.sep):
        raise RuntimeError(f"b12x resolves to {origin or 'nothing'}, not the emulation in "
                           f"{emulation_dir()}: put that directory first on PYTHONPATH")


def bypass_capability_check(module) -> None:
    check = getattr(module, CAPABILITY_CHECK)

    def bypassed() -> None:
        try:
            check()
        except RuntimeError as refusal:
            REFUSALS.append(str(refusal))
            print(BYPASS_LINE + str(refusal), file=sys.stderr, flush=True)

    setattr(module, CAPABILITY_CHECK, bypassed)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the named modules as the normal path finder does, then patches each once it ran."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        spec = importlib.machinery.PathFinder.find_spec(name, path) if patch else None
        if spec is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)


def install(tap_dir: str | None = None) -> None:
    """Make this process run the overlay's b12x path on the emulation."""
    check_shadowing()
    patches = {OVERLAY_MODULE: bypass_capability_check}
    if tap_dir:
        import indexer_tap

        patches = indexer_tap.with_taps(patches, tap_dir)
    for name, patch in list(patches.items()):
        if name in sys.modules:
            patch(sys.modules[name])
            del patches[name]
    sys.meta_path.insert(0, _PatchAfterImport(patches))
