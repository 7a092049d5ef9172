"""The embedded engine's HTTP front under load and hostile framing (loopback only, bounded in
count and time): every good request answered, every bad one a 4xx, never a 5xx or a hang."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import answering_server, start_engine
from rltrain.generation import SamplingParams


@pytest.fixture(scope="module")
def embedded(model_a, tmp_path_factory):
    srv = start_engine("embedded", model_a, tmp_path_factory.mktemp("load_logs"), max_batch_size=64)
    yield srv
    srv.client.close()
    srv.process.stop()


def address(srv) -> tuple[str, int]:
    host, port = srv.process.url.removeprefix("http://").split(":")
    return host, int(port)


def raw_exchange(srv, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; what comes back before the server closes or the
    timeout (a hang shows as no status line)."""
    with socket.create_connection(address(srv), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize(
    "framing,status",
    [
        (b"Content-Length: -5\r\n\r\n{}", 400),
        (b"Content-Length: abc\r\n\r\n{}", 400),
        (b"Content-Length: 99999999999999\r\n\r\n{}", 413),
        (b"Content-Length: 40\r\n\r\n{}", 400),  # the body ends early (the client half-closes)
        (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ],
    ids=["negative", "not-a-number", "absurd", "truncated", "bad-chunk"],
)
def test_malformed_framing_is_a_4xx_at_once_and_the_server_goes_on(embedded, framing, status):
    t0 = time.perf_counter()
    answer = raw_exchange(
        embedded, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing
    )
    assert status_of(answer) == status and b"message" in answer
    assert time.perf_counter() - t0 < 5  # answered, not left waiting for a body
    assert embedded.client.health()


def test_a_chunked_request_is_served(embedded):
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}'
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    answer = raw_exchange(embedded, head + chunks)
    assert status_of(answer) == 200 and b'"output_ids"' in answer


def test_a_burst_of_connections_at_once_is_served_without_resets(embedded):
    """200 clients connect before any of them sends; each then asks /health and gets its answer.
    (With the standard library's listen backlog of 5 this burst still got through here; the
    load test below is the one that failed with it, with transport errors.)"""
    host, port = address(embedded)
    socks = [socket.create_connection((host, port), timeout=30) for _ in range(200)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [s.recv(4096) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers), [a[:40] for a in answers if not a.startswith(b"HTTP")]


BAD_BODIES = [
    {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
    {"input_ids": [1, 2], "sampling_params": {"min_p": "x"}},
    {"input_ids": [1, 2], "sampling_params": {"n": 2.5}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 3}},
    {"input_ids": [1, 2], "sampling_params": {"sampling_seed": "seven"}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}},
    {"input_ids": [1, 99999]},
    {"input_ids": [[1], "x"]},
    {"input_ids": [1], "stream": True},
    {"input_ids": [1], "sampling_params": []},
    "not an object",
]


def test_hundreds_of_requests_from_many_connections_a_share_malformed(embedded):
    """300 requests from 48 clients at once, a quarter malformed: every good one answered with its
    samples, every bad one a 4xx, no 5xx, no transport error; the server answers afterwards."""
    rng = random.Random(0)
    plan = [rng.random() < 0.25 for _ in range(300)]
    results: list[tuple[bool, int, object]] = []
    lock = threading.Lock()
    start = threading.Barrier(48)
    url = embedded.process.url

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            start.wait()
            for i in range(k, len(plan), 48):
                bad = plan[i]
                if bad:
                    body = BAD_BODIES[i % len(BAD_BODIES)]
                else:
                    body = {"input_ids": [1 + i % 50, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2}}
                try:
                    r = c.post(url + "/generate", json=body)
                    got = (bad, r.status_code, r.json())
                except Exception as err:  # noqa: BLE001 - a transport error is a finding
                    got = (bad, -1, repr(err))
                with lock:
                    results.append(got)

    with ThreadPoolExecutor(48) as pool:
        list(pool.map(client, range(48)))
    assert len(results) == 300
    transport = [r for r in results if r[1] == -1]
    assert not transport, transport[:3]
    assert not [r for r in results if r[1] >= 500], [r for r in results if r[1] >= 500][:3]
    for bad, status, out in results:
        if bad:
            assert 400 <= status < 500 and out["error"]["message"], (status, out)  # type: ignore[index]
        else:
            assert status == 200 and len(out) == 2 and all(len(s["output_ids"]) <= 4 for s in out), out  # type: ignore[arg-type]
    assert embedded.client.health()
    after = embedded.client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert after[0].ok and len(after[0].output_ids) == 3


def test_per_bucket_requests_survive_a_server_that_closed_every_idle_connection():
    """A sync after a long train step: the server (here a real HTTP server whose keep-alive
    timeout is 0.3 s; the embedded engine's is 60 s, uvicorn's 5 s) has closed every connection
    the client kept from the last sync's concurrent bucket requests. Each request is sent again
    once, on a fresh connection (not another stale one), and nothing is sent twice to the server."""
    seen: list[str] = []

    def answer(body: bytes) -> tuple[int, bytes]:
        seen.append(json.loads(body)["weight_version"])
        time.sleep(0.05)  # concurrent requests hold separate connections
        return 200, b'{"success": true, "message": "ok"}'

    with answering_server(answer, idle_timeout_s=0.3) as client:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda v: client.update_weights_from_tensor(["x"], weight_version=v), ["a", "b", "c"]))
        assert len(client._lean) == 3  # three idle keep-alive connections kept
        time.sleep(1.0)  # the server closes all three
        for v in ["d", "e"]:
            assert client.update_weights_from_tensor(["x"], weight_version=v)["success"]
        assert sorted(seen) == ["a", "b", "c", "d", "e"]
