"""The embedded engine over two processes: HTTP in this one, the engine in a child (`--separate-http-process`).

    routes = EngineChild.start(options, server_options)   # blocks until the child's engine is built
    httpd = EngineHTTPServer(addr, make_handler(routes))   # routes answer as server.py's EmbeddedServer
    routes.close()                                          # the child shuts its engine down and exits

SGLang splits its server the same way (its tokenizer manager and HTTP server in one process, the
scheduler and the model in another). In one process the scheduler thread shares the interpreter
lock with every HTTP handler thread: a multi-turn rollout keeps hundreds of requests in flight,
and while their answers are encoded and the next turns parsed, each of the scheduler's Python
statements between two device calls may wait for the lock (`bench.multiturn` prints how long
the scheduler was off a CPU). Here the HTTP work (framing, JSON both ways, the API key) runs in
this process; the child runs server.py's routes on the engine, and its scheduler shares its lock
with two threads only, which read requests from and write answers to one pipe (pickled, in
batches).

Both ways over one `multiprocessing` pipe: requests `(id, method, path, body)`, then `None` to
stop; answers in lists of `(id, status, payload)`, statuses and payloads exactly as one process
gives them (http.py's `answer`). A /generate is queued to the scheduler from the child's reader
thread and answered when its samples are done (no thread waits for it); every other request runs
on a thread of its own, as in one process. If the child dies, every request in flight and every
later one is answered 503 with its exit code, and `on_death` runs (main.py stops serving: the
launcher sees the engine gone); if this process dies, the child reads the end of the pipe and
exits.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from http import HTTPStatus
from multiprocessing.connection import Connection
from typing import Any

import psutil

from rltrain.engine.embedded.server import key_matches

log = logging.getLogger("rltrain.engine.embedded")

START_TIMEOUT_S = 1800.0  # the child builds the engine (a large model's weights, compiled blocks) in this
STOP_TIMEOUT_S = 60.0  # the child's engine shutdown, then it is killed
BATCH = 256  # answers sent in one message at most


def _error(status: int, msg: str) -> tuple[int, Any]:
    return status, {"success": False, "message": msg, "error": {"message": msg}}


class EngineChild:
    """This process's side: the routes http.py serves (`get`, `post`, `authorized`), each a message
    to the child and its answer (module doc)."""

    def __init__(self, conn: Connection, proc: Any, api_key: str):
        self._conn = conn
        self.proc = proc
        self.api_key = api_key
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, list[Any]] = {}  # id -> [event, (status, payload)]
        self._ids = itertools.count()
        self.dead: str | None = None
        self.on_death: Callable[[], None] = lambda: None  # the child gone by itself (not by `close`)
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="rltrain-engine-answers", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, options: dict[str, Any], server_options: dict[str, Any], log_level: str = "INFO") -> EngineChild:
        """Start the child and build its engine (`EmbeddedEngine(**options)`, its routes
        `EmbeddedServer(engine, **server_options)`); a failure there raises with the child's trace."""
        ctx = mp.get_context("spawn")  # (no CUDA state or threads of this process are inherited)
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=_child, args=(there, options, server_options, log_level), name="rltrain-engine", daemon=False
        )
        proc.start()
        there.close()
        if not here.poll(START_TIMEOUT_S):
            proc.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, detail = here.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {proc.exitcode})") from None
        if kind != "ready":
            proc.join(STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine process failed to start:\n{detail}")
        return cls(here, proc, server_options.get("api_key", ""))

    # ------------------------------------------------------------------ routes

    def authorized(self, header: str | None) -> bool:
        return key_matches(self.api_key, header)

    def get(self, path: str) -> tuple[int, Any]:
        status, payload = self._call("GET", path, None)
        if path == "/memory" and status == 200 and isinstance(payload, dict) and "rss_bytes" in payload:
            # the engine's host memory is both processes'
            payload["rss_bytes"] += psutil.Process().memory_info().rss
        return status, payload

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return self._call("POST", path, body)

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, Any]:
        slot: list[Any] = [threading.Event(), None]
        with self._lock:
            if self.dead is not None:
                return _error(HTTPStatus.SERVICE_UNAVAILABLE, self.dead)
            rid = next(self._ids)
            self._pending[rid] = slot
        try:
            with self._send_lock:
                self._conn.send((rid, method, path, body))
        except (OSError, EOFError, ValueError) as e:
            with self._lock:
                mine = self._pending.pop(rid, None)  # (None: the reader has failed it, the child gone)
            if mine is not None:
                return _error(HTTPStatus.SERVICE_UNAVAILABLE, f"the request did not reach the engine process: {e}")
        slot[0].wait()  # (answered by the child, or by the reader when the child is gone)
        return slot[1]

    def _read(self) -> None:
        try:
            while True:
                answers = self._conn.recv()
                with self._lock:
                    for rid, status, payload in answers:
                        slot = self._pending.pop(rid, None)
                        if slot is not None:
                            slot[1] = (status, payload)
                            slot[0].set()
        except (EOFError, OSError):
            pass
        self.proc.join(5)
        code = self.proc.exitcode
        with self._lock:
            self.dead = f"the engine process (pid {self.proc.pid}) is gone (exit code {code}); see the engine's log"
            for slot in self._pending.values():
                slot[1] = _error(HTTPStatus.SERVICE_UNAVAILABLE, self.dead)
                slot[0].set()
            self._pending.clear()
        if not self._closing:
            log.error("%s", self.dead)
            self.on_death()

    def close(self) -> None:
        """Stop the child: its engine shuts down (STOP_TIMEOUT_S, then it is killed)."""
        self._closing = True
        try:
            with self._send_lock:
                self._conn.send(None)
        except (OSError, EOFError, ValueError):
            pass
        self.proc.join(STOP_TIMEOUT_S)
        if self.proc.is_alive():
            log.error("the engine process did not stop within %.0f s: killed", STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.join(5)


# ---------------------------------------------------------------------- the child


def _child(conn: Connection, options: dict[str, Any], server_options: dict[str, Any], log_level: str) -> None:
    """The engine's process: build it, then serve the pipe until it ends or says stop."""
    from rltrain.engine.embedded.engine import EmbeddedEngine  # noqa: PLC0415 - the child's own imports
    from rltrain.engine.embedded.http import answer  # noqa: PLC0415
    from rltrain.engine.embedded.server import EmbeddedServer  # noqa: PLC0415

    faulthandler.enable()
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s embedded-engine %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    # The job's stop signals reach the whole process group: the HTTP process stops this one.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        import torch  # noqa: PLC0415

        torch.set_num_threads(max(1, int(os.environ.get("RLTRAIN_ENGINE_THREADS", torch.get_num_threads()))))
        engine = EmbeddedEngine(**options)
        server = EmbeddedServer(engine, **server_options)
    except BaseException:  # noqa: BLE001 - the HTTP process reports it
        conn.send(("failed", traceback.format_exc()))
        conn.close()
        return
    import gc  # noqa: PLC0415

    gc.freeze()
    out: queue.Queue[tuple[int, Any] | None] = queue.Queue()
    writer = threading.Thread(target=_write, args=(conn, out), name="rltrain-engine-writer", daemon=True)
    writer.start()
    conn.send(("ready", None))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                log.error("the HTTP process is gone: stopping")
                break
            if msg is None:
                break
            rid, method, path, body = msg
            if method == "POST" and path == "/generate":
                try:
                    future = server.generate_async(body)
                except Exception as e:  # noqa: BLE001 - answered as one process answers it
                    out.put((rid, answer(_raise(e), method, path)))
                    continue
                if future is not None:
                    future.add_done_callback(_answer_to(out, rid))
                    continue

            def run(rid: int = rid, method: str = method, path: str = path, body: Any = body) -> None:
                route = (lambda: server.get(path)) if method == "GET" else (lambda: server.post(path, body))
                out.put((rid, answer(route, method, path)))

            threading.Thread(target=run, name="rltrain-engine-request", daemon=True).start()
    finally:
        engine.shutdown()
        out.put(None)
        writer.join(10)
        conn.close()


def _answer_to(out: queue.Queue[tuple[int, Any] | None], rid: int) -> Callable[[Future], None]:
    """A generation's done-callback (on the scheduler's thread): its future goes to the writer."""

    def done(f: Future) -> None:
        out.put((rid, f))

    return done


def _raise(e: BaseException) -> Callable[[], tuple[int, Any]]:
    def route() -> tuple[int, Any]:
        raise e

    return route


def _write(conn: Connection, out: queue.Queue[tuple[int, Any] | None]) -> None:
    """Send answers as they come, those ready together in one message; a generation's future is
    read here (its samples, or its error as one process answers it)."""
    from rltrain.engine.embedded.http import answer  # noqa: PLC0415

    while True:
        item = out.get()
        batch = [item]
        while item is not None and len(batch) < BATCH:
            try:
                item = out.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
        answers = []
        for entry in batch:
            if entry is None:
                continue
            rid, got = entry
            if isinstance(got, Future):
                got = answer(_samples_of(got), "POST", "/generate")
            answers.append((rid, *got))
        if answers:
            try:
                conn.send(answers)
            except (OSError, EOFError, ValueError):
                return
        if batch[-1] is None:
            return


def _samples_of(f: Future) -> Callable[[], tuple[int, Any]]:
    def route() -> tuple[int, Any]:
        return 200, f.result()

    return route
