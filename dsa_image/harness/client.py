"""The harnesses' one OpenAI-compatible HTTP client (smoke, validation, bench, the shared server
lifecycle): GET, POST, a server-sent-event stream (whole, or event by event with each one's
arrival time), the status of a path. On urllib: the smoke test's local runtime must work in a
Python environment that has no `requests`."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

from dsa_image.core import status


class HttpError(status.DsaImageError):
    """A request failed: no connection, a non-2xx status, or a body that is not JSON. `status`:
    the HTTP status the server answered with, None when none answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Response:
    status: int
    body: Any  # parsed JSON, or the text when not JSON
    seconds: float


@dataclass
class StreamResponse:
    status: int
    events: list[str]  # the payload of each `data:` line, in order ("[DONE]" included)
    seconds: float


class Client:
    def __init__(self, base_url: str, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    @classmethod
    def local(cls, port: int, timeout_s: float = 120.0) -> "Client":
        """A server this host started, on loopback."""
        return cls(f"http://127.0.0.1:{port}", timeout_s)

    def _request(self, method: str, path: str, payload: Any = None) -> urllib.request.Request:
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        return urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)

    def _open(self, request: urllib.request.Request, timeout_s: float | None):
        try:
            return urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s)
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")[:2000]
            raise HttpError(f"{request.get_method()} {request.full_url}: HTTP {e.code}: {body}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise HttpError(f"{request.get_method()} {request.full_url}: {e}") from None

    def status(self, path: str, timeout_s: float = 5.0) -> int | None:
        """The HTTP status of GET `path`, or None when nothing answers."""
        try:
            with urllib.request.urlopen(self._request("GET", path), timeout=timeout_s) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return None

    def get(self, path: str) -> Response:
        return self._json(self._request("GET", path))

    def post(self, path: str, payload: Any) -> Response:
        return self._json(self._request("POST", path, payload))

    def _json(self, request: urllib.request.Request) -> Response:
        start = time.monotonic()
        with self._open(request, None) as r:
            raw = r.read().decode(errors="replace")
            status = r.status
        seconds = time.monotonic() - start
        try:
            # json accepts NaN / Infinity literals: the checks must see them, not a parse error.
            body = json.loads(raw)
        except json.JSONDecodeError:
            raise HttpError(f"{request.get_method()} {request.full_url}: not JSON: {raw[:500]!r}", status) from None
        return Response(status, body, seconds)

    def post_stream(self, path: str, payload: Any) -> StreamResponse:
        """POST and read a server-sent-event stream to its end (the server closing it)."""
        start = time.monotonic()
        with self.open_stream(path, payload) as (status, events):
            payloads = [data for _, data in events]
        return StreamResponse(status, payloads, time.monotonic() - start)

    @contextlib.contextmanager
    def open_stream(self, path: str, payload: Any) -> Iterator[tuple[int, Iterator[tuple[float, str]]]]:
        """POST; (status, events): each `data:` payload as it arrives, with its arrival
        (time.perf_counter(), read before the payload is parsed: a benchmark times tokens by it)."""
        with self._open(self._request("POST", path, payload), None) as r:
            yield r.status, _events(r)


def _events(response) -> Iterator[tuple[float, str]]:
    for raw_line in response:
        line = raw_line.decode(errors="replace").strip()
        if line.startswith("data:"):
            yield time.perf_counter(), line[len("data:"):].strip()
