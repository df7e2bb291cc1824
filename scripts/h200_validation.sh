#!/usr/bin/env bash
# The H200 validation run of the overlay against stock vLLM 0.24.0, in two phases
# (each fits one 10-minute device call; /tmp carries state between them):
#
#   install  reassemble the staged wheels, install stock vLLM 0.24.0 into
#            /tmp/site-stock, copy it to /tmp/site-overlay and apply our overlay
#            there with our tool, verify, make the tiny GLM-5; then run the
#            indexer metadata probe on both (equivalence, syncs,
#            block-table width, b12x metadata path) and compare.
#   prepare  the install phase without the probes (to serve on a fresh machine).
#   hosttime build() host time, stock and overlay interleaved in one process.
#   toolchain the smoke test with the image's pip CUDA toolkit as the only toolkit.
#   serve    stock twice and the overlay once, served side by side
#            (token equivalence, JIT during inference).
#   smoke    the smoke test's local runtime against the overlay.
#   mtp      stock vs overlay served with MTP, 1 and 3 speculative tokens (native
#            and flattened indexer decode paths), CUDA graphs on.
#   longctx  stock vs overlay at max_model_len 65536, prompts of 20k-65k tokens,
#            bf16 and fp8 (fp8_ds_mla) KV cache.
#   deploy   stock vs overlay: fp8 KV at 8k, and 65536 + fp8 KV + MTP 3 together.
#   warmstart  start-to-healthy with empty / warm caches, the first 3,000-token
#            request with and without the warm-up (WARMSTART_STEPS, two calls).
#   bench    the paired benchmark (scripts/bench.py run; BENCH_ARGS, BENCH_LABEL).
#   b12x     the overlay's b12x path with b12x's kernels emulated (emulation/, validation
#            only): exact top-k against a dense reference per case, the emulation against
#            the b12x wheel's references, the locked workspace, the self-test's b12x branch.
#   selftest dsa_image.selftest with this GPU's DeepGEMM kernels, its refusal of b12x here,
#            and a deliberately broken kernel (exits 0, 4 and 1).
#   b12xserve  the tiny GLM-5 served on the emulated b12x path beside stock (DeepGEMM),
#            CUDA graphs on: health, errors, tokens, selections explained.
#   cluster  stock vs overlay on both GPUs, CUDA graphs on, per layout of CLUSTER_LAYOUTS
#            (mp-tp2, mp-pp2, ray1-tp2, ray2-tp2, ray2-pp2; waves separated by spaces, `+`
#            for layouts started together, LAYOUT@shared for the IndexError control): health,
#            Ray nodes and where the workers ran, tokens; then the comparison over every run in
#            /tmp/results/cluster (cluster.json, cluster.md). CLUSTER_DEADLINE_S (default 540)
#            bounds the phase; CLUSTER_ARGS adds options of `cluster run` (e.g. --timeout,
#            --gpu-memory-utilization). Needs the prepare phase (with Ray) first.
#
# Wheels arrive split (scripts/stage_h200_wheels.py) in /tmp/stage. Results go
# to $OUT (as one tarball plus the summaries: $OUT keeps at most 8 files).
# Usage: bash scripts/h200_validation.sh PHASE (one of the above)
set -uo pipefail
phase=${1:?usage: h200_validation.sh prepare|install|serve|hosttime|toolchain|smoke|mtp|longctx|deploy|warmstart|bench|b12x|selftest|b12xserve|cluster}
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-/tmp/out}
results=${RESULTS_DIR:-/tmp/results}
mkdir -p "$results" "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export VLLM_DISABLE_COMPILE_CACHE=1

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

environment() {
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
    python3 -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
    # The device's copy of the repository carries no reliable git state: name the overlay
    # by its manifest (which hashes every overlaid file).
    echo "overlay manifest sha256 $(sha256sum "$repo/overlay/vllm-0.24.0/manifest.json" | cut -d' ' -f1)"
  } > "$results/environment.txt" 2>&1
  cat "$results/environment.txt"
}

install() {
  log "reassembling wheels"
  mkdir -p /tmp/wheels
  (cd /tmp/stage && cat bundle.tar.part* > bundle.tar && sha256sum -c SHA256SUMS) || exit 1
  tar -xf /tmp/stage/bundle.tar -C /tmp/wheels
  log "installing stock vLLM into /tmp/site-stock"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-stock /tmp/wheels/*.whl \
    > "$results/pip-install.log" 2>&1 || { tail -20 "$results/pip-install.log"; exit 1; }
  cp -a /tmp/site-stock /tmp/site-overlay
  log "applying the overlay with our tool"
  python3 "$repo/scripts/overlay.py" apply --vllm 0.24.0 --site-packages /tmp/site-overlay \
    2>&1 | tee "$results/overlay-apply.log" || exit 1
  cp /tmp/site-overlay/vllm_overlay_receipt.json "$results/"
  (cd /tmp && PYTHONPATH=/tmp/site-overlay python3 "$repo/scripts/overlay.py" verify --vllm 0.24.0 \
    --site-packages /tmp/site-overlay) 2>&1 | tee "$results/overlay-verify.log" || exit 1
  python3 "$repo/scripts/make_tiny_model.py" /tmp/tiny-glm5 > /dev/null
}

probes() {
  log "indexer probe: stock"
  (cd /tmp && PYTHONPATH="/tmp/site-stock:$repo" python3 -m dsa_image.validation.indexer_probe \
    --model /tmp/tiny-glm5 --out "$results/probe-stock.pt") > "$results/probe-stock.log" 2>&1
  tail -5 "$results/probe-stock.log"
  log "indexer probe: overlay"
  # pip --target does not run .pth files: cutlass (for b12x) is put on the path by hand.
  (cd /tmp && PYTHONPATH="/tmp/site-overlay:/tmp/site-overlay/nvidia_cutlass_dsl/python_packages:$repo" \
    python3 -m dsa_image.validation.indexer_probe \
    --model /tmp/tiny-glm5 --out "$results/probe-overlay.pt" --overlay-checks) \
    > "$results/probe-overlay.log" 2>&1
  tail -5 "$results/probe-overlay.log"
  (cd /tmp && PYTHONPATH="/tmp/site-overlay:$repo" python3 -m dsa_image.validation.compare \
    "$results/probe-stock.pt" "$results/probe-overlay.pt" --json "$results/metadata-equivalence.json") \
    2>&1 | tee "$results/metadata-equivalence.txt"
}

serve() {
  log "serving equivalence: stock, stock, overlay, side by side"
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.serving --model /tmp/tiny-glm5 \
    --stock-site /tmp/site-stock --overlay-site /tmp/site-overlay --out "$results/serving" --timeout 420) \
    > "$results/serving.log" 2>&1
  echo "serving exit: $?" | tee -a "$results/serving.log"
  tail -40 "$results/serving.log"
}

hosttime() {
  log "host time of build(): stock and overlay in one process, interleaved"
  (cd /tmp && PYTHONPATH="/tmp/site-overlay:/tmp/site-overlay/nvidia_cutlass_dsl/python_packages:$repo" \
    python3 -m dsa_image.validation.host_time --overlay-checks \
    --model /tmp/tiny-glm5 --json "$results/host-time.json" \
    --stock-indexer /tmp/site-stock/vllm/v1/attention/backends/mla/indexer.py) \
    2>&1 | tee "$results/host-time.log" | grep -v "^INFO\|WARNING"
  cp "$results/host-time.json" "$out/"
}

toolchain() {
  # The image's CUDA toolkit is pip's (the recipe's [cuda] pins) made usable by the same
  # link script the Dockerfile runs. Serve the overlay with only that toolkit: CUDA_HOME
  # there, the system CUDA off PATH, empty JIT caches, so DeepGEMM and FlashInfer compile
  # every kernel with it.
  log "toolchain: the image's pip CUDA toolkit under the smoke test"
  rm -rf /tmp/cuda-pip /tmp/home-toolchain
  # shellcheck disable=SC2046  # split on purpose: one wheel glob per recipe pin
  python3 -m pip install -q --no-index --no-deps --target /tmp/cuda-pip \
    $(python3 "$repo/scripts/recipe.py" get cuda.toolkit | sed 's/==.*//; s/-/_/g; s#^#/tmp/wheels/#; s#$#-*.whl#') || exit 1
  local cuda_home=/tmp/cuda-pip/nvidia/cu13
  bash "$repo/scripts/link_cuda_toolkit.sh" "$cuda_home" "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" || exit 1
  "$cuda_home/bin/nvcc" --version | tee "$results/toolchain-nvcc.txt"
  mkdir -p /tmp/home-toolchain
  (cd /tmp && HOME=/tmp/home-toolchain CUDA_HOME="$cuda_home" \
    PATH="$cuda_home/bin:$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:)" \
    DG_JIT_CACHE_DIR=/tmp/home-toolchain/deep_gemm DG_JIT_PRINT_COMPILER_COMMAND=1 \
    python3 "$repo/scripts/smoke.py" --runtime local \
    --python python3 --site-packages /tmp/site-overlay --target sm90 --out "$results/toolchain" --quiet \
    -- --enforce-eager --gpu-memory-utilization 0.12) > "$results/toolchain.log" 2>&1
  echo "toolchain smoke exit: $?" | tee -a "$results/toolchain.log"
  # Which compiler built the kernels: DeepGEMM prints each command (DG_JIT_PRINT_COMPILER_COMMAND).
  grep -o '[^ ]*/nvcc ' "$results/toolchain/server.log" | sort | uniq -c | tee "$results/toolchain-compilers.txt"
  ls -R /tmp/home-toolchain/deep_gemm 2>/dev/null | head -20 | tee -a "$results/toolchain.log"
  tail -15 "$results/toolchain.log"
}

smoke() {
  log "smoke test, local runtime, overlay"
  (cd /tmp && python3 "$repo/scripts/smoke.py" --runtime local --python python3 \
    --site-packages /tmp/site-overlay --target sm90 --out "$results/smoke" --quiet \
    -- --enforce-eager --gpu-memory-utilization 0.12) > "$results/smoke.log" 2>&1
  echo "smoke exit: $?" | tee -a "$results/smoke.log"
  tail -30 "$results/smoke.log"
}

# The tiny GLM-5 with its MTP layer, for the MTP modes and the MTP benchmark.
mtp_model() {
  [ -d /tmp/tiny-glm5-mtp ] || PYTHONPATH="$repo" python3 -c 'import sys; from pathlib import Path
from dsa_image.tiny_model import MTP_CONFIG, write_model
write_model(Path(sys.argv[1]), MTP_CONFIG)' /tmp/tiny-glm5-mtp || exit 1
}

# mtp, longctx, deploy: four servers each (two modes), started together; CUDA graphs on.
modes() {
  local name=$1 list=$2
  log "serving modes $list: stock vs overlay, side by side"
  mtp_model
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.serving_modes --modes "$list" \
    --model /tmp/tiny-glm5 --mtp-model /tmp/tiny-glm5-mtp \
    --stock-site /tmp/site-stock --overlay-site /tmp/site-overlay --out "$results/$name" --timeout 480) \
    > "$results/$name.log" 2>&1
  echo "$name exit: $?" | tee -a "$results/$name.log"
  grep -E "PASS|FAIL|error" "$results/$name.log" | tail -20
  cp "$results/$name/serving-modes.json" "$out/$name-serving-modes.json" 2>/dev/null
  rm -rf "$results/$name/work"  # the servers' compile caches: not results
}

# Compile caches are the subject here: the image keeps vLLM's, so this phase does too.
warmstart() {
  local steps=${WARMSTART_STEPS:-cold,warm-warmup}
  log "warm start: steps $steps, stock and overlay side by side"
  (cd /tmp && env -u VLLM_DISABLE_COMPILE_CACHE PYTHONPATH="$repo" python3 -m dsa_image.validation.warmstart \
    --model /tmp/tiny-glm5 --stock-site /tmp/site-stock --overlay-site /tmp/site-overlay \
    --out "$results/warmstart" --work-dir /tmp/warmstart-homes --steps "$steps") \
    > "$results/warmstart-$steps.log" 2>&1
  echo "warmstart exit: $?" | tee -a "$results/warmstart-$steps.log"
  tail -12 "$results/warmstart-$steps.log"
  cp "$results/warmstart/warmstart.json" "$out/warmstart-${steps//,/+}.json"
}

# BENCH_ARGS picks workloads and round counts (scripts/bench.py plan shows them); the servers'
# HOMEs stay in /tmp/bench-work, so a second call of the same group starts warm.
bench() {
  local label=${BENCH_LABEL:-bench}
  log "benchmark $label: ${BENCH_ARGS:-all workloads}"
  mtp_model
  # shellcheck disable=SC2086  # BENCH_ARGS is split on purpose
  (cd /tmp && env -u VLLM_DISABLE_COMPILE_CACHE python3 "$repo/scripts/bench.py" run \
    --a-site /tmp/site-stock --b-site /tmp/site-overlay --a-name stock --b-name overlay \
    --model /tmp/tiny-glm5 --mtp-model /tmp/tiny-glm5-mtp --work-dir /tmp/bench-work \
    --out "$results/$label" --deadline-s "${BENCH_DEADLINE_S:-520}" ${BENCH_ARGS:-}) \
    > "$results/$label.log" 2>&1
  echo "bench exit: $?" | tee -a "$results/$label.log"
  tail -25 "$results/$label.log"
  cp "$results/$label/results.json" "$out/$label-results.json"
}

# emulation/ first on PYTHONPATH: `import b12x` finds the emulation; the b12x wheel stays
# installed in the site (the overlay's start-up check reads its release).
b12x() {
  log "b12x path, emulated kernels: glue exactness and cross-checks"
  (cd /tmp && PYTHONPATH="$repo/emulation:/tmp/site-overlay:$repo" python3 -m dsa_image.validation.b12x_glue \
    --model /tmp/tiny-glm5 --json "$results/b12x-glue.json") > "$results/b12x-glue.log" 2>&1
  echo "b12x glue exit: $?" | tee -a "$results/b12x-glue.log"
  grep -v "compute-capability check bypassed\|^INFO\|^WARNING\|^DEBUG" "$results/b12x-glue.log" | tail -70
  cp "$results/b12x-glue.json" "$out/"
}

selftest() {
  log "self-test: this GPU's kernels, the b12x refusal, a broken kernel"
  local step
  for step in "auto:" "refusal:--kernels b12x" "broken:--break prefill-long"; do
    # shellcheck disable=SC2086  # the step's arguments are split on purpose
    (cd /tmp && PYTHONPATH="/tmp/site-overlay:$repo" python3 -m dsa_image.selftest ${step#*:} \
      --json "$results/selftest-${step%%:*}.json") > "$results/selftest-${step%%:*}.txt" 2>&1
    echo "selftest ${step%%:*} exit: $?" | tee -a "$results/selftest-${step%%:*}.txt"
    grep -v "^INFO\|^WARNING\|^DEBUG" "$results/selftest-${step%%:*}.txt" | tail -12
    cp "$results/selftest-${step%%:*}.txt" "$out/"
  done
}

b12xserve() {
  log "serving on the emulated b12x path beside stock, CUDA graphs on"
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.b12x_serving --model /tmp/tiny-glm5 \
    --stock-site /tmp/site-stock --overlay-site /tmp/site-overlay --emulation "$repo/emulation" \
    --repo "$repo" --out "$results/b12xserve" --timeout 480) > "$results/b12xserve.log" 2>&1
  echo "b12xserve exit: $?" | tee -a "$results/b12xserve.log"
  tail -60 "$results/b12xserve.log"
  cp "$results/b12xserve/serving-b12x.json" "$out/" 2>/dev/null
}

# The cluster phase's inputs, before anything starts: a missing one stops it (exit 3) saying what.
cluster_inputs() {
  [ -n "${CLUSTER_LAYOUTS:-}" ] || {
    echo "cluster: expected CLUSTER_LAYOUTS, e.g. \"mp-tp2+ray1-tp2\" or \"ray2-tp2+ray2-tp2@shared ray2-pp2+mp-pp2\";" \
      "python3 -m dsa_image.validation.cluster plan --layouts ... prints what each starts" >&2
    exit 2
  }
  local root=${CLUSTER_SITES_ROOT:-/tmp} missing=() f
  for f in "$root/site-stock/vllm/__init__.py" "$root/site-stock/ray/__init__.py" \
           "$root/site-overlay/vllm_overlay_receipt.json" "$root/site-overlay/ray/__init__.py" \
           "$root/tiny-glm5/config.json"; do
    [ -e "$f" ] || missing+=("$f")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "cluster: expected stock vLLM and Ray in $root/site-stock, the overlaid copy in $root/site-overlay" \
      "and the tiny GLM-5 in $root/tiny-glm5; missing: ${missing[*]}; run the prepare phase first" \
      "(its staged wheels must hold Ray, the recipe's [cluster] pin)" >&2
    exit 3
  fi
}

# Stock and overlay side by side per layout; the harness stops every process and namespace it
# started (also on SIGTERM); `timeout` guards a hang, `cleanup` catches what a kill left.
cluster() {
  local root=${CLUSTER_SITES_ROOT:-/tmp} budget=${CLUSTER_DEADLINE_S:-540} dir="$results/cluster"
  log "cluster: $CLUSTER_LAYOUTS, stock vs overlay side by side, within $budget s"
  (cd /tmp && PYTHONPATH="$repo" timeout -k 20 $((budget - 20)) python3 -m dsa_image.validation.cluster run \
    --layouts "$CLUSTER_LAYOUTS" --model "$root/tiny-glm5" --stock-site "$root/site-stock" \
    --overlay-site "$root/site-overlay" --out "$dir" --deadline-s $((budget - 50)) ${CLUSTER_ARGS:-}) \
    > "$results/cluster-run.log" 2>&1
  echo "cluster run exit: $?" | tee -a "$results/cluster-run.log"
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.cluster cleanup) >> "$results/cluster-run.log" 2>&1
  grep -E '"(netns|mountns|shared|detail|ray[12]-[tp]p2[^"]*)": |as expected|CLUSTER|refused|Traceback' \
    "$results/cluster-run.log" | tail -30
  # Every run in $dir, this call's and an earlier call's on the same machine.
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.cluster compare --out "$dir" "$dir") \
    > "$results/cluster-compare.log" 2>&1
  echo "cluster compare exit: $?" | tee -a "$results/cluster-compare.log"
  grep -E "^\| |^Overall|COMPARISON" "$results/cluster-compare.log" | head -20
  cp "$dir/cluster.json" "$dir/cluster.md" "$out/" 2>/dev/null
  cp "$results/environment.txt" "$out/cluster-environment.txt" 2>/dev/null
  tar -czf "$out/cluster-logs.tgz" -C "$results" cluster cluster-run.log cluster-compare.log 2>/dev/null
  ls -la "$out"
}

collect() {
  for f in metadata-equivalence.json metadata-equivalence.txt serving/serving-equivalence.json \
           smoke/smoke-report.json toolchain/smoke-report.json toolchain-compilers.txt environment.txt; do
    [ -f "$results/$f" ] && cp "$results/$f" "$out/$phase-$(basename "$f")"
  done
  tar -czf "$out/$phase-results.tgz" -C "$results" --exclude='*.pt' . 2>/dev/null
  # shellcheck disable=SC2046  # split on purpose: the probe files, names without spaces
  tar -czf "$out/$phase-probes.tgz" -C "$results" $(cd "$results" && ls -- *.pt 2>/dev/null) 2>/dev/null
  ls -la "$out"
}

case $phase in
  install) environment; install; probes; collect ;;
  prepare) environment; install; collect ;;
  hosttime) hosttime ;;
  toolchain) environment; toolchain; collect ;;
  serve) environment; serve; collect ;;
  smoke) environment; smoke; collect ;;
  mtp) environment; modes mtp mtp1,mtp3; collect ;;
  longctx) environment; modes longctx long-bf16,long-fp8; collect ;;
  deploy) environment; modes deploy fp8,long-fp8-mtp3; collect ;;
  warmstart) environment; warmstart; collect ;;
  bench) environment; bench; collect ;;
  b12x) environment; b12x; collect ;;
  selftest) environment; selftest; collect ;;
  b12xserve) environment; b12xserve; collect ;;
  cluster) cluster_inputs; environment; cluster ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
