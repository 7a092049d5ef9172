"""The embedded engine with its HTTP in a process of its own (`--separate-http-process`,
engine/embedded/split.py): what one process does (the contract tests run against it too: the
`server` fixture's "embedded-split"), and what two processes add: either one dying.

Real processes: the server started as the launcher starts it, the engine's process killed."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from conftest import start_engine
from rltrain.runtime.net import free_port


def _post(url: str, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _engine_child(front: psutil.Process) -> psutil.Process:
    kids = [p for p in front.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
    assert len(kids) == 1, [p.cmdline() for p in front.children(recursive=True)]
    return kids[0]


def test_a_request_in_flight_when_the_engine_process_dies_is_answered_503_and_the_server_exits(model_a, tmp_path):
    srv = start_engine("embedded-split", model_a, tmp_path)
    try:
        front = psutil.Process(srv.process.proc.pid)
        child = _engine_child(front)
        assert _post(srv.process.url, "/pause_generation", {"mode": "in_place"})[0] == 200
        got: list = []
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        waiting = threading.Thread(target=lambda: got.append(_post(srv.process.url, "/generate", body)))
        waiting.start()
        time.sleep(1.0)  # queued behind the pause
        assert not got, "the request was answered while generation was paused"
        child.send_signal(signal.SIGKILL)
        waiting.join(30)
        assert got, "the request in flight was never answered"
        status, payload = got[0]
        assert status == 503 and "engine process" in payload["message"] and "gone" in payload["message"], got
        assert srv.process.proc.wait(timeout=30) == 1, "the HTTP process kept serving without its engine"
    finally:
        srv.client.close()
        srv.process.stop()


def test_requests_in_flight_hold_threads_in_the_http_process_not_in_the_engines(model_a, tmp_path):
    """What the split is for: 32 generations waiting in the engine (generation paused) add no
    thread to the engine's process (its reader queues each; no thread waits for one), while the
    HTTP process holds a handler thread per connection; then every one is answered."""
    srv = start_engine("embedded-split", model_a, tmp_path)
    try:
        front = psutil.Process(srv.process.proc.pid)
        child = _engine_child(front)
        url = srv.process.url
        assert _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0] == 200
        engine_threads, front_threads = child.num_threads(), front.num_threads()
        assert _post(url, "/pause_generation", {"mode": "in_place"})[0] == 200
        got: list = []
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        waiting = [threading.Thread(target=lambda: got.append(_post(url, "/generate", body))) for _ in range(32)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 30
        # (the baseline may still count the warm-up connection's handler thread, which ends)
        while front.num_threads() < front_threads + 28 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert not got, "a request was answered while generation was paused"
        assert front.num_threads() >= front_threads + 28, "the HTTP process did not take the connections"
        assert child.num_threads() <= engine_threads + 2, (child.num_threads(), engine_threads)
        assert _post(url, "/continue_generation", {})[0] == 200
        for t in waiting:
            t.join(60)
        assert len(got) == 32 and all(status == 200 for status, _ in got), got[:3]
        assert len({tuple(p["output_ids"]) for _, p in got}) == 1  # greedy: the same answer each time
    finally:
        srv.client.close()
        srv.process.stop()


def test_the_engine_process_exits_when_the_http_process_is_killed(model_a, tmp_path):
    srv = start_engine("embedded-split", model_a, tmp_path)
    try:
        front = psutil.Process(srv.process.proc.pid)
        child = _engine_child(front)
        front.send_signal(signal.SIGKILL)
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert not alive, "the engine process outlived the HTTP process that served it"
    finally:
        srv.client.close()
        srv.process.stop()


def test_an_engine_that_cannot_start_fails_the_server_with_its_reason(tmp_path):
    missing = tmp_path / "no-such-model"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.engine.embedded",
            "--model-path",
            str(missing),
            "--port",
            str(free_port()),
            "--separate-http-process",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "failed to start" in text and "no-such-model" in text, text[-3000:]


@pytest.mark.parametrize("kind", ["embedded", "embedded-split"])
def test_bad_requests_get_the_same_answer_either_way(model_a, tmp_path, kind):
    srv = start_engine(kind, model_a, tmp_path)
    try:
        url = srv.process.url
        assert _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}})[0] == 400
        status, payload = _post(url, "/generate", {"input_ids": [[10**9]], "sampling_params": {"max_new_tokens": 2}})
        assert status == 400 and "vocabulary" in payload["message"], payload
        assert _post(url, "/no_such_endpoint", {})[0] == 404
    finally:
        srv.client.close()
        srv.process.stop()
