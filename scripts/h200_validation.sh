#!/usr/bin/env bash
# The H200 validation run of the overlay against stock vLLM, for one base (a vLLM release of the
# recipe: VLLM=X.Y.Z, default the recipe's default), in phases (each fits one 10-minute device
# call; /tmp (WORK_ROOT) carries state between them, per base: /tmp/stage-X.Y.Z,
# /tmp/wheels-X.Y.Z, /tmp/site-stock-X.Y.Z, /tmp/site-overlay-X.Y.Z, /tmp/results-X.Y.Z):
#
#   paths    print the base and the paths above, change nothing (no GPU needed).
#   receive  move the parts this call carried into /tmp/stage-X.Y.Z, check each against
#            SHA256SUMS, say how many of how many are there (no GPU needed).
#   inventory  record the H200's `pip list` (h200-pip-freeze.txt), list how it differs from
#            the committed record staging used (docs/validation/h200-pip-freeze.txt), and check
#            that the staged bundle and the H200 together hold every pin of the base
#            (dsa_image/validation/stage.py); exit 1 says what to stage. The first call of a
#            session, with the first part.
#   install  reassemble the staged wheels, install stock vLLM into the stock site, copy it to
#            the overlay site and apply the base's overlay there with our tool, verify, check
#            which torch and CUDA libraries the site loads (torch_libs), make the tiny GLM-5;
#            then run the indexer metadata probe on both (equivalence, syncs, block-table
#            width, b12x metadata path) and compare; last, make the model info the image
#            ships, per side (model_infos).
#   prepare  the install phase without the probes (to serve on a fresh machine).
#            Both make the model info in /tmp/model-info-X.Y.Z: the mtp, longctx, deploy,
#            warmstart, bench and cluster servers start from the entries there (made once a
#            machine per side and model), as from the image's first docker run.
#   sites    the install phase alone: the two sites, verified, and the tiny GLM-5, no model
#            info (for the bench phase, which makes its builds' own, e.g. BENCH_A=overlay-0.24.0
#            beside VLLM=0.33.0).
#   upstream vLLM's own tests that import an overlaid module (scripts/upstream_tests.py gate,
#            docs/upstream-tests.md): each selected file on stock and on the overlay, the two
#            at once on the one GPU, compared test by test; "0 regressions" and exit 0 when
#            every file ran on both. The bundle comes with the call (UPSTREAM_BUNDLE, default
#            build/upstream-tests-X.Y.Z of the device's copy: made here by `python3
#            scripts/upstream_tests.py bundle --vllm X.Y.Z --python-version 3.12 --out
#            build/upstream-tests-X.Y.Z`, carried). No file starts after UPSTREAM_DEADLINE_S
#            (default 120) and none runs past UPSTREAM_TIMEOUT_S (default 420); a later call
#            resumes (exit 3 until every file has run). Needs `sites` first.
#   hosttime build() host time, stock and overlay interleaved in one process.
#   toolchain the smoke test with the image's pip CUDA toolkit as the only toolkit.
#   serve    stock twice and the overlay once, served side by side, CUDA graphs on
#            (token equivalence, JIT during inference).
#   smoke    the smoke test's local runtime against the overlay, CUDA graphs on (SMOKE_ARGS,
#            SMOKE_LABEL: e.g. TP=2 over Ray on two GPUs).
#   mtp      stock vs overlay served with MTP, CUDA graphs on, on both indexer decode paths
#            (mtp, longctx, deploy: MODES_TIMEOUT_S, default 480, for the servers to be healthy):
#            1 and 3 speculative tokens on 0.24.0 (native, flattened), 2 and 3 on 0.33.0
#            (flattened, native: 0.33.0 takes next_n=4 natively on sm_90).
#   longctx  stock vs overlay at max_model_len 65536, prompts of 20k-65k tokens,
#            bf16 and fp8 (fp8_ds_mla) KV cache.
#   deploy   stock vs overlay: fp8 KV at 8k, and 65536 + fp8 KV + MTP 3 together.
#   warmstart  start-to-healthy with empty / warm caches, the first 3,000-token
#            request with and without the warm-up (WARMSTART_STEPS, comma-separated: cold,
#            warm-warmup, cold-warmup, warm; on 0.33.0 a cold step took a 242 s call and a warm
#            one 98 s: a cold and a warm step fit one call).
#   startup  start-up before/after the image's precompiled FlashInfer modules and start-up
#            defaults, the overlay alone, one server at a time: cold and restart each, per
#            phase (dsa_image.validation.startup; ~9 min on the H200, one call, 560 s at most).
#   bench    the paired benchmark (scripts/bench.py run; BENCH_ARGS, BENCH_LABEL; BENCH_A and
#            BENCH_B for builds other than this base's stock and overlay, e.g. two bases).
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
#            the results' cluster/ (cluster.json, cluster.md). CLUSTER_DEADLINE_S (default 540)
#            bounds the phase; CLUSTER_ARGS adds options of `cluster run` (e.g. --timeout,
#            --gpu-memory-utilization). Needs the prepare phase (with Ray) first.
#
# Wheels: `python3 scripts/stage_h200_wheels.py --vllm X.Y.Z` here writes .stage/vllm-X.Y.Z/
# (bundle.tar.partNN, SHA256SUMS, selection.txt); one device call per part, carrying that part
# (and SHA256SUMS + selection.txt with the first), each running
#   VLLM=X.Y.Z bash scripts/h200_validation.sh receive
# A base whose torch is not the H200's (0.33.0: torch 2.14.0) brings torch and its CUDA
# libraries in the bundle; the site comes first on PYTHONPATH, so they shadow the H200's
# (install checks that they do). Results go to $OUT (the summaries, and one tarball).
#
# A session's calls, with their device seconds (the vLLM 0.33.0 proof in one session):
# docs/validation/README.md.
#
# Usage: [VLLM=X.Y.Z] bash scripts/h200_validation.sh PHASE (one of the above)
set -uo pipefail
phase=${1:?usage: [VLLM=X.Y.Z] h200_validation.sh paths|receive|inventory|prepare|sites|install|upstream|serve|hosttime|toolchain|smoke|mtp|longctx|deploy|warmstart|startup|bench|b12x|selftest|b12xserve|cluster}
repo=$(cd "$(dirname "$0")/.." && pwd)
vllm=${VLLM:-$(python3 "$repo/scripts/recipe.py" get vllm.default)} || exit 2
python3 "$repo/scripts/recipe.py" get --vllm "$vllm" vllm.version > /dev/null || {
  echo "VLLM=$vllm: expected one of the recipe's bases: $(python3 "$repo/scripts/recipe.py" get vllm.versions | paste -sd' ')" >&2
  exit 2
}
# Everything a base installs or writes is named after it: two bases can share a machine.
root=${WORK_ROOT:-/tmp}
stage=$root/stage-$vllm
wheels=$root/wheels-$vllm
site_stock=$root/site-stock-$vllm
site_overlay=$root/site-overlay-$vllm
model=$root/tiny-glm5  # written from the repository alone: the same for every base
cuda_pip=$root/cuda-pip-$vllm toolchain_home=$root/home-toolchain-$vllm
bench_work=$root/bench-work-$vllm warmstart_homes=$root/warmstart-homes-$vllm
model_info=$root/model-info-$vllm
manifest=$repo/overlay/vllm-$vllm/manifest.json
out=${OUT:-/tmp/out}
results=${RESULTS_DIR:-$root/results-$vllm}
if [ "$phase" = paths ]; then
  printf '%s=%s\n' vllm "$vllm" stage "$stage" wheels "$wheels" site_stock "$site_stock" \
    site_overlay "$site_overlay" model "$model" manifest "$manifest" results "$results"
  exit 0
fi
mkdir -p "$results" "$out"
# These GPUs are shared: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM, and FlashInfer's
# all-reduce (vLLM 0.33.0's default, GLM-5's fused all-reduce + RMSNorm) takes its TRT-LLM
# workspace, which creates no multicast object (its MNNVL one calls cuMulticastCreate). The
# cluster phase sets its own per layout (dsa_image/validation/cluster.py, ALLREDUCE_GUARD).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm
export VLLM_DISABLE_COMPILE_CACHE=1

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# PYTHONPATH for a `pip install --target` site: the site and the CuTe DSL packages its .pth
# would add (pip --target runs none; vLLM 0.33.0's GLM-5 attention imports `cutlass`).
site_path() {
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.site_path "$1")
}

environment() {
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
    echo "vLLM base $vllm; sites $site_stock, $site_overlay"
    # What the runs import: the stock site first on PYTHONPATH (its torch, where it has one).
    (cd /tmp && PYTHONPATH="$site_stock" python3 -c 'import sys, torch, triton
print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "torch from", torch.__file__)')
    # The device's copy of the repository carries no reliable git state: name the overlay
    # by its manifest (which hashes every overlaid file).
    echo "overlay manifest sha256 $(sha256sum "$manifest" | cut -d' ' -f1)"
  } > "$results/environment.txt" 2>&1
  cat "$results/environment.txt"
}

# The H200's own packages (its venv, no site on the path), and what they mean for this base.
inventory() {
  log "inventory: the H200's Python against vLLM $vllm's locks and the staged bundle"
  env -u PYTHONPATH python3 -m pip list --format=freeze > "$results/h200-pip-freeze.txt" || exit 1
  cp "$results/h200-pip-freeze.txt" "$results/environment.txt" "$out/"
  local staged=()
  [ -f "$stage/selection.txt" ] && staged=(--staged "$stage/selection.txt")
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.stage --vllm "$vllm" \
    --check-freeze "$results/h200-pip-freeze.txt" ${staged[@]+"${staged[@]}"}) > "$results/inventory.txt" 2>&1
  local status=$?
  cat "$results/inventory.txt"
  cp "$results/inventory.txt" "$out/"
  return $status
}

# What this call carried (.stage/vllm-X.Y.Z/ of the device's copy of the repository) moves to
# the stage directory: moved, not copied, so a part is not copied again by every later call.
# Each part is checked as it arrives; the count says how many are still to come.
receive() {
  local from="$repo/.stage/vllm-$vllm" total here arrived=()
  mkdir -p "$stage"
  if compgen -G "$from/*" > /dev/null; then
    arrived=("$from"/*) && arrived=("${arrived[@]##*/}")
    mv "$from"/* "$stage"/ || exit 1
  fi
  [ -f "$stage/SHA256SUMS" ] || {
    echo "receive: expected $stage/SHA256SUMS; carry .stage/vllm-$vllm/SHA256SUMS and selection.txt" \
      "(with the first part)" >&2
    exit 1
  }
  # Only what this call carried is hashed: the earlier parts were checked when they arrived
  # (hashing all of them every call made the transfer quadratic: 3 s a call by part 45).
  local sums
  sums=$(cd "$stage" && grep -F -f <(printf '  %s\n' "${arrived[@]}" 'no part arrived') SHA256SUMS)
  [ -z "$sums" ] || (cd "$stage" && sha256sum --quiet -c - <<< "$sums") || {
    echo "receive: a part differs from SHA256SUMS (above); carry it again" >&2
    exit 1
  }
  total=$(grep -c 'bundle\.tar\.part' "$stage/SHA256SUMS")
  here=$(find "$stage" -maxdepth 1 -name 'bundle.tar.part*' | wc -l)
  log "received: $here of $total parts in $stage"
}

# The parts, then the bundle, are removed once used: a 4 GB bundle is on disk once at a time.
# A second install of the same base on this machine reuses the unpacked wheels.
unpack() {
  [ -f "$wheels/.complete" ] && return 0
  log "reassembling the staged wheels in $stage"
  (cd "$stage" && cat bundle.tar.part* > bundle.tar && sha256sum -c SHA256SUMS) || {
    echo "expected every part of \`python3 scripts/stage_h200_wheels.py --vllm $vllm\` in $stage" \
      "(SHA256SUMS and selection.txt with them); carry the missing ones" >&2
    exit 1
  }
  rm -f "$stage"/bundle.tar.part*
  rm -rf "$wheels" && mkdir -p "$wheels" && tar -xf "$stage/bundle.tar" -C "$wheels" || exit 1
  rm -f "$stage/bundle.tar"
  touch "$wheels/.complete"
}

install() {
  unpack
  log "installing stock vLLM $vllm into $site_stock"
  rm -rf "$site_stock" "$site_overlay"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site_stock" "$wheels"/*.whl \
    > "$results/pip-install.log" 2>&1 || { tail -20 "$results/pip-install.log"; exit 1; }
  torch_libs
  cp -a "$site_stock" "$site_overlay"
  log "applying the overlay with our tool"
  python3 "$repo/scripts/overlay.py" apply --vllm "$vllm" --site-packages "$site_overlay" \
    2>&1 | tee "$results/overlay-apply.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  cp "$site_overlay/vllm_overlay_receipt.json" "$results/"
  (cd /tmp && PYTHONPATH="$site_overlay" python3 "$repo/scripts/overlay.py" verify --vllm "$vllm" \
    --site-packages "$site_overlay") 2>&1 | tee "$results/overlay-verify.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
  [ -d "$model" ] || python3 "$repo/scripts/make_tiny_model.py" "$model" > /dev/null || exit 1
}

# Which torch and which CUDA libraries the site really loads (a base with its own torch must
# shadow the H200's torch 2.11.0 and its CUDA libraries entirely).
torch_libs() {
  log "torch and its CUDA libraries as $site_stock loads them"
  (cd /tmp && PYTHONPATH="$site_stock:$repo" python3 -m dsa_image.validation.torch_libs --vllm "$vllm" \
    --site "$site_stock") > "$results/torch-libs.txt" 2>&1
  local status=$?
  cat "$results/torch-libs.txt"
  [ $status -eq 0 ] || exit 1
}

probes() {
  local stock overlay
  stock=$(site_path "$site_stock") && overlay=$(site_path "$site_overlay") || exit 1
  log "indexer probe: stock"
  (cd /tmp && PYTHONPATH="$stock:$repo" python3 -m dsa_image.validation.indexer_probe \
    --model "$model" --out "$results/probe-stock.pt") > "$results/probe-stock.log" 2>&1
  tail -5 "$results/probe-stock.log"
  log "indexer probe: overlay"
  (cd /tmp && PYTHONPATH="$overlay:$repo" \
    python3 -m dsa_image.validation.indexer_probe \
    --model "$model" --out "$results/probe-overlay.pt" --overlay-checks) \
    > "$results/probe-overlay.log" 2>&1
  tail -5 "$results/probe-overlay.log"
  (cd /tmp && PYTHONPATH="$site_overlay:$repo" python3 -m dsa_image.validation.compare \
    "$results/probe-stock.pt" "$results/probe-overlay.pt" --json "$results/metadata-equivalence.json") \
    2>&1 | tee "$results/metadata-equivalence.txt"
}

serve() {
  log "serving equivalence: stock, stock, overlay, side by side"
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.serving --model "$model" \
    --stock-site "$site_stock" --overlay-site "$site_overlay" --out "$results/serving" --timeout 480) \
    > "$results/serving.log" 2>&1
  echo "serving exit: $?" | tee -a "$results/serving.log"
  tail -40 "$results/serving.log"
}

# Each call runs what is left (the results in $results/upstream-tests resume), then compares.
upstream() {
  local bundle=${UPSTREAM_BUNDLE:-$repo/build/upstream-tests-$vllm} dir="$results/upstream-tests" status
  log "upstream's tests: stock vs overlay, file by file, two at once ($bundle)"
  mkdir -p "$dir"
  (cd /tmp && python3 "$repo/scripts/upstream_tests.py" gate --bundle "$bundle" --out "$dir" \
    --python python3 --stock-site "$site_stock" --overlay-site "$site_overlay" --jobs 2 \
    --timeout "${UPSTREAM_TIMEOUT_S:-420}" --deadline-s "${UPSTREAM_DEADLINE_S:-120}" --json "$dir/compare.json") \
    > "$dir/compare.txt" 2> "$results/upstream-tests.log"
  status=$?
  echo "upstream exit: $status" | tee -a "$results/upstream-tests.log"
  tail -8 "$results/upstream-tests.log"
  cat "$dir/compare.txt"
  cp "$dir/compare.txt" "$dir/compare.json" "$out/" 2>/dev/null
  tar -czf "$out/upstream-tests.tgz" -C "$results" upstream-tests upstream-tests.log
  return $status
}

hosttime() {
  local overlay
  overlay=$(site_path "$site_overlay") || exit 1
  log "host time of build(): stock and overlay in one process, interleaved"
  (cd /tmp && PYTHONPATH="$overlay:$repo" \
    python3 -m dsa_image.validation.host_time --overlay-checks \
    --model "$model" --json "$results/host-time.json" \
    --stock-indexer "$site_stock"/vllm/v1/attention/backends/mla/indexer.py) \
    2>&1 | tee "$results/host-time.log" | grep -v "^INFO\|WARNING"
  cp "$results/host-time.json" "$out/"
}

toolchain() {
  # The image's CUDA toolkit is pip's (the recipe's [cuda] pins) made usable by the same
  # link script the Dockerfile runs. Serve the overlay with only that toolkit: CUDA_HOME
  # there, the system CUDA off PATH, empty JIT caches, so DeepGEMM and FlashInfer compile
  # every kernel with it.
  log "toolchain: the image's pip CUDA toolkit under the smoke test"
  rm -rf "$cuda_pip" "$toolchain_home"
  # The CUDA home is the toolkit's NVIDIA wheels; the base's other toolkit pins (cuda-python,
  # a binding pinned for the resolver) are not part of it, and may be the H200's own (unstaged).
  # shellcheck disable=SC2046  # split on purpose: one wheel glob per recipe pin
  python3 -m pip install -q --no-index --no-deps --target "$cuda_pip" \
    $(python3 "$repo/scripts/recipe.py" get --vllm "$vllm" cuda.toolkit | grep '^nvidia-' \
      | sed 's/==.*//; s/-/_/g; s#^#'"$wheels"'/#; s#$#-*.whl#') || exit 1
  local cuda_home="$cuda_pip/nvidia/cu13"
  bash "$repo/scripts/link_cuda_toolkit.sh" "$cuda_home" "$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')" || exit 1
  "$cuda_home/bin/nvcc" --version | tee "$results/toolchain-nvcc.txt"
  mkdir -p "$toolchain_home"
  (cd /tmp && HOME="$toolchain_home" CUDA_HOME="$cuda_home" \
    PATH="$cuda_home/bin:$(echo "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:)" \
    DG_JIT_CACHE_DIR="$toolchain_home/deep_gemm" DG_JIT_PRINT_COMPILER_COMMAND=1 \
    python3 "$repo/scripts/smoke.py" --runtime local \
    --python python3 --site-packages "$site_overlay" --target sm90 --out "$results/toolchain" --quiet \
    -- --gpu-memory-utilization 0.12) > "$results/toolchain.log" 2>&1
  echo "toolchain smoke exit: $?" | tee -a "$results/toolchain.log"
  # Which compiler built the kernels: DeepGEMM prints each command (DG_JIT_PRINT_COMPILER_COMMAND).
  grep -o '[^ ]*/nvcc ' "$results/toolchain/server.log" | sort | uniq -c | tee "$results/toolchain-compilers.txt"
  ls -R "$toolchain_home/deep_gemm" 2>/dev/null | head -20 | tee -a "$results/toolchain.log"
  tail -15 "$results/toolchain.log"
}

# SMOKE_ARGS: smoke.py's layout flags (e.g. --tensor-parallel-size 2
# --distributed-executor-backend ray on two GPUs); SMOKE_LABEL names the results (default smoke).
smoke() {
  local label=${SMOKE_LABEL:-smoke}
  log "smoke test, local runtime, overlay, CUDA graphs on ${SMOKE_ARGS:-}"
  # shellcheck disable=SC2086  # SMOKE_ARGS is a list of flags
  (cd /tmp && python3 "$repo/scripts/smoke.py" --runtime local --python python3 \
    --site-packages "$site_overlay" --target sm90 --out "$results/$label" --quiet ${SMOKE_ARGS:-} \
    -- --gpu-memory-utilization 0.12) > "$results/$label.log" 2>&1
  echo "$label exit: $?" | tee -a "$results/$label.log"
  tail -30 "$results/$label.log"
}

# The tiny GLM-5 with its MTP layer, for the MTP modes and the MTP benchmark.
mtp_model() {
  [ -d "$model-mtp" ] || PYTHONPATH="$repo" python3 -c 'import sys; from pathlib import Path
from dsa_image.tiny_model import MTP_CONFIG, write_model
write_model(Path(sys.argv[1]), MTP_CONFIG)' "$model-mtp" || exit 1
}

# The model info the image ships, made once per side and model while install has time to spare:
# the servers of later calls start as the image's do (a cold 0.33.0 server spent 42-44 s a class
# inspecting). The MTP model's entries serve the mode servers, the base model's the others.
model_infos() {
  log "model info as the image ships it, per side, into $model_info"
  mtp_model
  local mtp
  for mtp in "--mtp-model=$model-mtp" ""; do
    (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.serving_modes --model-info-only \
      --model "$model" ${mtp:+"$mtp"} --stock-site "$site_stock" --overlay-site "$site_overlay" \
      --model-info-root "$model_info" --out "$results/model-info" --vllm "$vllm") >> "$results/model-info.log" 2>&1 \
      || { echo "model info: failed, see $results/model-info.log" >&2; tail -5 "$results/model-info.log"; return 1; }
  done
  cat "$results/model-info.log"
}

# mtp, longctx, deploy: four servers each (two modes), started together; CUDA graphs on.
modes() {
  local name=$1 list=$2
  log "serving modes $list: stock vs overlay, side by side"
  mtp_model
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.serving_modes --modes "$list" \
    --model "$model" --mtp-model "$model-mtp" --model-info-root "$model_info" \
    --stock-site "$site_stock" --overlay-site "$site_overlay" --out "$results/$name" \
    --timeout "${MODES_TIMEOUT_S:-480}" --vllm "$vllm") > "$results/$name.log" 2>&1
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
    --model "$model" --stock-site "$site_stock" --overlay-site "$site_overlay" \
    --out "$results/warmstart" --work-dir "$warmstart_homes" --model-info-root "$model_info" --steps "$steps") \
    > "$results/warmstart-$steps.log" 2>&1
  echo "warmstart exit: $?" | tee -a "$results/warmstart-$steps.log"
  tail -12 "$results/warmstart-$steps.log"
  cp "$results/warmstart/warmstart.json" "$out/warmstart-${steps//,/+}.json"
}

startup() {
  log "start-up: before/after the precompiled modules and the start-up defaults, the overlay alone"
  (cd /tmp && env -u VLLM_DISABLE_COMPILE_CACHE PYTHONPATH="$repo" python3 -m dsa_image.validation.startup \
    --model "$model" --site "$site_overlay" --out "$results/startup" --work-dir "$root/startup-homes-$vllm" \
    --model-info-root "$model_info" --vllm "$vllm") > "$results/startup.log" 2>&1
  echo "startup exit: $?" | tee -a "$results/startup.log"
  tail -8 "$results/startup.log"
  cp "$results/startup/startup.json" "$results/startup/startup-phases.md" "$out/" 2>/dev/null
}

# BENCH_A and BENCH_B pick the builds, each SIDE-X.Y.Z: stock or overlay of a base that
# `sites` (or `prepare`) installed on this machine (both bases side by side: BENCH_A=overlay-A.B.C
# BENCH_B=overlay-X.Y.Z, after `sites` of each; the same build twice: the A/A control, B
# named BUILD-control). Unset: stock and overlay of this base.
bench_builds=()
bench_inputs() {
  if [ -z "${BENCH_A:-}${BENCH_B:-}" ]; then
    bench_builds=(--a-site "$site_stock" --b-site "$site_overlay" --a-name stock --b-name overlay)
    return
  fi
  local side build name
  for side in a b; do
    if [ $side = a ]; then build=${BENCH_A:-stock-$vllm}; else build=${BENCH_B:-overlay-$vllm}; fi
    if ! [[ $build =~ ^(stock|overlay)-[0-9]+\.[0-9]+\.[0-9]+$ ]] || [ ! -e "$root/site-$build/vllm/__init__.py" ]; then
      echo "bench: BENCH_${side^^}=$build: expected stock-X.Y.Z or overlay-X.Y.Z of a base installed" \
        "here, with vLLM in $root/site-$build; run VLLM=X.Y.Z bash scripts/h200_validation.sh sites (or prepare) first" >&2
      exit 3
    fi
    # The same build on both sides is the A/A control: the names (HOMEs, labels) must differ.
    [ $side = b ] && [ "$build" = "${bench_builds[3]}" ] && name=$build-control || name=$build
    bench_builds+=("--$side-site" "$root/site-$build" "--$side-name" "$name")
  done
}

# BENCH_ARGS picks workloads and round counts (scripts/bench.py plan shows them); the servers'
# HOMEs stay in $bench_work, so a second call of the same group starts warm.
bench() {
  local label=${BENCH_LABEL:-bench}
  log "benchmark $label: ${bench_builds[*]}; ${BENCH_ARGS:-all workloads}"
  mtp_model
  # shellcheck disable=SC2086  # BENCH_ARGS is split on purpose
  (cd /tmp && env -u VLLM_DISABLE_COMPILE_CACHE python3 "$repo/scripts/bench.py" run "${bench_builds[@]}" \
    --model "$model" --mtp-model "$model-mtp" --work-dir "$bench_work" --model-info-root "$model_info" \
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
  local overlay
  overlay=$(site_path "$site_overlay") || exit 1
  (cd /tmp && PYTHONPATH="$repo/emulation:$overlay:$repo" python3 -m dsa_image.validation.b12x_glue \
    --model "$model" --json "$results/b12x-glue.json" --vllm "$vllm") > "$results/b12x-glue.log" 2>&1
  echo "b12x glue exit: $?" | tee -a "$results/b12x-glue.log"
  grep -v "compute-capability check bypassed\|^INFO\|^WARNING\|^DEBUG" "$results/b12x-glue.log" | tail -70
  cp "$results/b12x-glue.json" "$out/"
}

selftest() {
  log "self-test: this GPU's kernels, the b12x refusal, a broken kernel"
  local step overlay
  overlay=$(site_path "$site_overlay") || exit 1
  for step in "auto:" "refusal:--kernels b12x" "broken:--break prefill-long"; do
    # shellcheck disable=SC2086  # the step's arguments are split on purpose
    (cd /tmp && PYTHONPATH="$overlay:$repo" python3 -m dsa_image.selftest ${step#*:} \
      --json "$results/selftest-${step%%:*}.json") > "$results/selftest-${step%%:*}.txt" 2>&1
    echo "selftest ${step%%:*} exit: $?" | tee -a "$results/selftest-${step%%:*}.txt"
    grep -v "^INFO\|^WARNING\|^DEBUG" "$results/selftest-${step%%:*}.txt" | tail -12
    cp "$results/selftest-${step%%:*}.txt" "$out/"
  done
}

b12xserve() {
  log "serving on the emulated b12x path beside stock, CUDA graphs on"
  (cd /tmp && PYTHONPATH="$repo" python3 -m dsa_image.validation.b12x_serving --model "$model" \
    --stock-site "$site_stock" --overlay-site "$site_overlay" --emulation "$repo/emulation" \
    --repo "$repo" --out "$results/b12xserve" --timeout 480 --vllm "$vllm") > "$results/b12xserve.log" 2>&1
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
  local missing=() f
  for f in "$site_stock/vllm/__init__.py" "$site_stock/ray/__init__.py" \
           "$site_overlay/vllm_overlay_receipt.json" "$site_overlay/ray/__init__.py" \
           "$model/config.json"; do
    [ -e "$f" ] || missing+=("$f")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "cluster: expected stock vLLM $vllm and Ray in $site_stock, the overlaid copy in $site_overlay" \
      "and the tiny GLM-5 in $model; missing: ${missing[*]}; run the prepare phase first" \
      "(its staged wheels must hold Ray, the recipe's [cluster] pin)" >&2
    exit 3
  fi
}

# Stock and overlay side by side per layout; the harness stops every process and namespace it
# started (also on SIGTERM); `timeout` guards a hang, `cleanup` catches what a kill left.
cluster() {
  local budget=${CLUSTER_DEADLINE_S:-540} dir="$results/cluster"
  log "cluster: $CLUSTER_LAYOUTS, stock vs overlay side by side, within $budget s"
  (cd /tmp && PYTHONPATH="$repo" timeout -k 20 $((budget - 20)) python3 -m dsa_image.validation.cluster run \
    --layouts "$CLUSTER_LAYOUTS" --model "$model" --stock-site "$site_stock" \
    --overlay-site "$site_overlay" --out "$dir" --deadline-s $((budget - 50)) --vllm "$vllm" \
    --model-info-root "$model_info" ${CLUSTER_ARGS:-}) \
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
           "${SMOKE_LABEL:-smoke}/smoke-report.json" toolchain/smoke-report.json toolchain-compilers.txt environment.txt \
           torch-libs.txt; do
    [ -f "$results/$f" ] && cp "$results/$f" "$out/$phase-$(basename "$f")"
  done
  tar -czf "$out/$phase-results.tgz" -C "$results" --exclude='*.pt' . 2>/dev/null
  # shellcheck disable=SC2046  # split on purpose: the probe files, names without spaces
  tar -czf "$out/$phase-probes.tgz" -C "$results" $(cd "$results" && ls -- *.pt 2>/dev/null) 2>/dev/null
  ls -la "$out"
}

case $phase in
  receive) receive ;;
  inventory) environment; inventory ;;
  install) environment; install; probes; model_infos; collect ;;
  prepare) environment; install; model_infos; collect ;;
  sites) environment; install; collect ;;
  upstream) environment; upstream ;;
  hosttime) hosttime ;;
  toolchain) environment; toolchain; collect ;;
  serve) environment; serve; collect ;;
  smoke) environment; smoke; collect ;;
  mtp) environment; modes mtp mtp-paths; collect ;;
  longctx) environment; modes longctx long-bf16,long-fp8; collect ;;
  deploy) environment; modes deploy fp8,long-fp8-mtp3; collect ;;
  warmstart) environment; warmstart; collect ;;
  startup) environment; startup; collect ;;
  bench) bench_inputs; environment; bench; collect ;;
  b12x) environment; b12x; collect ;;
  selftest) environment; selftest; collect ;;
  b12xserve) environment; b12xserve; collect ;;
  cluster) cluster_inputs; environment; cluster ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
