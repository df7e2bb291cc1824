"""The harnesses' one HTTP client (dsa_image/harness/client.py) as its callers outside smoke use
it: the shared server lifecycle's /health and completion, the recipe runs' POST that keeps a
failed request's status for the record. Against the smoke tests' fake vLLM, on a real socket."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import free_port  # noqa: E402

from dsa_image.harness import server  # noqa: E402
from dsa_image.harness.client import Client, HttpError  # noqa: E402
from dsa_image.validation import recipes  # noqa: E402


class _Running:
    def poll(self):
        return None


def test_health_and_a_completion_through_the_one_client():
    with FakeServer(FakeVllm(served_name=server.SERVED_NAME)) as fake:
        assert server.is_healthy({"name": "fake", "port": fake.port, "proc": _Running(), "log": "-"})
        assert recipes._healthy(fake.port)
        answer = server.complete(fake.port, [1, 2, 3])
    assert len(answer["token_ids"]) == server.MAX_TOKENS == len(answer["logprobs"])
    assert not recipes._healthy(fake.port)  # stopped: nothing answers


def test_a_failed_post_keeps_the_status_the_server_answered_with():
    with FakeServer(FakeVllm(faults={"http_500"})) as fake:
        failed = recipes._post(fake.port, "/v1/completions", {"prompt": [1], "max_tokens": 2})
        try:
            Client.local(fake.port).post("/v1/completions", {"prompt": [1]})
        except HttpError as exc:
            assert exc.status == 500
        else:
            raise AssertionError("HTTP 500 did not raise")
    assert failed["status"] == 500 and "EngineCore died" in failed["body"], failed


def test_a_post_to_nothing_has_no_status():
    failed = recipes._post(free_port(), "/v1/completions", {"prompt": [1]}, timeout=5)
    assert failed["status"] is None and "POST http://127.0.0.1:" in failed["body"], failed


def test_the_serving_modes_batch_gets_each_prompts_choice_in_order_and_an_http_error_names_the_port():
    from dsa_image.validation import serving_modes

    with FakeServer(FakeVllm(served_name=server.SERVED_NAME)) as fake:
        answers = serving_modes.complete_batch(fake.port, [[1, 2], [3, 4, 5]], 4, timeout=10)
    assert len(answers) == 2 and all(len(a["token_ids"]) == 4 == len(a["logprobs"]) for a in answers)
    with FakeServer(FakeVllm(served_name=server.SERVED_NAME, faults={"http_500"})) as fake:
        try:
            serving_modes.complete_batch(fake.port, [[1]], 2, timeout=10)
        except RuntimeError as exc:
            assert str(exc).startswith(f"port {fake.port}: POST ") and "HTTP 500" in str(exc)
        else:
            raise AssertionError("an HTTP 500 must raise")


def test_open_stream_gives_each_event_with_its_arrival_in_order():
    import time

    with FakeServer(FakeVllm(token_s=0.01)) as fake:
        before = time.perf_counter()
        with Client.local(fake.port).open_stream(
                "/v1/completions", {"model": "glm-5", "prompt": [1], "max_tokens": 3, "stream": True}) as (code, events):
            arrived = list(events)
    assert code == 200 and arrived[-1][1] == "[DONE]" and len(arrived) >= 4
    times = [t for t, _ in arrived]
    assert before <= times[0] and times == sorted(times)
