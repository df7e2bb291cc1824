"""The image's entrypoint: `vllm serve` with the recipe's defaults for the image's target.

    docker run IMAGE                     serve the built-in tiny dummy-weight GLM-5 (no download)
    docker run IMAGE MODEL [FLAGS...]    vllm serve MODEL FLAGS... (same as `serve MODEL ...`)
    docker run IMAGE serve [ARGS...]     the same, named explicitly; `serve --help`: vLLM's flags
    docker run IMAGE verify              verify the overlay and the receipt, then exit
    docker run IMAGE recipe --list       the serving recipes and their memory plans
    docker run IMAGE ray-head | ray-worker HEAD_IP   a Ray node for serving across nodes
    docker run --gpus all IMAGE selftest the indexer kernels of this GPU against a torch reference
    docker run IMAGE --help              modes, the defaults serve adds, the environment

A first argument that is not a mode (a model id, a path, a flag other than -h/--help) is
`serve`'s; a word close to a mode's name that is no model (no `/` in it, no such path) is a
mistyped mode, refused naming the mode meant. Every serve gets the recipe's serving defaults
(served model name, max model len, port, the target's KV-cache dtype) unless ARGS or the
`--config FILE` they name set that flag (vLLM ranks flags over the file, so a default given as a
flag would override the user's file), inserted before a bare `--`, and the target's environment
(e.g. VLLM_USE_B12X_SPARSE_INDEXER=1 on sm120) unless the container sets it. Before serving,
the entrypoint checks that an NVIDIA GPU is visible (libcuda.so.1 loads, cuInit succeeds, at
least one device): without one vLLM only fails later with a long traceback.

`serve` and a recipe's serve run `vllm serve` under the warm-up supervisor (dsa_image.runtime.warmup):
once vLLM's /health answers it sends the requests whose kernels would otherwise compile during
the first users' requests, and only then does the HEALTHCHECK report healthy.
DSA_IMAGE_WARMUP=0 execs vLLM directly (healthy on /health alone, as stock vLLM).

Exit codes: --help lists them (EXIT_CODES; the entrypoint's own: once `vllm serve` or the overlay
tool runs, theirs).

A new mode is one entry in MODES: a handler taking the mode's arguments and the environment
and returning a Plan, a synopsis and a one-line summary for --help. Stdlib only.
"""

from __future__ import annotations

import ctypes
import difflib
import hashlib
import os
import sys
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from dsa_image.core import status
from dsa_image.runtime import serve_command, warmup
from dsa_image.core.recipe import Recipe, RecipeError, Target, load_recipe

RECEIPT = Path("/opt/dsa-image/receipt.json")
RECEIPT_SHA256 = Path("/opt/dsa-image/receipt.json.sha256")
SITE_RECEIPT_NAME = "vllm_overlay_receipt.json"

OK, USAGE, IMAGE_PROBLEM, REFUSED, NO_GPU = (status.SUCCESS, status.USAGE, status.ENVIRONMENT, status.REFUSED,
                                             status.NO_GPU)

# The driver library the NVIDIA container runtime mounts into a container started with GPUs.
LIBCUDA = "libcuda.so.1"
SKIP_GPU_CHECK = "DSA_IMAGE_SKIP_GPU_CHECK"
HELP_FLAGS = ("-h", "--help")
SERVE_NEEDS_GPU = "vllm serve needs one"
DEFAULT_MODE = "serve"

EXIT_CODES = status.epilog(
    (OK, "ok (--help, recipe --list / --dry-run)"),
    (USAGE, "usage: arguments a mode does not take, a mistyped mode, a --config file it cannot read, a bad "
            "recipe or override"),
    (IMAGE_PROBLEM, "the image is broken: an environment variable, the recipe or the receipt is missing or wrong"),
    (REFUSED, "recipe: refused, the layout (does not fit in memory, TP/PP do not divide, cluster-only) or another "
              "image target than this image's"),
    (NO_GPU, "no usable NVIDIA GPU visible to serve, to vLLM's serve --help, selftest or a Ray node "
             f"({SKIP_GPU_CHECK}=1 skips the check)"),
    heading="exit codes (the entrypoint's; once vllm serve, the self-test or the overlay tool runs, theirs):")

# Set by the Dockerfile; listed by --help with what each is for.
IMAGE_ENV = {
    "DSA_IMAGE_RECIPE": "the recipe the image was built from",
    "DSA_IMAGE_VLLM": "the recipe's vLLM base the image was built on (its overlay is verify's)",
    "DSA_IMAGE_TARGET": "the recipe's target (GPU family) of this image",
    "DSA_IMAGE_TOOL": "where dsa_image, scripts/ and the recipe live in the image",
    "DSA_IMAGE_SITE_PACKAGES": "the site-packages the overlay was applied to (verify checks it)",
    "DSA_IMAGE_PORT": "the recipe's port, the one EXPOSEd",
}
# The image user's cache directory: the Dockerfile points every compile cache here (one volume).
CACHE_DIR = "/home/vllm/.cache"
# Read by serve (dsa_image.runtime.warmup); --help lists these too.
WARMUP_ENV = {
    warmup.SWITCH_ENV: "1 (default): healthy only after warm-up requests (prefills > 2,048 tokens, decode "
                       "batches, MTP if set) compiled what first requests would; 0: healthy on vLLM's /health "
                       "(also true/false)",
    "DSA_IMAGE_WARMUP_PREFILL": f"the prefill lengths sent (default {','.join(map(str, warmup.DEFAULT_PREFILL))})",
    "DSA_IMAGE_WARMUP_CONCURRENCY": "the decode batch sizes sent (default "
                                    f"{','.join(map(str, warmup.DEFAULT_CONCURRENCY))}; each passes every smaller size)",
    "DSA_IMAGE_WARMUP_TIMEOUT_S": "seconds the whole warm-up may take, every request in it (default "
                                  f"{warmup.DEFAULT_TIMEOUT_S:.0f}, at most {warmup.MAX_TIMEOUT_S:.0f}); past "
                                  "them, or on a wrong answer, the container stays unhealthy and its log says why",
}


class EntrypointError(status.DsaImageError):
    """The container cannot start as asked; the message says what to do."""

    exit_code = IMAGE_PROBLEM


class UsageError(EntrypointError):
    """Arguments a mode does not take."""

    exit_code = USAGE


@dataclass(frozen=True)
class Plan:
    """What to do. With an `argv`, it replaces this process with `env` added, after `log` went
    to stderr; without one, `output` goes to stdout and the entrypoint exits `exit_code`.
    `gpu_for`: what needs a GPU ("" = nothing); without one visible, exit NO_GPU saying so."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log: str = ""
    gpu_for: str = ""
    output: str = ""
    exit_code: int = OK


@dataclass(frozen=True)
class Mode:
    handler: Callable[[list[str], dict[str, str]], Plan]
    synopsis: str  # the mode's arguments, for --help
    summary: str  # one line, for --help


def serving_defaults(recipe: Recipe, target: Target) -> list[tuple[str, str]]:
    serving = recipe.serving
    return [
        ("--served-model-name", str(serving["served_model_name"])),
        ("--max-model-len", str(serving["max_model_len"])),
        ("--kv-cache-dtype", target.kv_cache_dtype),
        ("--port", str(serving["port"])),
    ]


def with_defaults(args: list[str], defaults: list[tuple[str, str]]) -> list[str]:
    """`args` plus each default flag neither they nor their --config file set (vLLM ranks the
    command line over the file: our default there would override the user's file), before a
    bare `--` (after it vLLM takes every word as positional)."""
    try:
        given = serve_command.parse(args)
    except serve_command.ConfigError as exc:
        raise UsageError(f"{exc}; the entrypoint reads the file to leave the flags it sets to it (the file must be "
                         "inside the container: docker run -v HOST_DIR:/config ... --config /config/FILE)") from None
    added = [part for flag, value in defaults if not given.sets(flag) for part in (flag, value)]
    end = args.index("--") if "--" in args else len(args)
    return [*args[:end], *added, *args[end:]]


def target_env(target: Target, environ: dict[str, str]) -> dict[str, str]:
    """The target's variables the container does not set itself."""
    return {k: v for k, v in target.env.items() if k not in environ}


def _asks_for_help(args: list[str]) -> bool:
    # vLLM's parser also takes --help=<group> (e.g. --help=ModelConfig).
    return any(a in HELP_FLAGS or a.startswith("--help=") for a in args)


def plan_serve(args: list[str], recipe: Recipe, target: Target, environ: dict[str, str]) -> Plan:
    if _asks_for_help(args):
        # vLLM's own help, unchanged (our defaults would only clutter it). vLLM builds its
        # argument parser from config defaults that detect the device, so even --help fails
        # without a GPU; the docs of the pinned version list the same flags.
        return Plan(["vllm", "serve", *args], log=f"dsa-image {target.id}: vllm serve {' '.join(args)}",
                    gpu_for=(f"vLLM {recipe.vllm_version}'s own `serve --help` needs one too (its parser "
                             f"detects the device); without a GPU read {vllm_serve_docs(recipe.vllm_version)}"))
    defaults = serving_defaults(recipe, target)
    env = target_env(target, environ)
    if args:
        argv = ["vllm", "serve", *with_defaults(args, defaults)]
        return Plan(argv, env, f"dsa-image {target.id}: vllm serve with the recipe's defaults: {' '.join(argv)}",
                    gpu_for=SERVE_NEEDS_GPU)
    argv = ["vllm", "serve", *with_defaults(default_model_argv(recipe), defaults)]
    model, load_format = recipe.serving["default_model"], recipe.serving["default_load_format"]
    log = (f"dsa-image {target.id}: no arguments given, so serving the built-in tiny GLM-5 at {model} "
           f"with random weights (--load-format {load_format}; nothing is downloaded). To serve a real "
           f"model: docker run --gpus all -p 8000:8000 IMAGE <model> [vllm serve flags]. "
           f"Running: {' '.join(argv)}")
    return Plan(argv, env, log, gpu_for=SERVE_NEEDS_GPU)


def default_model_argv(recipe: Recipe) -> list[str]:
    """The built-in model with the recipe's start-up flags for it ([serving] default_model_args)."""
    serving = recipe.serving
    return [str(serving["default_model"]), "--load-format", str(serving["default_load_format"]),
            *map(str, serving.get("default_model_args", []))]


def check_receipt(site_packages: Path, receipt: Path = RECEIPT, recorded: Path = RECEIPT_SHA256) -> str:
    """The image's receipt is the one `apply` wrote into site-packages and has the sha256
    recorded at build time. Returns that sha256."""
    for path in (receipt, recorded, site_packages / SITE_RECEIPT_NAME):
        if not path.is_file():
            raise EntrypointError(f"{path}: missing; the image was not built by this Dockerfile's overlay stage")
    data = receipt.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    expected = recorded.read_text().split()[0]
    if actual != expected:
        raise EntrypointError(f"{receipt}: sha256 {actual}, but the build recorded {expected} in {recorded}")
    if (site_packages / SITE_RECEIPT_NAME).read_bytes() != data:
        raise EntrypointError(f"{receipt} differs from {site_packages / SITE_RECEIPT_NAME}, the receipt apply wrote")
    return actual


def plan_verify(tool: Path, site_packages: Path) -> Plan:
    sha = check_receipt(site_packages, RECEIPT, RECEIPT_SHA256)
    argv = [sys.executable, str(tool / "scripts" / "overlay.py"), "verify", "--site-packages", str(site_packages)]
    return Plan(argv, {}, f"dsa-image: receipt {RECEIPT} sha256 {sha} matches the build; running {' '.join(argv)}")


def _required_env(environ: dict[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not value:
        raise EntrypointError(f"environment variable {name} is not set; the image's Dockerfile sets it")
    return value


def _recipe_and_target(environ: dict[str, str]) -> tuple[Recipe, Target]:
    tool = Path(_required_env(environ, "DSA_IMAGE_TOOL"))
    try:
        recipe = load_recipe(_required_env(environ, "DSA_IMAGE_RECIPE"), tool / "recipes",
                             _required_env(environ, "DSA_IMAGE_VLLM"))
        return recipe, recipe.target(_required_env(environ, "DSA_IMAGE_TARGET"))
    except RecipeError as exc:
        raise EntrypointError(str(exc)) from exc


def _no_arguments(mode: str, args: list[str]) -> None:
    if args:
        raise UsageError(f"`{mode}` takes no arguments, got: {' '.join(args)} (a model or directory named "
                         f"{mode!r} is served with: docker run IMAGE serve {mode} ...)")


def _serve(args: list[str], environ: dict[str, str]) -> Plan:
    recipe, target = _recipe_and_target(environ)
    served = plan_serve(args, recipe, target, environ)
    return served if _asks_for_help(args) else warmed_up(served, environ)


# main() drops PYTHONPATH before exec (vLLM needs none), so the tool's path travels as an argument.
def tool_main(tool: str, module: str, args: list[str]) -> list[str]:
    """`python -c ... TOOL ARGS`: dsa_image.<module>.main(ARGS), imported from TOOL."""
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
            f"from dsa_image.{module} import main; sys.exit(main(sys.argv[1:]))")
    return [sys.executable, "-c", code, tool, *args]


def warmed_up(served: Plan, environ: dict[str, str]) -> Plan:
    """`served` (vllm serve ...) under the warm-up supervisor, or as it is with DSA_IMAGE_WARMUP=0.
    A setting it cannot read stops here, before a GPU is touched, naming the variable."""
    try:
        enabled = warmup.Settings.from_env(environ).enabled
    except ValueError as exc:
        raise EntrypointError(f"{exc}; `docker run IMAGE --help` lists the warm-up's variables") from None
    if not enabled:
        off = f"{warmup.SWITCH_ENV}={environ[warmup.SWITCH_ENV]}"
        return replace(served, log=f"{served.log}\ndsa-image: {off}: no warm-up, healthy as soon as vLLM's "
                                   "/health answers (first requests may compile kernels)")
    argv = tool_main(_required_env(environ, "DSA_IMAGE_TOOL"), "runtime.warmup", ["supervise", "--", *served.argv])
    return replace(served, argv=argv,
                   log=f"{served.log}\ndsa-image: healthy once vLLM's /health answers and the warm-up requests "
                       f"are done (the log shows each step; {warmup.SWITCH_ENV}=0 skips them)")


def _verify(args: list[str], environ: dict[str, str]) -> Plan:
    _no_arguments("verify", args)
    tool = Path(_required_env(environ, "DSA_IMAGE_TOOL"))
    return plan_verify(tool, Path(_required_env(environ, "DSA_IMAGE_SITE_PACKAGES")))


def _selftest(args: list[str], environ: dict[str, str]) -> Plan:
    tool = _required_env(environ, "DSA_IMAGE_TOOL")
    return Plan(tool_main(tool, "runtime.selftest", args),
                log="dsa-image: DSA indexer self-test: " + (" ".join(args) or "the kernels this GPU uses"),
                gpu_for="" if _asks_for_help(args) else "the self-test runs the indexer kernels on it")


# -- Ray cluster modes (vLLM's examples/online_serving/run_cluster.sh, as one image) ----------

RAY_PORT = "RAY_PORT"
DEFAULT_RAY_PORT = "6379"
# What multi-node serving reads from the environment; the container passes every variable on
# unchanged (exec keeps the environment), --help lists these so users know to set them.
CLUSTER_ENV = {
    "VLLM_HOST_IP": "this node's address on the link between nodes (Ray's --node-ip-address too)",
    "NCCL_SOCKET_IFNAME": "the network interface NCCL bootstraps over (e.g. the ConnectX one)",
    "GLOO_SOCKET_IFNAME": "the same for gloo (torch.distributed's CPU groups)",
    "NCCL_IB_HCA": "which RDMA devices NCCL uses (e.g. mlx5_0)",
    "NCCL_IB_DISABLE": "1: no RDMA, NCCL over TCP sockets",
    RAY_PORT: f"the head's GCS port (default {DEFAULT_RAY_PORT})",
}


def _node_ip(environ: dict[str, str]) -> list[str]:
    ip = environ.get("VLLM_HOST_IP", "")
    return [f"--node-ip-address={ip}"] if ip else []


def _ray_head(args: list[str], environ: dict[str, str]) -> Plan:
    port = environ.get(RAY_PORT) or DEFAULT_RAY_PORT
    argv = ["ray", "start", "--head", f"--port={port}", *_node_ip(environ), "--block", *args]
    return Plan(argv, log=f"dsa-image: Ray head on port {port}: {' '.join(argv)}; then, in this container: "
                          "docker exec -it CONTAINER dsa-image serve MODEL --distributed-executor-backend ray ...",
                gpu_for="a Ray node offers this node's GPUs to vLLM")


def _ray_worker(args: list[str], environ: dict[str, str]) -> Plan:
    if not args or args[0].startswith("-"):
        raise UsageError("`ray-worker` needs the head's address first: ray-worker HEAD_IP[:PORT] [ray start flags]")
    head, rest = args[0], args[1:]
    address = head if ":" in head else f"{head}:{environ.get(RAY_PORT) or DEFAULT_RAY_PORT}"
    argv = ["ray", "start", f"--address={address}", *_node_ip(environ), "--block", *rest]
    return Plan(argv, log=f"dsa-image: Ray worker joining {address}: {' '.join(argv)}",
                gpu_for="a Ray node offers this node's GPUs to vLLM")


def _recipe(args: list[str], environ: dict[str, str]) -> Plan:
    # Imported here: only this mode needs the recipe runner and its memory plan.
    from dsa_image.serving import cli as serving_cli

    result = serving_cli.image_mode(args, environ)
    if result.error:
        error = EntrypointError(result.error)
        error.exit_code = result.exit_code
        raise error
    if not result.argv:  # --list, --dry-run: printed, nothing served
        return Plan([], output=result.output, exit_code=result.exit_code)
    return warmed_up(Plan(result.argv, result.env, result.log, gpu_for=SERVE_NEEDS_GPU), environ)


def _help(args: list[str], environ: dict[str, str]) -> Plan:
    _no_arguments("help", args)
    return Plan([], output=usage(environ))


MODES: dict[str, Mode] = {
    "serve": Mode(_serve, "[MODEL] [VLLM SERVE FLAGS...]",
                  "vllm serve MODEL (default: the built-in tiny GLM-5, random weights) with the "
                  "recipe's defaults; the default mode. Needs a GPU: docker run --gpus all ..."),
    "verify": Mode(_verify, "",
                   "check the receipt against the build's record and re-verify every overlaid file "
                   "and module; no GPU needed"),
    "selftest": Mode(_selftest, "[--kernels auto|b12x|deepgemm] [--json FILE|-]",
                     "run the DSA indexer kernels this image uses on this GPU (b12x on sm_120/121, DeepGEMM "
                     "on sm_90/sm_100) against the torch reference on seeded inputs, incl. a long prefill; "
                     f"prints a table; its exit codes: {status.SUCCESS} agree, {status.FAILED} mismatch, "
                     f"{status.NO_GPU} no GPU, {status.REFUSED} refused for this GPU, {status.ENVIRONMENT} torch or vLLM "
                     f"missing or broken, {status.CRASHED} a kernel raised"),
    "recipe": Mode(_recipe, "--list | NAME [--dry-run] [--set KEY=VALUE ...] [-- VLLM ARGS]",
                   "a serving recipe (recipes/serve/): --list and --dry-run print the memory plan and the "
                   "docker / vllm commands per node, no GPU needed; NAME serves it in this container (one "
                   f"node). Refused: exit {REFUSED} (layout: memory, TP/PP, cluster-only; another image target)"),
    "ray-head": Mode(_ray_head, "[RAY START FLAGS...]",
                     "start a Ray head for serving across nodes (blocks; VLLM_HOST_IP, RAY_PORT); then serve "
                     "from it with --distributed-executor-backend ray (docs/cluster.md)"),
    "ray-worker": Mode(_ray_worker, "HEAD_IP[:PORT] [RAY START FLAGS...]",
                       "join this node's GPUs to the Ray head at HEAD_IP (blocks)"),
    "help": Mode(_help, "", "this text (also -h, --help); no GPU needed"),
}


def split_mode(args: list[str]) -> tuple[str, list[str]]:
    """(mode, its arguments): a first argument that names no mode belongs to serve, unless it
    is a mistyped mode (UsageError)."""
    if not args:
        return DEFAULT_MODE, []
    if args[0] in HELP_FLAGS:
        return "help", args[1:]
    if args[0] in MODES:
        return args[0], args[1:]
    meant = mistyped_mode(args[0])
    if meant:
        raise UsageError(f"unknown mode {args[0]!r}, did you mean {meant}? (a model of that name is served with: "
                         f"docker run IMAGE serve {args[0]} ...)")
    return DEFAULT_MODE, args


def mistyped_mode(word: str) -> str | None:
    """The mode `word` is a typo of, or None. A word with a `/` (a Hugging Face repository id, a
    path) or naming an existing path is a model, whatever it looks like; so is one close to no
    mode (`gpt2`: a repository id without an owner)."""
    if word.startswith("-") or "/" in word or Path(word).exists():
        return None
    close = difflib.get_close_matches(word, list(MODES), n=1, cutoff=0.75)
    return close[0] if close else None


def _defaults_text(environ: dict[str, str]) -> list[str]:
    try:
        recipe, target = _recipe_and_target(environ)
    except EntrypointError as exc:
        return [f"  (cannot show them: {exc})"]
    serving = recipe.serving
    lines = [f"  recipe {recipe.id}, target {target.id}, vLLM {recipe.vllm_version}: {target.description}",
             f"  with no MODEL: {' '.join(default_model_argv(recipe))}",
             "    (any arguments replace these; the same model with vLLM's own start-up defaults:",
             f"    {serving['default_model']} --load-format {serving['default_load_format']})"]
    lines += [f"  {flag} {value}" for flag, value in serving_defaults(recipe, target)]
    lines.append("  environment, unless the container sets it: "
                 + (" ".join(f"{k}={v}" for k, v in sorted(target.env.items())) or "(none for this target)"))
    return lines


def vllm_serve_docs(version: str) -> str:
    return f"https://docs.vllm.ai/en/v{version}/cli/serve/"


def _vllm_serve_docs(environ: dict[str, str]) -> str:
    try:
        return vllm_serve_docs(_recipe_and_target(environ)[0].vllm_version)
    except EntrypointError:
        return "https://docs.vllm.ai (CLI reference, vllm serve)"


def usage(environ: dict[str, str]) -> str:
    lines = ["usage: docker run [--gpus all] [-p 8000:8000] IMAGE [MODE] [ARGS...]", "", "modes:"]
    for name, mode in MODES.items():
        lines.append(f"  {name} {mode.synopsis}".rstrip())
        lines += textwrap.wrap(mode.summary, width=92, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines += ["",
              "A first argument that names no mode goes to serve: `docker run IMAGE zai-org/GLM-5 -tp 4`",
              "is `serve zai-org/GLM-5 -tp 4` (a word close to a mode's name, with no / and no such path, is",
              "refused as a mistyped mode). vLLM's own flags: docker run --gpus all IMAGE serve --help",
              "(or --help=all, --help=<group>), passed through unchanged; vLLM needs a GPU even for its",
              f"help, so without one read {_vllm_serve_docs(environ)}",
              "",
              "serve adds each of these unless ARGS, or the --config file they name, set the flag:"]
    lines += _defaults_text(environ)
    lines += ["", "environment:"]
    lines += [f"  {name:<24} {what}" for name, what in IMAGE_ENV.items()]
    lines += ["", "warm-up (serve; set them with docker run -e):"]
    lines += [_env_line(name, what) for name, what in WARMUP_ENV.items()]
    lines += [f"  compile caches (Triton, Inductor, vLLM, FlashInfer, DeepGEMM, CUDA) live under {CACHE_DIR}:",
              f"  docker run -v dsa-image-cache:{CACHE_DIR} keeps them, so a restart reuses what runs before compiled"]
    lines += ["", "across nodes (passed on unchanged; set them with docker run -e):"]
    lines += [f"  {name:<24} {what}" for name, what in CLUSTER_ENV.items()]
    lines += [f"  {SKIP_GPU_CHECK:<24} 1: serve without first checking that a GPU is visible",
              f"  {'NVIDIA_VISIBLE_DEVICES':<24} which GPUs the NVIDIA runtime mounts (the image says all; --gpus picks)",
              f"  {'CUDA_VISIBLE_DEVICES':<24} which of those vLLM uses",
              "  and whatever vLLM and Hugging Face read (VLLM_*, HF_TOKEN, HF_HOME ...).",
              ""]
    return "\n".join(lines) + "\n" + EXIT_CODES


def _env_line(name: str, what: str) -> str:
    # A name longer than the column gets a line of its own, the description below it.
    lines = textwrap.wrap(what, width=96, initial_indent=" " * 27, subsequent_indent=" " * 27)
    if len(name) < 25:
        return f"  {name:<24} {lines[0].lstrip()}" + "".join(f"\n{line}" for line in lines[1:])
    return f"  {name}\n" + "\n".join(lines)


def plan(args: list[str], environ: dict[str, str]) -> Plan:
    mode, rest = split_mode(args)
    return MODES[mode].handler(rest, environ)


# -- is a GPU visible? -----------------------------------------------------------------------

_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
HOW_TO_PASS_GPUS = ("start the container with GPUs: docker run --gpus all ... (the host needs the NVIDIA "
                    "driver and the NVIDIA Container Toolkit); `IMAGE --help` and `IMAGE verify` work without one")


def cuda_device_problem(library: str = LIBCUDA) -> str | None:
    """Why the CUDA driver offers no GPU to this process (a few words), or None when it sees one
    or more. Initialises CUDA: call it in a child process (gpu_problem), not in one that goes
    on to exec vLLM."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return f"{library}, the NVIDIA driver, is not in the container"
    cuda.cuInit.argtypes = [ctypes.c_uint]
    cuda.cuInit.restype = ctypes.c_int
    cuda.cuDeviceGetCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
    cuda.cuDeviceGetCount.restype = ctypes.c_int
    status = cuda.cuInit(0)
    if status == _CUDA_ERROR_NO_DEVICE:
        return (f"the driver lists no device; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}, "
                f"NVIDIA_VISIBLE_DEVICES={os.environ.get('NVIDIA_VISIBLE_DEVICES', '(unset)')}")
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
        return "cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER, the host's NVIDIA driver is too old for this image's CUDA 13"
    if status != 0:
        return f"cuInit failed with CUDA error {status}"
    count = ctypes.c_int(0)
    status = cuda.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value < 1:
        return f"cuDeviceGetCount gave {count.value} devices, CUDA error {status}"
    return None


def gpu_problem(library: str = LIBCUDA) -> str | None:
    """cuda_device_problem in a forked child: this process then execs vLLM with no CUDA state
    (driver handles, a context) left over from the check."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running any of the parent's cleanup
        os.close(read_end)
        try:
            message = cuda_device_problem(library) or ""
        except BaseException as exc:  # noqa: BLE001 - whatever happens, the parent gets a line
            message = f"the check itself failed: {exc!r}"
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return f"the check ({library}: cuInit, cuDeviceGetCount) crashed, wait status {status}"
    return message or None


def main(argv: list[str] | None = None, gpu_check: Callable[[], str | None] = gpu_problem) -> int:
    args = sys.argv[1:] if argv is None else argv
    environ = dict(os.environ)
    try:
        chosen = plan(args, environ)
    except EntrypointError as exc:
        hint = "; docker run IMAGE --help lists the modes" if isinstance(exc, UsageError) else ""
        print(f"dsa-image: {exc}{hint}", file=sys.stderr)
        return exc.exit_code
    if not chosen.argv:
        sys.stdout.write(chosen.output)
        return chosen.exit_code
    if chosen.gpu_for and environ.get(SKIP_GPU_CHECK) != "1":
        problem = gpu_check()
        if problem:
            print(f"dsa-image: no usable NVIDIA GPU is visible ({problem}), and {chosen.gpu_for}; "
                  f"{HOW_TO_PASS_GPUS}", file=sys.stderr)
            return NO_GPU
    print(chosen.log, file=sys.stderr, flush=True)
    env = {**environ, **chosen.env}
    env.pop("PYTHONPATH", None)  # set only so this module could be found; vLLM needs none
    os.execvpe(chosen.argv[0], chosen.argv, env)
    return OK  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
