"""What the server log must say for a recipe target on a GPU: one function of the two, so no
backend name is written anywhere else in the smoke code."""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsa_image.core.recipe import Recipe, RecipeError, Target

# The env switch of the overlay's b12x indexer path, and the GPUs b12x runs on (sm_12x).
B12X_ENV = "VLLM_USE_B12X_SPARSE_INDEXER"
B12X_MAJOR = 12

# vLLM 0.24.0 logs the attention backend it picked ("Using X attention backend out of
# potential backends: [...]") or was told to use with --attention-backend ("Using
# AttentionBackendEnum.X backend.": the enum's str()).
ATTENTION_LOG = re.compile(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend\b")
# The overlay logs which kernels score the indexer: "DSA sparse indexer kernels: b12x" / "deepgemm".
INDEXER_KERNELS_LOG = re.compile(r"DSA sparse indexer kernels: (\w+)")


@dataclass(frozen=True)
class Expected:
    attention_backend: str
    indexer_backend: str
    indexer_kernels: str  # "b12x" or "deepgemm"
    kv_cache_dtype: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def capability_text(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def parse_capability(text: str) -> tuple[int, int]:
    """'12.0' -> (12, 0); what nvidia-smi's compute_cap and the recipe's cuda_arch look like."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", text)
    if not match:
        raise ValueError(f"not a compute capability (MAJOR.MINOR): {text!r}")
    return int(match.group(1)), int(match.group(2))


def target_for_capability(recipe: Recipe, capability: tuple[int, int]) -> Target:
    """The recipe target built for this GPU (sm_90 -> sm90, sm_120 / sm_121 -> sm120 ...)."""
    matches = [t for t in recipe.targets.values() if capability_text(capability) in t.cuda_arch]
    if len(matches) != 1:
        built = ", ".join(f"{t.id}: {'/'.join(t.cuda_arch)}" for t in recipe.targets.values())
        found = "none" if not matches else ", ".join(t.id for t in matches)
        raise RecipeError(
            f"compute capability {capability_text(capability)} must match exactly one target of "
            f"recipe {recipe.id}, found {found} (targets: {built}); pass --target"
        )
    return matches[0]


def capability_problem(target: Target, capability: tuple[int, int] | None) -> str | None:
    """Why this GPU cannot run this target's image, or None."""
    if capability is None or capability_text(capability) in target.cuda_arch:
        return None
    return (
        f"GPU compute capability {capability_text(capability)} is not one target {target.id} is "
        f"built for ({', '.join(target.cuda_arch)}): use the image of the matching target"
    )


def expected_for(target: Target, capability: tuple[int, int] | None) -> Expected:
    """The backends the log must name for `target` on a GPU of `capability` (None: unknown).

    The b12x indexer runs when the target's env enables it and the GPU is sm_12x; everything
    else scores the indexer with vLLM's bundled DeepGEMM.
    """
    b12x = target.env.get(B12X_ENV) == "1" and (capability is None or capability[0] == B12X_MAJOR)
    return Expected(
        attention_backend=target.attention_backend,
        indexer_backend=target.indexer_backend,
        indexer_kernels="b12x" if b12x else "deepgemm",
        kv_cache_dtype=target.kv_cache_dtype,
    )


def backend_problems(log: str, expected: Expected) -> list[str]:
    """Every way the server log disagrees with `expected` (empty: it names all three)."""
    problems = []
    attention = sorted(set(ATTENTION_LOG.findall(log)))
    if attention != [expected.attention_backend]:
        problems.append(
            f"attention backend: expected {expected.attention_backend}, log names "
            f"{', '.join(attention) or 'none'}"
        )
    if not re.search(rf"\b{re.escape(expected.indexer_backend)}\b", log):
        problems.append(f"indexer backend: expected {expected.indexer_backend}, not named in the log")
    kernels = sorted(set(INDEXER_KERNELS_LOG.findall(log)))
    if kernels != [expected.indexer_kernels]:
        problems.append(
            f"indexer kernels: expected 'DSA sparse indexer kernels: {expected.indexer_kernels}', "
            f"log says {', '.join(kernels) or 'nothing (is the overlay installed?)'}"
        )
    return problems
