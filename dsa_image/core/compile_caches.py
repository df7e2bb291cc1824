"""Where every run-time compile cache lives: one directory under HOME.

The image sets these (Dockerfile, runtime stage: HOME=/home/vllm, one named volume keeps them
across restarts) and the GPU validation gives each server the same layout under its own HOME,
so what the validation measures about caches (a warm start, a cold one) is what the image does.
Left to their defaults, Inductor (/tmp/torchinductor_<user>), the CUDA driver's PTX cache (~/.nv)
and CuTe DSL (/tmp/.../cutlass_python_cache) would live outside HOME/.cache; FlashInfer's JIT
goes to FLASHINFER_WORKSPACE_BASE/.cache/flashinfer. The DeepGEMM cache must not be HOME/deep_gemm:
`python -m` puts the working directory first on sys.path, and a HOME/deep_gemm directory there
imports as an empty namespace package before vLLM's bundled DeepGEMM ("DeepGEMM backend is
unavailable", H200, 2026-11-30).
"""

from __future__ import annotations


def cache_env(home: str) -> dict[str, str]:
    """The compile-cache variables for a process whose HOME is `home`."""
    cache = f"{home}/.cache"
    return {
        "XDG_CACHE_HOME": cache,
        "VLLM_CACHE_ROOT": f"{cache}/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{cache}/torchinductor",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "CUDA_CACHE_PATH": f"{cache}/nv/ComputeCache",
        "FLASHINFER_WORKSPACE_BASE": home,
        "DG_JIT_CACHE_DIR": f"{cache}/deep_gemm",
        "CUTE_DSL_CACHE_DIR": f"{cache}/cute_dsl",
    }
