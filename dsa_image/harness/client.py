"""The harnesses' one OpenAI-compatible client (smoke, validation, bench, the shared server
lifecycle): GET, POST, a server-sent-event stream (whole, or event by event with each one's
arrival time), the status of a path. On the image's one HTTP layer (dsa_image/core/endpoint.py:
http.client, stdlib only: the smoke test's local runtime must work in a Python environment that
has no `requests`), so the harnesses reach a server as the image's warm-up and healthcheck do."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from dataclasses import dataclass
from typing import Any, Iterator

from dsa_image.core import status
from dsa_image.core.endpoint import Endpoint


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
        """`base_url`: http(s)://HOST:PORT (ValueError otherwise)."""
        self.endpoint = Endpoint.from_url(base_url)
        self.base_url = self.endpoint.base_url
        self.timeout_s = timeout_s

    @classmethod
    def local(cls, port: int, timeout_s: float = 120.0) -> "Client":
        """A server this host started, on loopback."""
        return cls(f"http://127.0.0.1:{port}", timeout_s)

    @contextlib.contextmanager
    def _open(self, path: str, payload: Any = None, timeout_s: float | None = None) -> Iterator[http.client.HTTPResponse]:
        """The response of a 2xx answer; HttpError for no answer or another status."""
        said = self._said(path, payload)
        try:
            with self.endpoint.open(path, payload, timeout_s or self.timeout_s) as response:
                if not 200 <= response.status < 300:
                    body = response.read().decode(errors="replace")[:2000]
                    raise HttpError(f"{said}: HTTP {response.status}: {body}", response.status)
                yield response
        except (OSError, http.client.HTTPException) as e:
            raise HttpError(f"{said}: {e}") from None

    def _said(self, path: str, payload: Any) -> str:
        """A request as its errors name it: the method Endpoint.open uses, and the URL."""
        return f"{'GET' if payload is None else 'POST'} {self.endpoint.url(path)}"

    def status(self, path: str, timeout_s: float = 5.0) -> int | None:
        """The HTTP status of GET `path`, or None when nothing answers."""
        try:
            return self.endpoint.request(path, timeout=timeout_s)[0]
        except (OSError, http.client.HTTPException):
            return None

    def get(self, path: str) -> Response:
        return self._json(path, None)

    def post(self, path: str, payload: Any) -> Response:
        return self._json(path, payload)

    def _json(self, path: str, payload: Any) -> Response:
        start = time.monotonic()
        with self._open(path, payload) as r:
            raw = r.read().decode(errors="replace")
            status = r.status
        seconds = time.monotonic() - start
        try:
            # json accepts NaN / Infinity literals: the checks must see them, not a parse error.
            body = json.loads(raw)
        except json.JSONDecodeError:
            raise HttpError(f"{self._said(path, payload)}: not JSON: {raw[:500]!r}", status) from None
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
        with self._open(path, payload) as r:
            yield r.status, _events(r)


def _events(response) -> Iterator[tuple[float, str]]:
    for raw_line in response:
        line = raw_line.decode(errors="replace").strip()
        if line.startswith("data:"):
            yield time.perf_counter(), line[len("data:"):].strip()
