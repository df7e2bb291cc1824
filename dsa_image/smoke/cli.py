"""Command line of the smoke test (scripts/smoke.py is a thin face over `main`)."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from dsa_image.core import status
from dsa_image.core.recipe import DEFAULT_RECIPE, RecipeError, load_recipe
from dsa_image.smoke.layout import BACKENDS, GpuRequest, Layout, LayoutError, positive_int, server_args_problem
from dsa_image.smoke.owner import CLEANUP_COMMAND
from dsa_image.smoke.report import LOG_NAME, REPORT_NAME, Report
from dsa_image.smoke.run import DEFAULT_HEALTH_TIMEOUT_S, StartError, print_summary, run_smoke, resolve_target
from dsa_image.build.tiny_model import TinyModelError, write_model

USAGE = """\
smoke.py --runtime docker --image IMAGE [--gpus all|N|device=I,J] [LAYOUT] [--target T] [--out DIR] [-- SERVER_ARG...]
smoke.py --runtime local --python EXE [--site-packages DIR] [LAYOUT] [--target T] [--out DIR] [-- SERVER_ARG...]
LAYOUT: [--tensor-parallel-size N] [--pipeline-parallel-size N] [--distributed-executor-backend mp|ray]"""

INTERRUPTED = status.killed_by(signal.SIGINT)  # 130, whichever signal stopped the run

EPILOG = f"""\
Arguments after `--` go to the server (`vllm serve`), e.g. -- --enforce-eager --gpu-memory-utilization 0.15
(the layout flags go before `--`: smoke.py checks that many GPUs are visible, and with
--distributed-executor-backend ray that Ray imports, before starting; the report's `parallel`
section records the layout, the GPUs used, the ranks and Ray lines of the log, the serve argv).

Writes DIR/{REPORT_NAME} (every check with its reason, GPU, image, versions, timings) and
DIR/{LOG_NAME} (the server's whole log). The container or process group is removed / killed
on success, failure, timeout, Ctrl-C and SIGTERM. A container left by a docker run killed with
SIGKILL is removed by the next docker run once its owner is gone; others are named and kept.
Every smoke container, when no smoke run is going on: {CLEANUP_COMMAND}

""" + status.epilog(
    (status.SUCCESS, "every check passed"),
    (status.FAILED, "a check failed (the report says which and why)"),
    (status.USAGE, "bad usage or input (unknown target, no Docker engine, no such image or python; a layout over "
                   "more GPUs than visible, or their number unknown; the ray executor without an importable Ray)"),
    notes=(f"{INTERRUPTED} interrupted (Ctrl-C, SIGTERM or SIGHUP; the shell's code for SIGINT): the report is still "
           "written.",)).rstrip("\n")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    server_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_args = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="smoke.py", usage=USAGE, epilog=EPILOG,
                                     description="Serve a GLM-5 model and prove the overlay is what runs.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", choices=("docker", "local"), required=True)
    parser.add_argument("--image", help="docker: the image to run (pulled when not present)")
    parser.add_argument("--python", help="local: the Python of the environment vLLM is installed in")
    parser.add_argument("--site-packages", help="local: the site dir holding vLLM + overlay (put first on "
                                                "PYTHONPATH; default: the python's own purelib)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--target", help="recipe target (sm120, sm100, sm90); default: the image's "
                                         "dsa-image.target label, else the target built for the GPU")
    parser.add_argument("--model", help="model to serve; default: docker: the image's built-in tiny GLM-5, "
                                        "local: the tiny GLM-5, written to a scratch directory for the run")
    parser.add_argument("--load-format", help="local: default the recipe's (dummy) for the tiny model, auto otherwise")
    parser.add_argument("--port", type=int, help="local: default the recipe's serving port")
    parser.add_argument("--network", choices=("host", "bridge"), default="host",
                        help="docker: host (default) or a published port on 127.0.0.1")
    parser.add_argument("--no-gpus", action="store_true",
                        help="docker: start without a GPU request (CI: shows how the image fails without one)")
    parser.add_argument("--gpus", type=GpuRequest.parse, metavar="all|N|device=I,J",
                        help="docker: the GPUs the container gets (default all); local: CUDA_VISIBLE_DEVICES picks")
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N",
                        help="serve with vLLM's --tensor-parallel-size N (default 1)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, default=1, metavar="N",
                        help="serve with vLLM's --pipeline-parallel-size N (default 1)")
    parser.add_argument("--distributed-executor-backend", choices=BACKENDS,
                        help="vLLM's executor: mp (processes on this host) or ray (vLLM starts a local Ray "
                             "instance unless RAY_ADDRESS or a `ray start` here names a cluster); default: "
                             "vLLM's choice")
    parser.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S, metavar="SECONDS")
    parser.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--out", type=Path, default=Path("smoke-report"), help="report directory (default ./smoke-report)")
    parser.add_argument("--quiet", action="store_true", help="do not echo the server log to stderr")
    args = parser.parse_args(argv)
    if args.runtime == "docker" and not args.image:
        parser.error("--runtime docker needs --image")
    if args.runtime == "local" and not args.python:
        parser.error("--runtime local needs --python")
    if args.gpus and (args.no_gpus or args.runtime != "docker"):
        parser.error("--gpus is for --runtime docker without --no-gpus (locally, CUDA_VISIBLE_DEVICES picks the GPUs)")
    problem = server_args_problem(server_args)
    if problem:
        parser.error(problem)
    return args, server_args


def layout_of(args: argparse.Namespace) -> Layout:
    return Layout(args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend)


def ray_pin(recipe) -> str:
    return next((p for p in recipe.cluster_packages if p.split("==")[0] == "ray"), "ray")


def recipe_for_base(recipe_id: str, vllm: str, where: str):
    """The recipe for the vLLM release `where` serves; a release it does not pin is bad input."""
    try:
        return load_recipe(recipe_id, vllm=vllm)
    except RecipeError as e:
        raise RecipeError(f"{where} serves vLLM {vllm}: {e}") from None


def build_local(args, server_args, report: Report, echo, scratch: Path):
    from dsa_image.smoke.local_runtime import (LocalServer, environment_versions, preflight, serve_command,
                                               server_env, site_env)

    # The recipe base is the vLLM the environment holds: its expectations and its overlay's
    # manifest are the ones this run checks.
    versions = environment_versions(args.python, site_env(args.site_packages))
    recipe = recipe_for_base(args.recipe, versions["vllm"],
                             f"{args.python} (--site-packages {args.site_packages or 'none'})")
    # Without --target the GPU decides (sm_90 -> sm90 ...): its env and KV cache dtype shape the server.
    target = resolve_target(recipe, args.target, {} if args.target else _host_gpu())
    layout = layout_of(args)
    env = server_env(target, args.site_packages, layout)
    report.parallel = preflight(args.python, env, layout, ray_pin(recipe))
    # The tiny model goes to a scratch directory, removed after the run: the report directory
    # keeps only the report and the log (it may be committed).
    model = args.model or str(write_model(scratch / "tiny-glm5")[0].parent)
    load_format = args.load_format or (recipe.serving["default_load_format"] if not args.model else "auto")
    port = args.port or int(recipe.serving["port"])
    command = serve_command(args.python, model, recipe, target, port, load_format,
                            layout.server_flags() + server_args)
    report.model, report.server_command, report.target = model, command, target.id
    report.parallel["serve_argv"] = command
    server = LocalServer(command, args.python, args.site_packages, env, port, args.out / LOG_NAME, echo, versions)
    return server, target.id, recipe


def build_docker(args, server_args, report: Report, echo, scratch: Path):
    from dsa_image.smoke.gpu import query_inventory
    from dsa_image.smoke.layout import check_fits, layout_record, visible_docker

    layout = layout_of(args)
    gpus = None if args.no_gpus else (args.gpus or GpuRequest())
    visible = visible_docker(gpus, query_inventory())
    check_fits(layout, visible)
    # the Docker SDK: only once the layout fits
    from dsa_image.smoke.docker_runtime import VLLM_LABEL, DockerServer, engine_client, find_image

    # The recipe base is the image's (its dsa-image.vllm.version label): the expectations the
    # run checks are that base's. The image's own `verify` checks its own base.
    client = engine_client()
    image = find_image(client, args.image)
    vllm = (image.labels or {}).get(VLLM_LABEL)
    recipe = recipe_for_base(args.recipe, vllm, f"image {args.image}") if vllm else load_recipe(args.recipe)

    # The image carries Ray (the recipe's [cluster] pin); without RAY_ADDRESS vLLM starts a
    # Ray instance of its own in the container, one node with the container's GPUs.
    ray = ({"instance": "a local instance vLLM starts in the container", "node_count": 1}
           if layout.backend == "ray" else None)
    report.parallel = layout_record(layout, visible, ray)
    server_args = layout.server_flags() + server_args
    # The image serves its built-in model when given no arguments; with server arguments it
    # serves the first one, so name the built-in model (and its dummy weights) explicitly.
    if args.model:
        image_args = [args.model, *server_args]
    elif server_args:
        image_args = [recipe.serving["default_model"], "--load-format", recipe.serving["default_load_format"],
                      *server_args]
    else:
        image_args = []
    server = DockerServer(args.image, image_args, int(recipe.serving["port"]), args.network, gpus,
                          args.out / LOG_NAME, echo, client=client, env=layout.server_env(), image=image)
    target = args.target or server.image_target()
    server.port = server.image_port(server.port)
    server.base_url = f"http://127.0.0.1:{server.port}"
    report.model = args.model or recipe.serving["default_model"]
    report.server_command = server.run_command()
    return server, target, recipe


def _host_gpu() -> dict:
    from dsa_image.smoke.gpu import query_gpus

    return query_gpus()


def main(argv: list[str] | None = None) -> int:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    echo = None if args.quiet else sys.stderr
    with tempfile.TemporaryDirectory(prefix="dsa-smoke-") as scratch:
        try:
            report = Report(runtime=args.runtime)
            build = build_docker if args.runtime == "docker" else build_local
            args.out.mkdir(parents=True, exist_ok=True)
            server, target, recipe = build(args, server_args, report, echo, Path(scratch))
            report.served_model_name = recipe.serving["served_model_name"]
        except (RecipeError, TinyModelError, StartError, LayoutError, OSError) as e:
            print(f"smoke: {e}", file=sys.stderr)
            return status.USAGE
        report = run_smoke(server, report, recipe, target, args.out, args.health_timeout, args.request_timeout,
                           layout_of(args))
    print_summary(report, args.out / REPORT_NAME)
    if report.interrupted:
        return INTERRUPTED
    return status.SUCCESS if report.passed else status.FAILED
