"""The HTTP transport of `EngineClient` (client.py): retries, timeouts, and two ways to post.

Most calls go through httpx (`_request`, `_post`): transport errors (connection refused or reset,
the server gone mid-request) are retried with exponential backoff; HTTP errors are not (the server
understood and said no). Calls made many times over (a weight bucket's, a multi-turn turn's) go on
plain keep-alive `http.client` connections (`_lean_call`), where httpx's own overhead is a large
share of the call.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from typing import Any

import httpx
import orjson

log = logging.getLogger("rltrain.engine")

# Idle keep-alive connections kept for reuse: one per trajectory of a multi-turn rollout of up to
# this many in flight per rank (a fresh connection per turn costs a connect and a server thread).
IDLE_CONNECTIONS = 1024


class EngineError(RuntimeError):
    """An engine endpoint failed; names the endpoint, the status and the server's message."""

    def __init__(self, endpoint: str, message: str, status: int | None = None):
        self.endpoint, self.status = endpoint, status
        where = f"HTTP {status}" if status is not None else "transport"
        super().__init__(f"engine {endpoint} failed ({where}): {message}")


# SGLang fails a weight update whose radix-cache flush it refused because its scheduler still
# counts a request as running, which it does for a moment after answering it (the overlap
# scheduler processes a batch's results an iteration later): the weights are updated, the call
# fails. Its deferred flush (/flush_cache?timeout=) waits for the scheduler to go idle.
NOT_FLUSHED = "cache was not flushed because requests are still running or queued"
LATE_FLUSH_WAIT_S = 10.0


class EngineTransport:
    """Requests to one engine server at `url` (module doc); `EngineClient` is its API."""

    def __init__(
        self,
        url: str,
        request_timeout_s: float,
        connect_timeout_s: float,
        max_inflight: int,
        retries: int,
        backoff_s: float,
        api_key: str,
    ):
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        # No bound on connections: one call's fan-out is bounded by `max_inflight` (its pool), but
        # concurrent callers (a multi-turn rollout's trajectories, each on its thread) each hold one
        # request in flight, and the engine must see all of them at once to batch them.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(max_inflight + 4, IDLE_CONNECTIONS))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._limits = limits
        self._http = self._new_http(request_timeout_s, connect_timeout_s)
        self._timeouts = (connect_timeout_s, request_timeout_s)
        self._lean: list[http.client.HTTPConnection] = []  # idle keep-alive connections
        self._lean_lock = threading.Lock()

    def _new_http(self, request_timeout_s: float, connect_timeout_s: float) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            limits=self._limits,
            headers=self._headers,
        )

    def repoint(self, url: str) -> None:
        """Talk to a restarted server at `url` from now on (the same object: what holds this
        client keeps it). Idle connections to the old server are closed."""
        self._http.close()
        self._close_idle()
        self.url = url.rstrip("/")
        self._http = self._new_http(self._timeouts[1], self._timeouts[0])

    def _request(
        self, method: str, endpoint: str, body: Any = None, *, retry_read_errors: bool = False
    ) -> httpx.Response:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                resp = self._http.request(method, endpoint, json=body)
            except (
                httpx.ConnectError,
                httpx.ConnectTimeout,
                httpx.RemoteProtocolError,
                httpx.ReadError,
                httpx.WriteError,
                httpx.PoolTimeout,
            ) as e:
                # Connection-level failures never reached a handler (or the server died in it):
                # retry. Read errors on non-idempotent calls are not retried: the call may have run.
                retryable = retry_read_errors or isinstance(
                    e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
                )
                if attempt < self.retries and retryable:
                    log.warning(
                        "engine %s %s: %s; retry %d/%d in %.1fs", method, endpoint, e, attempt + 1, self.retries, delay
                    )
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise EngineError(endpoint, f"{type(e).__name__}: {e} (after {attempt + 1} attempts)") from e
            except httpx.TimeoutException as e:
                raise EngineError(endpoint, f"no answer in time: {type(e).__name__}: {e}") from e
            if resp.status_code >= 400:
                raise EngineError(endpoint, _error_text(resp), resp.status_code)
            return resp
        raise AssertionError("unreachable")

    def _close_idle(self) -> None:
        """Close the idle keep-alive connections of `_lean_post`."""
        with self._lean_lock:
            idle, self._lean = self._lean, []
        for conn in idle:
            conn.close()

    def _lean_call(self, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
        """POST on a plain keep-alive `http.client` connection: (status, the answer parsed). For
        calls where httpx's own overhead is a large share of the call's time: once per weight
        bucket, once per turn of each of a rank's hundreds of multi-turn trajectories. Concurrent
        callers each get a connection. A request on a reused connection that the server had
        closed (idle keep-alive timeout: nothing was read) is sent once more on a fresh one, and
        the other idle connections, no younger, are dropped; anything else that fails is an
        EngineError (status None)."""
        try:
            data = orjson.dumps(body)
        except TypeError:  # (integers past 64 bits)
            data = json.dumps(body).encode()
        for attempt in range(2):
            conn = None
            if attempt == 0:
                with self._lean_lock:
                    conn = self._lean.pop() if self._lean else None
            reused = conn is not None
            if conn is None:
                url = httpx.URL(self.url)
                conn = http.client.HTTPConnection(url.host, url.port, timeout=self._timeouts[0])
            try:
                if conn.sock is None:
                    conn.connect()
                conn.sock.settimeout(self._timeouts[1])
                conn.request("POST", endpoint, body=data, headers={"Content-Type": "application/json", **self._headers})
                resp = conn.getresponse()
                status, raw = resp.status, resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                conn.close()
                if reused and attempt == 0:
                    self._close_idle()
                    continue
                raise EngineError(endpoint, f"{type(e).__name__}: {e}") from e
            except TimeoutError as e:
                conn.close()
                raise EngineError(endpoint, f"no answer in time: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise EngineError(endpoint, f"{type(e).__name__}: {e}") from e
            with self._lean_lock:
                self._lean.append(conn)
            try:
                return status, (loads(raw) if raw else None)
            except ValueError:
                return status, raw.decode(errors="replace")
        raise AssertionError("unreachable")

    def _lean_post(self, endpoint: str, body: dict[str, Any]) -> Any:
        """`_lean_call` of a weight-update style endpoint ({"success": bool, "message": str})."""
        status, payload = self._lean_call(endpoint, body)
        failed = status >= 400 or (isinstance(payload, dict) and payload.get("success") is False)
        if failed and NOT_FLUSHED in (message := error_message(payload)):
            return self._flush_late(endpoint, message)
        if status >= 400:
            raise EngineError(endpoint, error_message(payload), status)
        if failed:
            raise EngineError(endpoint, payload.get("message", "success=false"))
        return payload if isinstance(payload, dict) else {"message": payload}

    def _flush_late(self, endpoint: str, message: str) -> dict[str, Any]:
        """`endpoint` updated the weights but SGLang refused the flush after it (NOT_FLUSHED): the
        flush again, SGLang waiting up to LATE_FLUSH_WAIT_S for its scheduler to go idle. The
        update's answer if it goes through; else an EngineError naming both."""
        log.info(
            "engine %s: %s; flushing once the engine is idle (at most %.0f s)", endpoint, message, LATE_FLUSH_WAIT_S
        )
        try:
            self._request("POST", f"/flush_cache?timeout={LATE_FLUSH_WAIT_S:g}")
        except EngineError as e:
            raise EngineError(
                endpoint, f"{message}; the flush after it, waiting up to {LATE_FLUSH_WAIT_S:g} s, failed too: {e}"
            ) from None
        return {"success": True, "message": f"{message} (flushed once the engine was idle)"}

    def _lean_generate(self, body: dict[str, Any]) -> Any:
        """/generate through `_lean_call`, its transport failures retried as `_request` retries
        them for generation (with backoff, `retries` times; not a timeout: the request may run)."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                status, payload = self._lean_call("/generate", body)
            except EngineError as e:
                if attempt < self.retries and not isinstance(e.__cause__, TimeoutError):
                    log.warning("engine POST /generate: %s; retry %d/%d in %.1fs", e, attempt + 1, self.retries, delay)
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise
            if status >= 400:
                raise EngineError("/generate", error_message(payload), status)
            return payload
        raise AssertionError("unreachable")

    def _post(self, endpoint: str, body: Any = None, **kw: Any) -> Any:
        resp = self._request("POST", endpoint, body if body is not None else {}, **kw)
        return json_or_text(resp)

    def _checked(self, endpoint: str, body: Any) -> dict[str, Any]:
        """Weight-update style endpoints answer {"success": bool, "message": str}."""
        try:
            data = self._post(endpoint, body)
        except EngineError as e:
            if e.status is not None and NOT_FLUSHED in str(e):
                return self._flush_late(endpoint, str(e))
            raise
        if isinstance(data, dict) and data.get("success") is False:
            message = data.get("message", "success=false")
            if NOT_FLUSHED in message:
                return self._flush_late(endpoint, message)
            raise EngineError(endpoint, message)
        return data if isinstance(data, dict) else {"message": data}

    def close(self) -> None:
        self._http.close()
        self._close_idle()


def loads(raw: bytes) -> Any:
    """JSON of an answer: orjson (a rollout's answer is megabytes), json where orjson refuses what
    json reads (NaN, integers past 64 bits); ValueError if neither can."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def json_or_text(resp: httpx.Response) -> Any:
    if not resp.content:
        return None
    try:
        return loads(resp.content)
    except ValueError:
        return resp.text


def _error_text(resp: httpx.Response) -> str:
    return error_message(json_or_text(resp))


def error_message(data: Any) -> str:
    """The server's reason from an error body (SGLang's and ours: message, error or detail)."""
    if isinstance(data, dict):
        for key in ("message", "error", "detail"):
            if key in data:
                v = data[key]
                return v.get("message", str(v)) if isinstance(v, dict) else str(v)
    return str(data)[:2000]
