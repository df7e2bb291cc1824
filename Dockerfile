# vLLM for GLM-5.x sparse attention (DSA), one image per GPU family.
#
# Build with bake, which passes every pin below from the recipe (docker-bake.json is
# generated from recipes/glm5-dsa.toml; docker-bake.hcl holds the targets):
#
#     docker buildx bake sm120          # or sm100, sm90; `test` runs the in-image tests
#     docker buildx bake sm120-vllmX_Y_Z    # the same target on the recipe's base vLLM X.Y.Z
#
# VLLM_VERSION picks the base: its locks (recipes/locks/vllm-VERSION/) and its overlay
# (overlay/vllm-VERSION/).
#
# This file holds no pins: an ARG without a value fails the build with a message.
# No `# syntax=` line on purpose: it makes BuildKit pull its frontend from Docker Hub; the
# built-in frontend already has RUN --mount (cache, secret, bind).
#
# Stages, each named for what it produces, heaviest and least often changed first, so a
# one-line overlay edit rebuilds only `overlay` and what follows it:
#
#   base        Debian + Python + a host compiler (nvcc needs one), a venv
#   deps        the hash-locked vLLM environment incl. pip's CUDA 13.0 toolkit (CUDA_HOME)
#   extras      the target's extra lock (sm120: b12x); toolchain and SASS proven for its GPUs
#   tiny-model  the built-in dummy-weight GLM-5 (config + tokenizer)
#   model-info  vLLM's model-class info for GLM-5.x and its MTP drafter, cached (no start-up subprocess)
#   test-libs   the test runner (recipes/locks/dev.txt) in its own directory
#   upstream-bundle  vLLM's own tests that import an overlaid module, from the base's pinned sdist
#   upstream-stock   those tests against the stock vLLM of `extras`, file by file
#   precompile  FlashInfer's JIT modules for the target's GPUs, in the runtime's cache layout + manifest
#   overlay     our files over vLLM (scripts/overlay.py apply, fail closed) + the receipt
#   upstream-overlay the same tests against the overlaid vLLM, compared with stock's: the gate
#   runtime-code the image's own code (entrypoint, self-test, serving recipes) beside the overlay
#   test        overlay verify + CPU tests against the installed vLLM
#   test-results  their results and the gate's alone (bake target `test` exports them to build/test-results)
#   runtime     non-root, labels, healthcheck, entrypoint (the default target)
#
# Behind a TLS-intercepting proxy hand pip a CA bundle as a BuildKit secret (bake:
# PIP_CA=/path/to/bundle.pem); it is mounted for the pip steps only, never in a layer.

ARG BASE_IMAGE

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS base
ARG BASE_IMAGE
ARG PYTHON_VERSION
# Checked when BuildKit reads this file, before any step runs. Inside the first RUN the check's
# text would head BuildKit's error for every failure of that step, "network bridge not found"
# included. (No apostrophe in the message: the Dockerfile lexer takes it for a quote.)
ARG PYTHON_VERSION_GIVEN="${PYTHON_VERSION:?is empty: build with docker buildx bake, which passes the pins of the recipe}"
SHELL ["/bin/bash", "-o", "pipefail", "-euc"]
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_NO_INPUT=1
# g++: nvcc needs a host compiler, and DeepGEMM / FlashInfer / Triton compile at run time.
# pythonX.Y-dev: Triton builds its launcher against Python.h at run time.
# libibverbs1, ibverbs-providers (mlx5 & co), librdmacm1: the RDMA user space NCCL's IB/RoCE
# transport loads across nodes (the ConnectX link between DGX Sparks); without them NCCL falls
# back to TCP sockets.
RUN apt-get update; \
    apt-get install -y --no-install-recommends ca-certificates g++ \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        libibverbs1 ibverbs-providers librdmacm1; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log; \
    "python${PYTHON_VERSION}" -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# ---------------------------------------------------------------------------------------------
# The pins this target builds from, picked by name: the base's common lock, the target's
# extras lock and the recipe. Later steps mount them from here, so their cache keys follow
# these files' contents only, not the rest of recipes/. (Docker 20.10's built-in frontend does
# not expand ARGs in a bind mount's source, hence a stage rather than a mount per file.)
FROM base AS pins
ARG TARGETARCH
ARG EXTRAS_LOCK
ARG RECIPE
ARG VLLM_VERSION
RUN --mount=type=bind,source=recipes,target=/tmp/dsa-image/recipes \
    locks="/tmp/dsa-image/recipes/locks/vllm-${VLLM_VERSION}"; \
    if [[ -z "${VLLM_VERSION}" || ! -d "${locks}" ]]; then \
        echo "no locks for vLLM '${VLLM_VERSION}' (recipes/locks/vllm-VERSION/): build with 'docker buildx bake'" >&2; exit 1; fi; \
    mkdir -p /pins/recipes; \
    cp "${locks}/vllm-${TARGETARCH}.txt" /pins/vllm.txt; \
    if [[ -n "${EXTRAS_LOCK}" ]]; then cp "${locks}/${EXTRAS_LOCK}-${TARGETARCH}.txt" /pins/extras.txt; \
    else : > /pins/extras.txt; fi; \
    cp "/tmp/dsa-image/recipes/${RECIPE}.toml" /pins/recipes/

# ---------------------------------------------------------------------------------------------
FROM base AS deps
ARG TARGETARCH
ARG PYTHON_VERSION
# The whole CUDA toolkit comes from the pinned pip packages (13.0 series, one tree).
ENV CUDA_HOME=/opt/venv/lib/python${PYTHON_VERSION}/site-packages/nvidia/cu13
ENV PATH=${CUDA_HOME}/bin:${PATH}
# One hash-locked set, common to all targets: only this file (bind-mounted, so it is not in a
# layer) decides whether this step re-runs. pip's cache lives in a BuildKit cache mount, one per
# architecture: CI builds arm64 beside the amd64 tests, and one locked cache would serialize them.
RUN --mount=type=bind,from=pins,source=/pins/vllm.txt,target=/tmp/dsa-image/vllm.lock \
    --mount=type=cache,id=dsa-image-pip-${TARGETARCH},target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [[ -f /run/secrets/pip-ca ]]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    pip install --require-hashes --no-deps --index-url https://pypi.org/simple -r /tmp/dsa-image/vllm.lock; \
    pip check
# The three links FlashInfer's JIT expects of a classic toolkit (docs/image.md). libcuda.so.1
# is the driver's: the NVIDIA container runtime mounts it at run time, so this one dangles here.
RUN --mount=type=bind,source=scripts/link_cuda_toolkit.sh,target=/tmp/dsa-image/link_cuda_toolkit.sh \
    bash /tmp/dsa-image/link_cuda_toolkit.sh "${CUDA_HOME}" "/usr/lib/$(gcc -dumpmachine)/libcuda.so.1"

# ---------------------------------------------------------------------------------------------
FROM deps AS extras
ARG TARGETARCH
ARG TARGETPLATFORM
ARG PYTHON_VERSION
ARG TARGET
ARG PLATFORMS
ARG CUDA_ARCH_LIST
ARG VLLM_VERSION
ARG RECIPE
RUN if [[ -z "${TARGET}" || -z "${CUDA_ARCH_LIST}" || -z "${VLLM_VERSION}" || -z "${PLATFORMS}" ]]; then \
        echo "TARGET/CUDA_ARCH_LIST/VLLM_VERSION/PLATFORMS empty: build with 'docker buildx bake ${TARGET:-sm120}'" >&2; exit 1; fi; \
    if [[ ",${PLATFORMS}," != *",${TARGETPLATFORM},"* ]]; then \
        echo "target ${TARGET} is built for ${PLATFORMS} (recipe), not ${TARGETPLATFORM}" >&2; exit 1; fi; \
    found="$(python -c 'import importlib.metadata as m; print(m.version("vllm"))')"; \
    [[ "${found}" == "${VLLM_VERSION}" ]] || { echo "the lock installed vLLM ${found}; the recipe pins ${VLLM_VERSION}: re-run scripts/recipe.py lock" >&2; exit 1; }
# The target's extras: a superset lock with identical pins, so pip only adds what is missing.
# pip check then accepts exactly the conflicts the recipe overrides (b12x's torch floor).
RUN --mount=type=bind,from=pins,source=/pins,target=/tmp/dsa-image/pins \
    --mount=type=bind,source=dsa_image/__init__.py,target=/tmp/dsa-image/tool/dsa_image/__init__.py \
    --mount=type=bind,source=dsa_image/core/__init__.py,target=/tmp/dsa-image/tool/dsa_image/core/__init__.py \
    --mount=type=bind,source=dsa_image/core/recipe.py,target=/tmp/dsa-image/tool/dsa_image/core/recipe.py \
    --mount=type=bind,source=dsa_image/core/status.py,target=/tmp/dsa-image/tool/dsa_image/core/status.py \
    --mount=type=bind,source=dsa_image/build/__init__.py,target=/tmp/dsa-image/tool/dsa_image/build/__init__.py \
    --mount=type=bind,source=dsa_image/build/pip_check.py,target=/tmp/dsa-image/tool/dsa_image/build/pip_check.py \
    --mount=type=bind,source=scripts/pip_check.py,target=/tmp/dsa-image/tool/scripts/pip_check.py \
    --mount=type=cache,id=dsa-image-pip-${TARGETARCH},target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [[ -s /tmp/dsa-image/pins/extras.txt ]]; then \
        if [[ -f /run/secrets/pip-ca ]]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
        pip install --require-hashes --no-deps --index-url https://pypi.org/simple -r /tmp/dsa-image/pins/extras.txt; \
    else echo "target ${TARGET}: no extras"; fi; \
    python -B /tmp/dsa-image/tool/scripts/pip_check.py --recipe "${RECIPE}" --vllm "${VLLM_VERSION}" \
        --target "${TARGET}" --recipes-dir /tmp/dsa-image/pins/recipes
# Proof, without a GPU, that this image runs on its GPUs: nvcc builds a CUDA library for each
# target capability, and vLLM's compiled extensions carry SASS/PTX for them.
RUN --mount=type=bind,source=dsa_image/__init__.py,target=/tmp/dsa-image/tool/dsa_image/__init__.py \
    --mount=type=bind,source=dsa_image/build/__init__.py,target=/tmp/dsa-image/tool/dsa_image/build/__init__.py \
    --mount=type=bind,source=dsa_image/build/arch_check.py,target=/tmp/dsa-image/tool/dsa_image/build/arch_check.py \
    --mount=type=bind,source=dsa_image/core/__init__.py,target=/tmp/dsa-image/tool/dsa_image/core/__init__.py \
    --mount=type=bind,source=dsa_image/core/dist_info.py,target=/tmp/dsa-image/tool/dsa_image/core/dist_info.py \
    --mount=type=bind,source=dsa_image/core/status.py,target=/tmp/dsa-image/tool/dsa_image/core/status.py \
    --mount=type=bind,source=scripts/arch_check.py,target=/tmp/dsa-image/tool/scripts/arch_check.py \
    python -B /tmp/dsa-image/tool/scripts/arch_check.py toolchain --cuda-arch "${CUDA_ARCH_LIST}"; \
    python -B /tmp/dsa-image/tool/scripts/arch_check.py extensions --cuda-arch "${CUDA_ARCH_LIST}" \
        --site-packages "/opt/venv/lib/python${PYTHON_VERSION}/site-packages"

# ---------------------------------------------------------------------------------------------
FROM base AS tiny-model
COPY dsa_image/__init__.py /tmp/dsa-image/tool/dsa_image/
COPY dsa_image/core/__init__.py dsa_image/core/status.py /tmp/dsa-image/tool/dsa_image/core/
COPY dsa_image/build/__init__.py dsa_image/build/tiny_model.py /tmp/dsa-image/tool/dsa_image/build/
COPY scripts/make_tiny_model.py /tmp/dsa-image/tool/scripts/
RUN python -B /tmp/dsa-image/tool/scripts/make_tiny_model.py /tiny-glm5

# ---------------------------------------------------------------------------------------------
# What vLLM otherwise works out in a fresh Python subprocess per model class at every start with
# an empty cache (18-19 s for the two in this image on a 2-core CPU; docs/image.md): the info of
# GLM-5.x's class and its MTP drafter's, keyed by their modules' source. Before the overlay, which does not
# touch those modules; the test stage checks the entries are fresh against the overlaid site.
# Cross-built under QEMU (BUILDPLATFORM != TARGETPLATFORM: the arm64 image on an x86-64 host,
# QEMU) the step says so and ships none: there `import torch` in a build step stopped for good
# after reading /sys/devices/system/cpu (twice, 2026-12-01); vLLM then inspects at first start.
FROM extras AS model-info
ARG BUILDPLATFORM
ARG TARGETPLATFORM
COPY dsa_image/__init__.py /tmp/dsa-image/tool/dsa_image/
COPY dsa_image/core/__init__.py dsa_image/core/compile_caches.py dsa_image/core/status.py /tmp/dsa-image/tool/dsa_image/core/
COPY dsa_image/build/__init__.py dsa_image/build/model_info_cache.py /tmp/dsa-image/tool/dsa_image/build/
COPY --from=tiny-model /tiny-glm5 /tmp/dsa-image/tiny-glm5
RUN if [[ "${BUILDPLATFORM}" != "${TARGETPLATFORM}" ]]; then \
        mkdir -p /model-info/modelinfos; \
        echo "model-info: built for ${TARGETPLATFORM} on ${BUILDPLATFORM} (emulated): no model info cached; vLLM inspects the model classes at first start"; \
    else \
        PYTHONPATH=/tmp/dsa-image/tool python -B -m dsa_image.build.model_info_cache fill \
            --model /tmp/dsa-image/tiny-glm5 --cache-root /model-info; \
    fi

# ---------------------------------------------------------------------------------------------
# The test runner (pytest and the rest of the dev lock) in a directory of its own, appended to
# sys.path after the site's packages (a .pth in `test`, --libs for the upstream runs), so it
# can never replace a package vLLM was locked with. Independent of vLLM: cached across bases.
FROM base AS test-libs
RUN --mount=type=bind,source=recipes/locks/dev.txt,target=/tmp/dsa-image/dev.lock \
    --mount=type=cache,id=dsa-image-pip,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [[ -f /run/secrets/pip-ca ]]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    pip install --require-hashes --no-deps --index-url https://pypi.org/simple \
        --target /opt/dsa-image/test-libs -r /tmp/dsa-image/dev.lock

# ---------------------------------------------------------------------------------------------
# Upstream's tests as the overlay's gate (docs/upstream-tests.md). The bundle: the test files of
# this base's pinned sdist (recipe [vllm."X".sdist], downloaded into a cache mount and re-hashed)
# that import an overlaid module, their conftests and helpers, and the packages of
# recipes/locks/upstream-tests.txt; ~2 MB. Its own small stage, from the recipe, this base's
# manifest and the tool alone (no vLLM install): a test edit leaves it cached, and what it holds
# changes only with the overlaid modules, the sdist or the lock, never with an overlay file's
# content, so the stock run below, keyed on that content, stays cached when only the overlay does.
FROM base AS upstream-bundle
ARG RECIPE
ARG VLLM_VERSION
COPY dsa_image/__init__.py /opt/dsa-image/upstream-tool/dsa_image/
COPY dsa_image/core/__init__.py dsa_image/core/atomic.py dsa_image/core/dist_info.py dsa_image/core/recipe.py \
     dsa_image/core/site_path.py dsa_image/core/status.py dsa_image/core/wheels.py /opt/dsa-image/upstream-tool/dsa_image/core/
COPY dsa_image/build/__init__.py dsa_image/build/lock.py dsa_image/build/lock_parse.py dsa_image/build/registry.py /opt/dsa-image/upstream-tool/dsa_image/build/
COPY dsa_image/overlay/__init__.py dsa_image/overlay/manifest.py dsa_image/overlay/fs.py dsa_image/overlay/core.py /opt/dsa-image/upstream-tool/dsa_image/overlay/
COPY dsa_image/upstream/ /opt/dsa-image/upstream-tool/dsa_image/upstream/
COPY scripts/upstream_tests.py /opt/dsa-image/upstream-tool/scripts/
COPY recipes/${RECIPE}.toml /opt/dsa-image/upstream-tool/recipes/
COPY recipes/locks/upstream-tests.txt /opt/dsa-image/upstream-tool/recipes/locks/
COPY overlay/vllm-${VLLM_VERSION}/manifest.json /opt/dsa-image/upstream-tool/overlay/vllm-${VLLM_VERSION}/
RUN --mount=type=cache,id=dsa-image-downloads,target=/root/.cache/dsa-image \
    --mount=type=cache,id=dsa-image-pip,target=/root/.cache/pip,sharing=locked \
    --mount=type=secret,id=pip-ca \
    if [[ -f /run/secrets/pip-ca ]]; then export PIP_CERT=/run/secrets/pip-ca SSL_CERT_FILE=/run/secrets/pip-ca; fi; \
    python -B /opt/dsa-image/upstream-tool/scripts/upstream_tests.py --recipe "${RECIPE}" bundle \
        --vllm "${VLLM_VERSION}" --out /opt/dsa-image/upstream-tests

# The stock side: `extras` is this base's stock vLLM, exactly what `overlay` applies our files
# to, so a stage FROM it runs upstream's tests against stock with no second install (and no
# revert of the overlay: each side's site is a build stage of its own, and the stock run is
# cached while only the overlay changes). Each selected file in its own pytest, junit per file.
# Exit 8 (incomplete: a file timed out, crashed or could not run) is left to the comparison to report.
# What the tests write to /tmp stays out of the layer (a tmpfs).
FROM extras AS upstream-stock
RUN --mount=type=bind,from=upstream-bundle,source=/opt/dsa-image,target=/mnt/upstream,rw \
    --mount=type=bind,from=test-libs,source=/opt/dsa-image/test-libs,target=/opt/dsa-image/test-libs \
    --mount=type=tmpfs,target=/tmp \
    python -B /mnt/upstream/upstream-tool/scripts/upstream_tests.py run --side stock \
        --bundle /mnt/upstream/upstream-tests --out /opt/dsa-image/upstream-results \
        --libs /opt/dsa-image/test-libs --timeout 600 --jobs 2 || [[ $? -eq 8 ]]

# ---------------------------------------------------------------------------------------------
# FlashInfer's JIT modules the served path builds at its first start (a cold H200 start spent
# 104 s on `sampling`: docs/validation/h200-2026-12-01-startup-phases), compiled here with the
# image's nvcc for each capability of CUDA_ARCH_LIST, into the directory a server on that GPU
# looks in (FLASHINFER_WORKSPACE_BASE=/home/vllm), with a manifest of what, for which arch and
# sha256 (dsa_image/build/precompile.py). No GPU needed. From deps, not extras: a recipe edit leaves it
# cached, and FlashInfer's files here are the runtime's (extras adds packages, replaces none;
# the runtime stage's check proves it). Cross-built under QEMU (the arm64 image on an x86-64
# host) it compiles nothing and says so: nvcc under QEMU is prohibitively slow
# (docs/decisions.md); FlashInfer then builds at first start, as before.
FROM deps AS precompile
ARG BUILDPLATFORM
ARG TARGETPLATFORM
ARG CUDA_ARCH_LIST
COPY dsa_image/__init__.py /tmp/dsa-image/tool/dsa_image/
COPY dsa_image/build/__init__.py dsa_image/build/precompile.py dsa_image/build/arch_check.py /tmp/dsa-image/tool/dsa_image/build/
COPY dsa_image/core/__init__.py dsa_image/core/dist_info.py dsa_image/core/atomic.py dsa_image/core/status.py \
     dsa_image/core/wheels.py /tmp/dsa-image/tool/dsa_image/core/
RUN [[ -n "${CUDA_ARCH_LIST}" ]] || { echo "CUDA_ARCH_LIST empty: build with 'docker buildx bake'" >&2; exit 1; }; \
    mkdir -p /home/vllm/.cache/flashinfer; cd /tmp; \
    if [[ "${BUILDPLATFORM}" != "${TARGETPLATFORM}" ]]; then \
        PYTHONPATH=/tmp/dsa-image/tool python -B -m dsa_image.build.precompile skip --manifest /precompiled/manifest.json \
            --reason "built for ${TARGETPLATFORM} on ${BUILDPLATFORM} (emulated): FlashInfer builds its modules at first start"; \
    else \
        PYTHONPATH=/tmp/dsa-image/tool python -B -m dsa_image.build.precompile build --cuda-arch "${CUDA_ARCH_LIST}" \
            --workspace-base /home/vllm --manifest /precompiled/manifest.json; \
    fi

# Only the precompile stage's manifest, for bake targets `precompiled-<target>` to export
# (build/precompiled-<target>/manifest.json): every target's artefacts built and checked (the
# stage's own check: they load as built and carry SASS for each capability) without building
# its image. CI builds them for every target (tests/test_image.py).
FROM scratch AS precompile-results
COPY --from=precompile /precompiled/manifest.json /

# ---------------------------------------------------------------------------------------------
FROM extras AS overlay
ARG PYTHON_VERSION
ARG TARGET
ARG RECIPE
ARG VLLM_VERSION
# The recipe, base and target are set here, not in runtime: verify (test stage and runtime
# alike) checks that the receipt names this recipe and this base's overlay.
ENV DSA_IMAGE_TOOL=/opt/dsa-image/tool \
    DSA_IMAGE_SITE_PACKAGES=/opt/venv/lib/python${PYTHON_VERSION}/site-packages \
    DSA_IMAGE_RECIPE=${RECIPE} \
    DSA_IMAGE_VLLM=${VLLM_VERSION} \
    DSA_IMAGE_TARGET=${TARGET}
# Only what apply and verify need: a change anywhere else in the repository, the runtime's own
# code included, leaves this stage cached, and so the gate's overlay side (upstream-overlay,
# FROM this stage) too. Exactly the modules scripts/overlay.py imports, directly or not
# (tests/test_image_tree.py holds these lines to that import closure).
COPY dsa_image/__init__.py ${DSA_IMAGE_TOOL}/dsa_image/
COPY dsa_image/core/__init__.py dsa_image/core/atomic.py dsa_image/core/dist_info.py dsa_image/core/recipe.py \
     dsa_image/core/status.py dsa_image/core/wheels.py ${DSA_IMAGE_TOOL}/dsa_image/core/
COPY dsa_image/build/__init__.py dsa_image/build/bake.py ${DSA_IMAGE_TOOL}/dsa_image/build/
COPY dsa_image/overlay/ ${DSA_IMAGE_TOOL}/dsa_image/overlay/
COPY dsa_image/rebase/ ${DSA_IMAGE_TOOL}/dsa_image/rebase/
COPY scripts/overlay.py ${DSA_IMAGE_TOOL}/scripts/
COPY recipes/${RECIPE}.toml ${DSA_IMAGE_TOOL}/recipes/
# This base's overlay only: an edit of another base's leaves this stage cached.
COPY overlay/vllm-${VLLM_VERSION}/ ${DSA_IMAGE_TOOL}/overlay/vllm-${VLLM_VERSION}/
# RECEIPT_SHA256 is the receipt predicted from the base's manifest (docker-bake.json); the
# image is labelled with it, so the receipt written here must be exactly that one.
ARG RECEIPT_SHA256
RUN python -B "${DSA_IMAGE_TOOL}/scripts/overlay.py" apply --site-packages "${DSA_IMAGE_SITE_PACKAGES}" \
        --recipe "${RECIPE}" --vllm "${VLLM_VERSION}"; \
    cp "${DSA_IMAGE_SITE_PACKAGES}/vllm_overlay_receipt.json" /opt/dsa-image/receipt.json; \
    (cd /opt/dsa-image && sha256sum receipt.json > receipt.json.sha256); \
    written=$(cut -d' ' -f1 /opt/dsa-image/receipt.json.sha256); \
    [[ "${written}" == "${RECEIPT_SHA256}" ]] || { echo "the receipt apply wrote has sha256 ${written}, docker-bake.json predicts '${RECEIPT_SHA256}' (the image label): run 'python3 scripts/overlay.py record --refresh --vllm ${VLLM_VERSION}' and rebuild with 'docker buildx bake'" >&2; exit 1; }; \
    chmod -R a-w /opt/dsa-image/receipt.json /opt/dsa-image/receipt.json.sha256

# ---------------------------------------------------------------------------------------------
# The overlay side of the gate, then the comparison: no test that passes (or is skipped) on
# stock may fail on the overlay (docs/upstream-tests.md). A regression, or a file without a
# result on a side, fails this step, so no results of a failed gate are exported.
FROM overlay AS upstream-overlay
COPY --from=upstream-stock /opt/dsa-image/upstream-results/ /opt/dsa-image/upstream-results/
RUN --mount=type=bind,from=upstream-bundle,source=/opt/dsa-image,target=/mnt/upstream,rw \
    --mount=type=bind,from=test-libs,source=/opt/dsa-image/test-libs,target=/opt/dsa-image/test-libs \
    --mount=type=tmpfs,target=/tmp \
    tool=/mnt/upstream/upstream-tool/scripts/upstream_tests.py; results=/opt/dsa-image/upstream-results; \
    python -B "${tool}" run --side overlay --bundle /mnt/upstream/upstream-tests --out "${results}" \
        --libs /opt/dsa-image/test-libs --timeout 600 --jobs 2 || [[ $? -eq 8 ]]; \
    python -B "${tool}" compare "${results}" --bundle /mnt/upstream/upstream-tests --json "${results}/compare.json" | tee "${results}/compare.txt"

# ---------------------------------------------------------------------------------------------
# The image's own code beside the overlaid site: the entrypoint, healthcheck, warm-up, self-test
# and the serving recipes. With `overlay`, exactly the modules dsa_image/runtime/ and
# scripts/overlay.py import (tests/test_image_tree.py): no build, benchmark, smoke or validation
# code in a user's image.
FROM overlay AS runtime-code
COPY dsa_image/core/endpoint.py dsa_image/core/health.py ${DSA_IMAGE_TOOL}/dsa_image/core/
COPY dsa_image/runtime/ ${DSA_IMAGE_TOOL}/dsa_image/runtime/
COPY dsa_image/serving/ ${DSA_IMAGE_TOOL}/dsa_image/serving/
# The serving recipes and their model facts: `docker run IMAGE recipe ...` reads them.
COPY recipes/serve/ ${DSA_IMAGE_TOOL}/recipes/serve/
COPY recipes/models/ ${DSA_IMAGE_TOOL}/recipes/models/
COPY recipes/bugs/ ${DSA_IMAGE_TOOL}/recipes/bugs/

# ---------------------------------------------------------------------------------------------
FROM runtime-code AS test
# pytest and friends from the dev lock, appended to sys.path after site-packages (a .pth file).
# Before the tests are copied: a test edit does not reinstall them.
COPY --from=test-libs /opt/dsa-image/test-libs/ /opt/dsa-image/test-libs/
RUN echo /opt/dsa-image/test-libs > "${DSA_IMAGE_SITE_PACKAGES}/zz_dsa_image_test_libs.pth"
COPY pyproject.toml ${DSA_IMAGE_TOOL}/
# The tests import more of dsa_image than the runtime ships (the validation's comparison, the
# model-info check): the whole package, in this stage only.
COPY dsa_image/ ${DSA_IMAGE_TOOL}/dsa_image/
COPY tests/ ${DSA_IMAGE_TOOL}/tests/
COPY --from=model-info /model-info/ /tmp/dsa-image/model-info/
COPY --from=tiny-model /tiny-glm5 /tmp/dsa-image/tiny-glm5
COPY --from=precompile /home/vllm/.cache/flashinfer/ /home/vllm/.cache/flashinfer/
COPY --from=precompile /precompiled/manifest.json /opt/dsa-image/precompiled.json
WORKDIR ${DSA_IMAGE_TOOL}
# verify: re-hash every overlaid file against the receipt and import each overlaid module in
# a fresh interpreter, from this vLLM. The model-info entries the runtime ships: fresh for the
# overlaid site (vLLM's own lookup, its subprocess fallback refused). Then the tests that
# exercise the installed environment: the overlay tool, the overlaid indexer modules (property tests against this vLLM), the GPU
# validation's comparison, the real nvcc + vLLM extensions (arch_check), pip check, the
# entrypoint and the healthcheck.
# The results are files of this stage (the `test-results` stage exports them), so a build
# whose test step came from the cache still hands over what that step proved. A failing test
# fails this step: no results file exists for a failed run.
RUN mkdir -p /opt/dsa-image/test-results; \
    python -B scripts/overlay.py verify --site-packages "${DSA_IMAGE_SITE_PACKAGES}" 2>&1 \
        | tee /opt/dsa-image/test-results/verify.txt; \
    python -B -m dsa_image.build.model_info_cache check --model /tmp/dsa-image/tiny-glm5 \
        --cache-root /tmp/dsa-image/model-info 2>&1 | tee /opt/dsa-image/test-results/model-info.txt; \
    python -B -m pytest -p no:cacheprovider -m "not docker and not gpu and not wheel" \
        --junitxml=/opt/dsa-image/test-results/junit.xml \
        tests/test_overlay.py tests/test_overlay_bytecode.py tests/test_overlay_interrupt.py \
        tests/test_overlay_revert.py tests/test_overlay_space.py \
        tests/test_indexer_overlay*.py tests/test_indexer_reference.py tests/test_selftest.py tests/test_selftest_deepgemm.py \
        tests/test_validation.py tests/test_serving_recipes_vllm.py \
        tests/test_image_arch_check.py \
        tests/test_image_pip_check.py tests/test_image_entrypoint.py tests/test_image_healthcheck.py \
        tests/test_image_precompile.py

# ---------------------------------------------------------------------------------------------
# Only the in-image test results, for bake target `test` (test-<base>) to export
# (build/test-results/), and the gate's (build/test-results/upstream-tests/: each side's
# run.json, junit and logs per file, compare.txt, compare.json and the bundle's bundle.json:
# what was selected from which sdist).
FROM scratch AS test-results
COPY --from=test /opt/dsa-image/test-results/ /
COPY --from=upstream-overlay /opt/dsa-image/upstream-results/ /upstream-tests/
COPY --from=upstream-bundle /opt/dsa-image/upstream-tests/bundle.json /upstream-tests/

# ---------------------------------------------------------------------------------------------
FROM runtime-code AS runtime
ARG RECEIPT_SHA256
ARG VLLM_WHEEL_SHA256_AMD64
ARG VLLM_WHEEL_SHA256_ARM64
ARG BASE_IMAGE
ARG TARGET
ARG RECIPE
ARG VLLM_VERSION
ARG CUDA_ARCH_LIST
ARG DEFAULT_MODEL
ARG PORT
RUN [[ -n "${DEFAULT_MODEL}" && -n "${PORT}" ]] || { echo "DEFAULT_MODEL/PORT empty: build with 'docker buildx bake'" >&2; exit 1; }; \
    useradd --create-home --home-dir /home/vllm --uid 1000 --user-group --shell /usr/sbin/nologin vllm; \
    printf '#!/bin/sh\n# The entrypoint by name, for docker exec (serve from a ray-head container).\nexec /usr/bin/env PYTHONPATH=/opt/dsa-image/tool /opt/venv/bin/python -m dsa_image.runtime.entrypoint "$@"\n' \
        > /usr/local/bin/dsa-image; \
    chmod 755 /usr/local/bin/dsa-image; \
    install -d -o vllm -g vllm /home/vllm/.cache /home/vllm/.cache/deep_gemm /home/vllm/.cache/triton \
        /home/vllm/.cache/vllm
COPY --from=tiny-model /tiny-glm5 ${DEFAULT_MODEL}
COPY --from=model-info --chown=vllm:vllm /model-info/modelinfos/ /home/vllm/.cache/vllm/modelinfos/
# FlashInfer's precompiled modules where a server on the target's GPUs finds them, and their
# manifest (read-only, like the receipt); the check at the end of this stage proves they load
# as built.
COPY --from=precompile --chown=vllm:vllm /home/vllm/.cache/flashinfer/ /home/vllm/.cache/flashinfer/
COPY --from=precompile /precompiled/manifest.json /opt/dsa-image/precompiled.json
# Every run-time compile cache under /home/vllm/.cache, so one named volume there
# (docker run -v dsa-image-cache:/home/vllm/.cache) keeps them all across restarts; a new named
# volume starts as a copy of this directory, owned by vllm. Left to their defaults, Inductor
# (/tmp/torchinductor_vllm), the CUDA driver's PTX cache (~/.nv), Triton (~/.triton) and CuTe DSL
# (b12x, FlashInfer's CuTe kernels: /tmp/vllm/cutlass_python_cache) would lie outside it. vLLM's
# (torch.compile artefacts, their Inductor/Triton output, FlashInfer autotune results), FlashInfer's
# JIT (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) and DeepGEMM's are named so no default moves them.
ENV HOME=/home/vllm \
    XDG_CACHE_HOME=/home/vllm/.cache \
    VLLM_CACHE_ROOT=/home/vllm/.cache/vllm \
    TORCHINDUCTOR_CACHE_DIR=/home/vllm/.cache/torchinductor \
    TRITON_CACHE_DIR=/home/vllm/.cache/triton \
    CUDA_CACHE_PATH=/home/vllm/.cache/nv/ComputeCache \
    FLASHINFER_WORKSPACE_BASE=/home/vllm \
    DG_JIT_CACHE_DIR=/home/vllm/.cache/deep_gemm \
    CUTE_DSL_CACHE_DIR=/home/vllm/.cache/cute_dsl \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DSA_IMAGE_PORT=${PORT}
USER vllm
WORKDIR /home/vllm
# With this stage's files and environment, as the user that serves: FlashInfer would load each
# precompiled module as built (its build.ninja unchanged, ninja with no work, the manifest's
# sha256, SASS for its GPU). A stale one fails the build here instead of recompiling at start.
# The check's code is build code, so it is mounted for this step, not shipped.
RUN --mount=type=bind,source=dsa_image,target=/tmp/dsa-image/check-tool/dsa_image \
    PYTHONPATH=/tmp/dsa-image/check-tool python -B -m dsa_image.build.precompile check \
        --manifest /opt/dsa-image/precompiled.json
EXPOSE ${PORT}
# Healthy = vLLM's /health answers and the entrypoint's warm-up requests are done (its readiness
# marker; DSA_IMAGE_WARMUP=0: /health alone): the tiny model's /health took ~3 minutes on an H200,
# real models take longer. The probe reads the port and host from the running `vllm serve`
# command line (--port 9000 included), not from DSA_IMAGE_PORT (the recipe's port, which a
# user's --port overrides).
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD ["/usr/bin/env", "PYTHONPATH=/opt/dsa-image/tool", "/opt/venv/bin/python", "-m", "dsa_image.runtime.healthcheck"]
ENTRYPOINT ["/usr/bin/env", "PYTHONPATH=/opt/dsa-image/tool", "/opt/venv/bin/python", "-m", "dsa_image.runtime.entrypoint"]
CMD []
LABEL org.opencontainers.image.title="dsa-image-${TARGET}" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION} with the GLM-5.x DSA indexer overlay, for CUDA capabilities ${CUDA_ARCH_LIST}" \
      org.opencontainers.image.version="${VLLM_VERSION}-${TARGET}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      dsa-image.recipe="${RECIPE}" \
      dsa-image.target="${TARGET}" \
      dsa-image.cuda-arch="${CUDA_ARCH_LIST}" \
      dsa-image.vllm.version="${VLLM_VERSION}" \
      dsa-image.vllm.wheel-sha256.amd64="${VLLM_WHEEL_SHA256_AMD64}" \
      dsa-image.vllm.wheel-sha256.arm64="${VLLM_WHEEL_SHA256_ARM64}" \
      dsa-image.receipt="/opt/dsa-image/receipt.json" \
      dsa-image.receipt.sha256="${RECEIPT_SHA256}"
