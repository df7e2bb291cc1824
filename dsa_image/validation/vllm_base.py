"""Which vLLM base a validation run is for: the installed vLLM's.

``--vllm`` only asserts the base, so a run cannot be labelled with a base it did not test.
Stdlib only: usable without torch or vLLM.
"""

from __future__ import annotations

from pathlib import Path

from dsa_image.core.dist_info import installed_vllm_version


def choose(requested: str | None, installed: set[str]) -> str:
    """The base: the installed vLLM, which ``--vllm`` (``requested``) must name if given."""
    if len(installed) != 1:
        raise RuntimeError(f"the sites hold vLLM {sorted(installed)}: one base per run")
    (version,) = installed
    if requested and requested != version:
        raise RuntimeError(f"--vllm {requested}, but vLLM {version} is installed")
    return version


def sites_base(requested: str | None, sites: list[str]) -> str:
    """The base of a run on ``sites``: the vLLM each holds (DistInfoError where one holds none),
    the same in all of them."""
    return choose(requested, {installed_vllm_version(Path(site)) for site in sites})
