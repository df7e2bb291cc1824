"""The smoke test's reading of a multi-GPU server log as vLLM really writes it (no GPU): each
rank's `world_size=W rank=R ...` line, the TP/PP assignment of each node's first rank only
(`logger.info_once`, scope "local"), the workers' names in vLLM's prefix, and Ray's own prefix
on the lines it forwards. The lines follow the formats of vLLM 0.33.0's source (vllm/logger.py
`_FORMAT`, distributed/parallel_state.py, v1/executor/multiproc_executor.py) and the real
single-GPU 0.33.0 log of the H200 run docs/validation/h200-2026-11-30-vllm0_33_0-run2 (its
smoke-server.log, excerpted in tests/data/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsa_image.smoke.layout import (Layout, layout_problems, logged_layout, logged_ranks, started_ranks,
                                    summary, worker_names)

RUN2_LOG = Path(__file__).resolve().parent / "data" / "h200-vllm0_33_0-run2-smoke-server.log"
STAMP = "INFO 12-01 10:00:00"


def _init(world: int, rank: int, local: int) -> str:
    return (f"{STAMP} [parallel_state.py:1929] world_size={world} rank={rank} local_rank={local} "
            f"distributed_init_method=tcp://127.0.0.1:40123 backend=nccl")


def _assigned(world: int, rank: int, pp: int, tp: int) -> str:
    return (f"{STAMP} [parallel_state.py:2385] rank {rank} in world size {world} is assigned as DP rank 0, "
            f"PP rank {pp}, PCP rank 0, TP rank {tp}, ETP rank {tp}, EP rank {rank}, EPLB rank N/A")


def _loaded() -> str:
    return f"{STAMP} [model_runner.py:428] Model loading took 0.13 GiB memory and 3.1 seconds"


def mp_log(tp: int = 1, pp: int = 1) -> str:
    """`vllm serve --tensor-parallel-size TP --pipeline-parallel-size PP` on one host (mp): every
    worker logs its world-group line as "Worker", rank 0 alone its assignment, then each worker
    its lines under its parallel name."""
    world = tp * pp
    lines = ["(APIServer pid=10) INFO 12-01 10:00:00 [startup.py:38] version 0.33.0"]
    for rank in range(world):
        lines.append(f"(Worker pid={50 + rank}) " + _init(world, rank, rank))
    lines.append("(Worker pid=50) " + _assigned(world, 0, 0, 0))
    for rank in range(world):
        pp_rank, tp_rank = divmod(rank, tp)
        name = "Worker" + (f"_PP{pp_rank}" if pp > 1 else "") + (f"_TP{tp_rank}" if tp > 1 else "")
        lines.append(f"({name} pid={50 + rank}) " + _loaded())
    return "\n".join(lines) + "\n"


def ray_log(tp: int = 2, remote_ip: str | None = None) -> str:
    """TP over Ray: vLLM's lines of each RayWorkerProc as Ray forwards them to the engine process
    (Ray's prefix, then vLLM's). One host: rank 0 alone logs its assignment; two Ray nodes (the
    second at `remote_ip`): each node's first rank does."""
    lines = ["2026-12-01 10:00:00,000\tINFO worker.py:2012 -- Started a local Ray instance.",
             "(EngineCore pid=40) INFO 12-01 10:00:00 [ray_utils.py:364] No current placement group found. "
             "Creating a new placement group."]
    for rank in range(tp):
        ray_prefix = (f"(RayWorkerProc pid={60 + rank}, ip={remote_ip}) " if remote_ip and rank
                      else f"(RayWorkerProc pid={60 + rank}) ")
        local = 0 if remote_ip else rank
        lines.append(ray_prefix + f"(Worker pid={60 + rank}) " + _init(tp, rank, local))
        if local == 0:
            lines.append(ray_prefix + f"(Worker pid={60 + rank}) " + _assigned(tp, rank, 0, rank))
        lines.append(ray_prefix + f"(Worker_TP{rank} pid={60 + rank}) " + _loaded())
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("layout, log", [
    (Layout(2, 1, "mp"), mp_log(tp=2)),
    (Layout(2, 1), mp_log(tp=2)),
    (Layout(1, 2, "mp"), mp_log(pp=2)),
    (Layout(2, 2, "mp"), mp_log(tp=2, pp=2)),
    (Layout(2, 1, "ray"), ray_log()),
    (Layout(2, 1, "ray"), ray_log(remote_ip="10.231.1.2")),
])
def test_a_multi_gpu_log_where_only_each_nodes_first_rank_logs_its_assignment_passes(layout, log):
    assert layout_problems(log, layout, None) == []


def test_every_rank_is_counted_from_its_world_group_line():
    log = ray_log()
    assert [r["rank"] for r in logged_ranks(log)] == [0]
    assert started_ranks(log) == [{"rank": 0, "world_size": 2, "local_rank": 0},
                                  {"rank": 1, "world_size": 2, "local_rank": 1}]
    assert worker_names(log) == [{"TP": 0}, {"TP": 1}]
    parallel = {**Layout(2, 1, "ray").as_dict(), **logged_layout(log, Layout(2, 1, "ray"))}
    assert parallel["ray_log"]["placement_group_logged"] and parallel["ray_log"]["remote_worker_ips"] == []
    assert summary(parallel).endswith("ranks logged: 0, 1")
    remote = logged_layout(ray_log(remote_ip="10.231.1.2"), Layout(2, 1, "ray"))
    assert [r["rank"] for r in remote["ranks_logged"]] == [0, 1]
    assert remote["ray_log"]["remote_worker_ips"] == ["10.231.1.2"]


@pytest.mark.parametrize("layout, log, problem", [
    # Only rank 0's assignment (TP 0, PP 0, true of either layout): the workers' names tell.
    (Layout(1, 2, "mp"), mp_log(tp=2), "a worker named TP rank 1 ({'TP': 1}); expected TP ranks 0-0"),
    (Layout(2, 1, "mp"), mp_log(pp=2), "a worker named PP rank 1 ({'PP': 1}); expected PP ranks 0-0"),
    (Layout(2, 1, "ray"), ray_log().replace("rank=1 local_rank=1", "rank=3 local_rank=1"),
     "ranks [1] of world size 2 never logged their assignment"),
    (Layout(2, 1, "ray"), ray_log(remote_ip="10.231.1.2").replace("PP rank 0, PCP rank 0, TP rank 1",
                                                                  "PP rank 1, PCP rank 0, TP rank 0"),
     "rank 1 logged TP rank 0, PP rank 1; TP 2 x PP 1 puts it at TP rank 1, PP rank 0"),
    (Layout(2, 1, "mp"), "\n".join(line for line in mp_log(tp=2).splitlines() if "is assigned as" not in line),
     "no rank logged its TP/PP assignment"),
    (Layout(2, 1, "mp"), mp_log(), "world size: expected 2 (tensor x pipeline parallel), the log says 1"),
])
def test_a_log_of_another_layout_is_named(layout, log, problem):
    problems = layout_problems(log, layout, None)
    assert any(problem in p for p in problems), problems


def test_the_real_vllm_0_33_0_single_gpu_log_passes_and_names_its_rank_both_ways():
    log = RUN2_LOG.read_text()
    assert layout_problems(log, Layout(), None) == []
    assert started_ranks(log) == [{"rank": 0, "world_size": 1, "local_rank": 0}]
    assert [(r["rank"], r["world_size"]) for r in logged_ranks(log)] == [(0, 1)]
    assert worker_names(log) == []  # one GPU: the engine process runs the worker
    assert "world size: expected 2" in layout_problems(log, Layout(2), None)[0]
