#!/usr/bin/env bash
# Make pip's CUDA toolkit tree (site-packages/nvidia/cu13) usable as CUDA_HOME: the three
# links FlashInfer's and DeepGEMM's JIT expect of a classic toolkit. Used by the image's
# deps stage and by the GPU session's toolchain phase (scripts/gpu_validation.py toolchain).
#   link_cuda_toolkit.sh CUDA_HOME LIBCUDA_SO1
# LIBCUDA_SO1 is the driver's libcuda.so.1; in the image it dangles until the NVIDIA
# container runtime mounts the driver at run time.
set -euo pipefail
cuda_home=${1:?usage: link_cuda_toolkit.sh CUDA_HOME LIBCUDA_SO1}
libcuda=${2:?usage: link_cuda_toolkit.sh CUDA_HOME LIBCUDA_SO1}
for f in bin/nvcc lib/libcudart.so.13 include/cuda_runtime.h include/curand.h; do
  [[ -e "$cuda_home/$f" ]] || {
    echo "pip's CUDA toolkit lacks $cuda_home/$f; check the [cuda] pins in the recipe and its lock" >&2
    exit 1
  }
done
ln -s lib "$cuda_home/lib64"
ln -s libcudart.so.13 "$cuda_home/lib/libcudart.so"
mkdir -p "$cuda_home/lib/stubs"
ln -s "$libcuda" "$cuda_home/lib/stubs/libcuda.so"
