"""HTTP framing for the embedded engine's routes, over the standard library's threaded server.

    httpd = EngineHTTPServer((host, port), make_handler(routes, max_body))
    httpd.serve_forever()

A thread per connection, keep-alive (HTTP/1.1). A request's body is read by Content-Length or
chunked, at most `max_body` bytes; a body that cannot be read is answered with its status
(`HTTPError`) and the connection closed. Then the API key is checked (`routes.authorized`) and
the route answers (`routes.get` / `routes.post`, server.py): a `BadRequest`, an engine state that
refuses the request or a bad value is a 400 with its message, anything else a 500 with its type
and message (the trace goes to the log). Answers are JSON (`dumps`), text, or empty.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import orjson

from rltrain.engine.embedded.requests import BadRequest
from rltrain.engine.embedded.state import EngineStateError

log = logging.getLogger("rltrain.engine.embedded")

MAX_BODY_BYTES = 256 << 20  # a weight-update request carries handles and names, not tensors: far below this
READ_TIMEOUT_S = 60.0  # a client that stops sending mid-request is dropped (its thread freed) after this
BACKLOG = 1024  # pending connections the kernel queues (the standard library's 5 reset a burst of clients)


class Routes(Protocol):
    """What the handler serves (server.py's `EmbeddedServer`)."""

    def get(self, path: str) -> tuple[int, Any]: ...

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]: ...

    def authorized(self, header: str | None) -> bool: ...


class HTTPError(Exception):
    """A request the server cannot read (framing): answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineHTTPServer(ThreadingHTTPServer):
    """A thread per connection, daemon threads, a listen backlog sized for many clients at once."""

    daemon_threads = True
    request_queue_size = BACKLOG


def dumps(payload: Any) -> bytes:
    """JSON of an answer: orjson (a rollout's answer, with its log-probs, is encoded on the
    request's critical path; see BENCHMARKS.md), json where orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(payload).encode()


def answer(route: Callable[[], tuple[int, Any]], method: str, path: str) -> tuple[int, Any]:
    """`route()`'s (status, payload), or the error it raised as one: a `BadRequest`, an engine state
    that refuses the request or a bad value is a 400 with its message, anything else a 500 with its
    type and message (the trace goes to the log)."""
    try:
        return route()
    except (BadRequest, EngineStateError, ValueError, KeyError, FileNotFoundError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return int(HTTPStatus.BAD_REQUEST), {
            "success": False,
            "message": msg,
            "error": {"message": msg, "type": type(err).__name__},
        }
    except Exception as err:  # noqa: BLE001 - the client gets the reason, the log the trace
        log.error("%s %s failed:\n%s", method, path, traceback.format_exc())
        msg = f"{type(err).__name__}: {err}"
        return int(HTTPStatus.INTERNAL_SERVER_ERROR), {"success": False, "message": msg, "error": {"message": msg}}


def make_handler(server: Routes, max_body: int = MAX_BODY_BYTES) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body leave in two writes; with Nagle's algorithm the body then waits for
        # the client's delayed ACK on every keep-alive request (every sync bucket).
        disable_nagle_algorithm = True
        timeout = READ_TIMEOUT_S  # on the socket: reads and writes, not the engine's work

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, payload: Any) -> None:
            if payload is None:
                data, ctype = b"", "text/plain"
            elif isinstance(payload, str):
                data, ctype = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = dumps(payload), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            """The request body, framed by Content-Length or chunked, at most `max_body` bytes;
            `HTTPError` otherwise (the connection is then closed: where the next request starts
            in the stream is unknown)."""
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                return self._chunked()
            text = self.headers.get("Content-Length")
            if text is None:
                return b""
            text = text.strip()
            if not text.isdigit():
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a byte count")
            length = int(text)
            if length > max_body:
                raise HTTPError(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request body of {length} bytes; this server takes at most {max_body} (--max-body-mb)",
                )
            data = self.rfile.read(length)
            if len(data) != length:
                raise HTTPError(HTTPStatus.BAD_REQUEST, f"request body ended after {len(data)} of {length} bytes")
            return data

        def _chunked(self) -> bytes:
            parts: list[bytes] = []
            total = 0
            while True:
                size_text = self.rfile.readline(1024).strip().split(b";", 1)[0]
                try:
                    size = int(size_text, 16)
                except ValueError:
                    raise HTTPError(HTTPStatus.BAD_REQUEST, f"bad chunk size {size_text[:20]!r}") from None
                if size < 0:
                    raise HTTPError(HTTPStatus.BAD_REQUEST, f"negative chunk size {size}")
                if total + size > max_body:
                    raise HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"chunked body over {max_body} bytes")
                if size == 0:
                    while self.rfile.readline(1024).strip():  # trailers, up to the blank line
                        pass
                    return b"".join(parts)
                chunk = self.rfile.read(size)
                if len(chunk) != size or self.rfile.readline(1024).strip():
                    raise HTTPError(HTTPStatus.BAD_REQUEST, "a chunk ended before its size, or without CRLF")
                parts.append(chunk)
                total += size

        def _dispatch(self, method: str) -> None:
            t0 = time.perf_counter()
            path = self.path.split("?", 1)[0]
            try:
                raw = self._body() if method != "GET" else b""
            except (HTTPError, OSError) as err:  # (a socket timeout is an OSError)
                self.close_connection = True
                status = err.status if isinstance(err, HTTPError) else int(HTTPStatus.REQUEST_TIMEOUT)
                msg = str(err) or "the request body did not arrive in time"
                self._send(int(status), {"success": False, "message": msg, "error": {"message": msg}})
                return
            if not server.authorized(self.headers.get("Authorization")):
                msg = "missing or wrong API key: send Authorization: Bearer <engine.api_key>"
                self._send(int(HTTPStatus.UNAUTHORIZED), {"success": False, "message": msg, "error": {"message": msg}})
                return

            def route() -> tuple[int, Any]:
                if method == "GET":
                    return server.get(path)
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise BadRequest(f"request body is not JSON: {err}") from None
                if not isinstance(body, dict):
                    raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
                return server.post(path, body)

            status, payload = answer(route, method, path)
            self._send(int(status), payload)
            log.debug("%s %s handled in %.2f ms", method, path, (time.perf_counter() - t0) * 1e3)

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        do_PUT = do_POST

    return Handler
