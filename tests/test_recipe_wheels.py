"""dsa_image.core.wheels against a local PEP 691 index: download, verification, refusal."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import socket
import threading
import urllib.error

import pytest

from dsa_image.core import wheels

FILENAME = "fakepkg-1.0-py3-none-any.whl"
PAYLOAD = b"not really a zip, but bytes with a hash"
SHA = hashlib.sha256(PAYLOAD).hexdigest()
SDIST = "fakepkg-1.0.tar.gz"  # an sdist: the vLLM sdists (upstream's tests) come this way
SDIST_PAYLOAD = b"not really a tarball either"
SDIST_SHA = hashlib.sha256(SDIST_PAYLOAD).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A PEP 691 JSON simple index on 127.0.0.1 listing a wheel and an sdist; `listed_sha` is
    what the index claims for the wheel, PAYLOAD what it serves."""
    state = {"listed_sha": SHA, "downloads": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            served = {FILENAME: PAYLOAD, SDIST: SDIST_PAYLOAD}
            if self.path == "/simple/fakepkg/":
                listed = {FILENAME: state["listed_sha"], SDIST: SDIST_SHA}
                body = json.dumps({"meta": {"api-version": "1.0"}, "name": "fakepkg", "files": [
                    {"filename": name, "url": f"/files/{name}", "hashes": {"sha256": sha}}
                    for name, sha in listed.items()]}).encode()
            elif self.path.startswith("/files/") and self.path[7:] in served:
                state["downloads"] += 1
                body = served[self.path[7:]]
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("DSA_IMAGE_CACHE", str(tmp_path / "cache"))
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/simple"
    yield state
    server.shutdown()


def test_download_verifies_and_caches(index):
    path = wheels.ensure_wheel(FILENAME, SHA, index["url"])
    assert path.read_bytes() == PAYLOAD and path.parent == wheels.cache_dir() / "wheels"
    wheels.ensure_wheel(FILENAME, SHA, index["url"])
    assert index["downloads"] == 1  # second call: from the cache, re-hashed


def test_lock_wheel_returns_the_computed_sha(index):
    path, sha = wheels.lock_wheel(FILENAME, index["url"])
    assert sha == SHA == wheels.sha256_file(path)


def test_index_and_file_disagree(index):
    index["listed_sha"] = "0" * 64
    with pytest.raises(wheels.WheelError, match="downloaded file has sha256"):
        wheels.lock_wheel(FILENAME, index["url"])
    assert list((wheels.cache_dir() / "wheels").iterdir()) == []  # nothing half-cached


def test_recipe_pin_differs_from_index(index):
    with pytest.raises(wheels.WheelError, match="the recipe pins sha256"):
        wheels.ensure_wheel(FILENAME, "1" * 64, index["url"])
    assert index["downloads"] == 0


def test_tampered_cache_is_refused(index):
    path = wheels.ensure_wheel(FILENAME, SHA, index["url"])
    path.write_bytes(PAYLOAD + b"!")
    with pytest.raises(wheels.WheelError, match="Delete the cached file"):
        wheels.ensure_wheel(FILENAME, SHA, index["url"])


def test_empty_pin_is_refused():
    with pytest.raises(wheels.WheelError, match="scripts/recipe.py lock"):
        wheels.ensure_wheel(FILENAME, "")


def test_unreachable_index(tmp_path, monkeypatch):
    monkeypatch.setenv("DSA_IMAGE_CACHE", str(tmp_path))
    with pytest.raises(wheels.WheelError, match="cannot read the package index"):
        wheels.ensure_wheel(FILENAME, SHA, "http://127.0.0.1:9/simple")


def test_an_sdist_is_fetched_pinned_and_rehashed_like_a_wheel(index):
    """The vLLM sdists (upstream's tests) take the wheels' path: the recipe's sha256 is checked
    against the index before the download and against the file on every use; kept apart."""
    assert wheels.project_of(SDIST) == "fakepkg" and wheels.project_of("vllm-0.33.0.tar.gz") == "vllm"
    with pytest.raises(wheels.WheelError, match="the recipe pins sha256"):
        wheels.ensure_wheel(SDIST, "1" * 64, index["url"])
    assert index["downloads"] == 0
    path, sha = wheels.lock_wheel(SDIST, index["url"])
    assert sha == SDIST_SHA and path.parent == wheels.cache_dir() / "sdists"
    assert wheels.ensure_wheel(SDIST, SDIST_SHA, index["url"]) == path and index["downloads"] == 1
    path.write_bytes(SDIST_PAYLOAD + b"!")
    with pytest.raises(wheels.WheelError, match=f"cached file has sha256 .*, the recipe pins {SDIST_SHA}"):
        wheels.ensure_wheel(SDIST, SDIST_SHA, index["url"])


@pytest.mark.parametrize("name", ["vllm-0.33.0.zip", "vllm.tar.gz", "vllm-0.33.0-extra.tar.gz", "vllm-0.33.0"])
def test_what_is_neither_a_wheel_nor_an_sdist_is_refused(name):
    with pytest.raises(wheels.WheelError, match="not a wheel .* or sdist"):
        wheels.project_of(name)


def test_read_member(tmp_path):
    import zipfile
    archive = tmp_path / "x.whl"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("vllm/envs.py", b"X = 1\n")
    assert wheels.read_member(archive, "vllm/envs.py") == b"X = 1\n"
    assert wheels.read_member(archive, "vllm/absent.py") is None


# -- the index, when the network hiccups -----------------------------------------------------------


class _Page:
    def __init__(self, body: bytes):
        self.body = body

    def __enter__(self):
        return io.BytesIO(self.body)

    def __exit__(self, *exc):
        return False


def _index_answers(monkeypatch, answers):
    """urlopen answering each call with the next of `answers` (an exception is raised)."""
    calls = []

    def urlopen(request, timeout):
        calls.append(request.full_url)
        answer = answers[len(calls) - 1]
        if isinstance(answer, Exception):
            raise answer
        return _Page(answer)
    monkeypatch.setattr(wheels.urllib.request, "urlopen", urlopen)
    return calls


PAGE = json.dumps({"files": [{"filename": "x-1-py3-none-any.whl", "url": "x-1-py3-none-any.whl",
                              "hashes": {"sha256": "ab" * 32}}]}).encode()


def test_the_index_is_asked_again_after_a_name_resolution_failure(monkeypatch):
    gaierror = urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    calls = _index_answers(monkeypatch, [gaierror, urllib.error.HTTPError("u", 503, "busy", {}, None), PAGE])
    files = wheels.index_files("x", pauses_s=(0, 0))
    assert [f.filename for f in files] == ["x-1-py3-none-any.whl"] and len(calls) == 3


def test_a_missing_project_or_a_network_down_for_good_fails_saying_so(monkeypatch):
    _index_answers(monkeypatch, [urllib.error.HTTPError("u", 404, "Not Found", {}, None)])
    with pytest.raises(wheels.WheelError, match=r"cannot read the package index .*/x/: HTTP Error 404"):
        wheels.index_files("x", pauses_s=(0, 0))
    down = urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    _index_answers(monkeypatch, [down, down, down])
    with pytest.raises(wheels.WheelError, match=r"\(after 3 attempts\): .*name resolution"):
        wheels.index_files("x", pauses_s=(0, 0))
