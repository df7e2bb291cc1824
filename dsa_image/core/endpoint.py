"""The one HTTP layer to a vLLM server: where it listens (Endpoint: host and port, vLLM's --uds
socket, HTTPS, the API key) and one request, read whole or as a stream. The image's runtime (the
warm-up, the healthcheck, the spec-decode scrape: runtime/serve_command.py says where a command
line listens) and the harnesses' OpenAI-compatible client (dsa_image/harness/client.py) both
build on it, so a server is reached one way. Stdlib only (http.client): the runtime image
carries it."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Iterator

VLLM_DEFAULT_PORT = 8000


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over vLLM's --uds socket."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


@dataclass(frozen=True)
class Endpoint:
    scheme: str = "http"
    host: str = "127.0.0.1"
    port: int = VLLM_DEFAULT_PORT
    uds: str | None = None  # vLLM's --uds: a Unix socket instead of host and port
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        """For messages (and --uds, shown only): http+unix://PATH."""
        if self.uds:
            return f"http+unix://{self.uds}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base_url}{':' if self.uds else ''}{path}"

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> "Endpoint":
        """http(s)://HOST[:PORT] (the warm-up's `run --url`). Raises ValueError."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: expected http://HOST:PORT or https://HOST:PORT")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), None, api_key)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.uds:
            return UnixHTTPConnection(self.uds, timeout)
        if self.scheme == "https":
            # Our own server on loopback: its certificate may name a public host, not 127.0.0.1.
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(self, path: str, payload=None, timeout: float = 600.0) -> tuple[int, bytes]:
        """GET `path`, or POST `payload` as JSON: (status, body). Raises OSError /
        HTTPException when nothing answers."""
        with self.open(path, payload, timeout) as response:
            return response.status, response.read()

    @contextlib.contextmanager
    def open(self, path: str, payload=None, timeout: float = 600.0) -> Iterator[http.client.HTTPResponse]:
        """The one request: GET `path`, or POST `payload` as JSON, with the API key when vLLM
        has one; the response open to be read (a stream, line by line), closed after. Raises
        OSError / HTTPException when nothing answers."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        connection = self.connection(timeout)
        try:
            body = None if payload is None else json.dumps(payload).encode()
            connection.request("GET" if body is None else "POST", path, body, headers)
            yield connection.getresponse()
        finally:
            connection.close()
