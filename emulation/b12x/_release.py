"""Which b12x release the emulation stands in for, and what it mirrors of that release.

A site has one b12x: the emulation stands in for the release installed beside vLLM (its
dist-info stays there, and the overlay's start-up check reads it; the emulation only shadows
the package). ``DSA_B12X_EMULATED_RELEASE`` names the release where no b12x is installed (the
CPU tests); where one is, it must name that one. Anything else fails at ``import b12x``.

The two releases differ, for what the overlays call, in where the functions live
(``b12x.attention.indexer`` in 0.30; ``b12x.attention.dsa_indexer._impl`` from 1.3, 1.5.1
having no ``b12x.attention.indexer``) and in the names of their variables (NSA in 0.30, DSA
from 1.3); the functions' signatures and semantics, and the constants below, are the same
(``Release.wheel_constants`` is checked against both wheels).

Stdlib only: the tests read the mirrored constants without torch.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass

RELEASE_VARIABLE = "DSA_B12X_EMULATED_RELEASE"

# b12x's kernel contract and tiling, mirrored by the emulation.
PAGE_SIZE = 64
MAX_HEADS = 64
PAGED_Q_HEAD_TILE = 16
SUPPORTED_TOPK = (512, 1024, 2048)
# Query rows per tile of both prefill tile widths (_PREFILL512_BLOCK_Q = _PREFILL_BLOCK_Q).
BLOCK_Q = 32
PREFILL_BLOCK_K = 256
PREFILL512_BLOCK_K = 512
PREFILL512_MIN_Q_ROWS = 1024
PREFILL512_MIN_K_ROWS = 4096
PREFILL512_HEADS = (32, 64)
# Rows below which the contiguous path takes the decode scorer (b12x then still tiles by 256).
PREFILL_SCORER_MIN_ROWS = 256
SCHEDULE_MIN_PAGES = 1024
SCHEDULE_MULTI_ROW_MAX_Q_ROWS = 8
SCHEDULE_PAGES_PER_SPLIT = 4
SUPERTILE_K_DEFAULT = 32768


@dataclass(frozen=True)
class Release:
    version: str
    # b12x's indexer package, and the module the overlay imports the functions from.
    package: str
    api_module: str
    # The prefix of b12x's variable names: NSA in 0.30, DSA from 1.3.
    tag: str

    @property
    def modules(self) -> tuple[str, ...]:
        """The indexer modules this release has (and so the emulation's importable ones)."""
        return tuple(dict.fromkeys((self.package, self.api_module)))

    @property
    def supertile_variable(self) -> str:
        return f"B12X_{self.tag}_TOPK_SUPERTILE_K"

    @property
    def prefill_threshold_variable(self) -> str:
        return f"B12X_{self.tag}_CONTIGUOUS_PREFILL_THRESHOLD"

    @property
    def prefill_block_k_variable(self) -> str:
        return f"B12X_{self.tag}_CONTIGUOUS_PREFILL_BLOCK_K"

    def wheel_constants(self) -> dict[tuple[str, str], object]:
        """What the emulation mirrors, by (b12x module, name): checked against the wheel."""
        kernel, contiguous, tiled = (f"{self.package}.{m}" for m in ("kernel", "contiguous_kernel", "tiled_topk"))
        return {
            (kernel, "_PAGE_SIZE"): PAGE_SIZE,
            (kernel, "_MAX_SUPPORTED_Q_HEADS"): MAX_HEADS,
            (kernel, "_SCHEDULE_MIN_PAGES"): SCHEDULE_MIN_PAGES,
            (kernel, "_SCHEDULE_MULTI_ROW_MAX_Q_ROWS"): SCHEDULE_MULTI_ROW_MAX_Q_ROWS,
            (kernel, "_ENABLE_MULTI_ROW_SCHEDULE"): True,
            (kernel, "PAGED_MQA_LOGITS_SCHEDULE_PAGES_PER_SPLIT"): SCHEDULE_PAGES_PER_SPLIT,
            (kernel, "_PAGED_Q_HEAD_TILE"): PAGED_Q_HEAD_TILE,
            (tiled, "_SUPPORTED_TOPK"): SUPPORTED_TOPK,
            (tiled, "_SUPERTILE_K_ENV"): self.supertile_variable,
            (tiled, "_SUPERTILE_K_DEFAULT"): SUPERTILE_K_DEFAULT,
            (contiguous, "_MAX_Q_HEADS"): MAX_HEADS,
            (contiguous, "_PREFILL_BLOCK_Q"): BLOCK_Q,
            (contiguous, "_PREFILL512_BLOCK_Q"): BLOCK_Q,
            (contiguous, "_PREFILL_BLOCK_K"): PREFILL_BLOCK_K,
            (contiguous, "_PREFILL512_BLOCK_K"): PREFILL512_BLOCK_K,
            (contiguous, "_PREFILL512_MIN_Q_ROWS"): PREFILL512_MIN_Q_ROWS,
            (contiguous, "_PREFILL512_MIN_K_ROWS"): PREFILL512_MIN_K_ROWS,
            (contiguous, "_PREFILL512_SUPPORTED_NUM_HEADS"): PREFILL512_HEADS,
            (contiguous, f"_{self.tag}_CONTIGUOUS_PREFILL_THRESHOLD_ENV"): self.prefill_threshold_variable,
            (contiguous, f"_{self.tag}_CONTIGUOUS_PREFILL_BLOCK_K_ENV"): self.prefill_block_k_variable,
        }


RELEASES = {release.version: release for release in (
    Release("0.30.2", "b12x.attention.indexer", "b12x.attention.indexer", "NSA"),
    Release("1.5.1", "b12x.attention.dsa_indexer", "b12x.attention.dsa_indexer._impl", "DSA"),
)}


def resolve(switch: str | None, installed: str | None) -> Release:
    """The release to stand in for: the site's b12x, else the one the switch names."""
    if switch and installed and switch != installed:
        raise ImportError(
            f"{RELEASE_VARIABLE}={switch}, but this site has b12x {installed}: the overlay "
            "checks the site's release, so the emulation stands in for that one only")
    version = switch or installed
    if version is None:
        raise ImportError(
            "no b12x release to emulate: install the b12x wheel the vLLM base pins beside "
            f"vLLM (its kernels are never loaded), or set {RELEASE_VARIABLE} to one of "
            f"{', '.join(RELEASES)}")
    if version not in RELEASES:
        raise ImportError(
            f"b12x {version} is not emulated (emulated: {', '.join(RELEASES)}): compare its "
            "indexer with the emulation (dsa_image.validation.b12x_crosscheck) before adding it")
    return RELEASES[version]


def installed_version() -> str | None:
    """The b12x release installed on sys.path (the emulation itself has no dist-info)."""
    try:
        return importlib.metadata.version("b12x")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def current() -> Release:
    """The release this process emulates, decided once: a site has one b12x."""
    return resolve(os.environ.get(RELEASE_VARIABLE) or None, installed_version())


def require(module: str) -> None:
    """Refuse to import an indexer module the emulated release does not have, as b12x would."""
    release = current()
    if module not in release.modules:
        raise ModuleNotFoundError(
            f"No module named {module!r} in the emulated b12x {release.version} (its indexer "
            f"functions are in {release.api_module})", name=module)
