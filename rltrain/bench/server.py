"""Benchmark: the embedded engine's HTTP front, per request and under load, next to the same
routes served by SGLang's own stack (uvicorn + Starlette), and a bare HTTP server as the floor.

    python -m rltrain.bench.server                    # CPU, a tiny model; ~1 minute
    python -m rltrain.bench.server --requests 4000 --clients 64

Each front is its own server process over the same engine code (`EmbeddedServer` routes to a
`EmbeddedEngine` on the CPU with a tiny random model): `stdlib`, the embedded engine as shipped
(`python -m rltrain.engine.embedded`); `asgi`, the same `EmbeddedServer` behind uvicorn + Starlette
(what SGLang's HTTP server is built on; blocking calls in Starlette's thread pool), started by
this module (`--serve asgi`); `echo`, a socket server that sends back what it reads: the loopback
round trip between two processes with no HTTP, the floor of any request (its figure is in the
GET row). The client is httpx with keep-alive, as rltrain's EngineClient.

Per front, sequential (one connection): GET /health; a weight-update bucket request as the
tensor sync sends it from its second sync on (`/update_weights_from_tensor`, a flattened bucket
by buffer slot: its handle was sent once in the session; the engine copies the bucket's tensor);
/generate of one greedy token. Then concurrent: `--clients` connections at once, each sending
its share of `--requests` /generate requests (4 new tokens, n=2), a quarter of them malformed;
requests per second, and the answers by status class (a transport error counts as "error").
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from rltrain.runtime.net import free_port

MALFORMED = [
    {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
    {"input_ids": [1, 2], "sampling_params": {"n": 2.5}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}},
    {"input_ids": [1, 10**9]},
    {"input_ids": [1], "sampling_params": "x"},
]


def serve_asgi(model: str, port: int) -> None:
    """The embedded engine's routes behind uvicorn + Starlette (this benchmark's comparison)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from rltrain.engine.embedded.engine import EmbeddedEngine, EngineStateError
    from rltrain.engine.embedded.requests import BadRequest
    from rltrain.engine.embedded.server import EmbeddedServer

    torch.set_num_threads(1)
    server = EmbeddedServer(EmbeddedEngine(model, device="cpu", dtype="float32", max_batch_size=256))

    async def handle(request: Request) -> Response:
        path = request.url.path
        try:
            if request.method == "GET":
                status, payload = await run_in_threadpool(server.get, path)
            else:
                raw = await request.body()
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise BadRequest(f"request body is not JSON: {err}") from None
                if not isinstance(body, dict):
                    raise BadRequest("request body must be a JSON object")
                status, payload = await run_in_threadpool(server.post, path, body)
        except (BadRequest, EngineStateError, ValueError, KeyError) as err:
            status, payload = 400, {"success": False, "message": str(err), "error": {"message": str(err)}}
        if payload is None or isinstance(payload, str):
            return PlainTextResponse(payload or "", status_code=status)
        return JSONResponse(payload, status_code=status)

    app = Starlette(routes=[Route("/{path:path}", handle, methods=["GET", "POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def serve_echo(port: int) -> None:
    """Sends back every message it reads on each connection: the loopback round trip between two
    processes, with no HTTP at all (the floor of any request)."""
    import socketserver

    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := self.request.recv(65536):
                self.request.sendall(data)

    socketserver.ThreadingTCPServer(("127.0.0.1", port), Echo).serve_forever()


def echo_round_trip(port: int, n: int) -> tuple[float, float]:
    """Median and p99 (ms) of a 200-byte message sent and read back over one connection."""
    msg = b"x" * 200
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for k in range(n + 20):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(s.recv(65536))
            if k >= 20:
                times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e3, times[int(0.99 * (n - 1))] * 1e3


def start(front: str, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if front == "echo":
        cmd = [sys.executable, "-m", "rltrain.bench.server", "--serve", "echo", "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, str(port)
            except OSError:
                time.sleep(0.1)
        proc.kill()
        raise SystemExit("the echo server did not start")
    if front == "stdlib":
        cmd = [sys.executable, "-m", "rltrain.engine.embedded", "--model-path", str(model), "--port", str(port)]
        cmd += ["--dtype", "float32", "--log-level", "WARNING"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "rltrain.bench.server",
            "--serve",
            front,
            "--model",
            str(model),
            "--port",
            str(port),
        ]
    env = {"RLTRAIN_ENGINE_THREADS": "1", "OMP_NUM_THREADS": "1"}
    import os

    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"{front} server did not start:\n{log.read_text()[-2000:]}")


def timed(client: httpx.Client, n: int, request: Any) -> tuple[float, float]:
    """Median and p99 latency (ms) of `n` calls of `request(client)`, after 20 warm-up calls."""
    for _ in range(20):
        request(client)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        request(client)
        times.append(time.perf_counter() - t0)
    times.sort()
    return statistics.median(times) * 1e3, times[int(0.99 * (n - 1))] * 1e3


def bucket_requests(url: str, model: Path) -> Any:
    """A request function sending one small flattened bucket by buffer slot, as the tensor sync
    does after a slot's first bucket of a session (the handle went once, first)."""
    from safetensors.torch import load_file

    from rltrain.weights.bucket import flatten_bucket, serialize

    norm = load_file(str(model / "model.safetensors"))["model.norm.weight"]
    flat = flatten_bucket([("model.norm.weight", norm)])
    first = serialize({**flat, "buffer": 0})
    again = serialize({"flattened_tensor": None, "metadata": flat["metadata"], "buffer": 0})
    with httpx.Client(timeout=60) as c:
        c.post(url + "/begin_weight_update", json={}).raise_for_status()
        body = {"serialized_named_tensors": [first], "load_format": "flattened_bucket", "weight_version": "b"}
        c.post(url + "/update_weights_from_tensor", json=body).raise_for_status()
    body = {"serialized_named_tensors": [again], "load_format": "flattened_bucket", "weight_version": "b"}

    def send(client: httpx.Client) -> None:
        r = client.post(url + "/update_weights_from_tensor", json=body)
        assert r.status_code == 200, r.text
        assert flat["flattened_tensor"] is not None  # (the shared buffer lives while requests use it)

    return send


def load(url: str, requests: int, clients: int) -> dict[str, float]:
    rng = random.Random(0)
    bad = [rng.random() < 0.25 for _ in range(requests)]
    counts = {"2xx": 0, "4xx": 0, "5xx": 0, "error": 0, "wrong": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client(k: int) -> None:
        with httpx.Client(timeout=300) as c:
            barrier.wait()
            for i in range(k, requests, clients):
                good = {"input_ids": [1 + i % 50, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2}}
                try:
                    r = c.post(url + "/generate", json=MALFORMED[i % len(MALFORMED)] if bad[i] else good)
                    kind = f"{r.status_code // 100}xx"
                    if (r.status_code == 200) == bad[i]:
                        kind = "wrong"  # a bad request served, or a good one refused
                except httpx.HTTPError:
                    kind = "error"
                with lock:
                    counts[kind] += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return {"req/s": requests / (time.perf_counter() - t0), **counts}


def measure(front: str, model: Path, root: Path, a: argparse.Namespace) -> dict[str, Any]:
    proc, url = start(front, model, root / f"{front}.log")
    row: dict[str, Any] = {}
    if front == "echo":
        try:
            row["GET /health"] = echo_round_trip(int(url), a.sequential)
        finally:
            proc.kill()
        return row
    try:
        with httpx.Client(timeout=60) as c:
            row["GET /health"] = timed(c, a.sequential, lambda cl: cl.get(url + "/health"))
            row["bucket by slot"] = timed(c, a.sequential, bucket_requests(url, model))
            one = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            row["generate 1 token"] = timed(c, a.sequential // 4, lambda cl: cl.post(url + "/generate", json=one))
        row["load"] = load(url, a.requests, a.clients)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequential", type=int, default=1000, help="requests per sequential figure")
    ap.add_argument("--requests", type=int, default=1000, help="requests of the concurrent load")
    ap.add_argument("--clients", type=int, default=48, help="connections of the concurrent load")
    ap.add_argument("--serve", choices=["asgi", "echo"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve == "asgi":
        serve_asgi(a.model, a.port)
        return 0
    if a.serve == "echo":
        serve_echo(a.port)
        return 0
    from rltrain.rollout import synthetic

    root = Path(tempfile.mkdtemp(prefix="rltrain-bench-server-"))
    model = synthetic.build_tiny_model(root / "model", [str(i) for i in range(200)], hidden=64, layers=2)
    fronts = ["stdlib"]
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401

        fronts.append("asgi")
    except ImportError:
        print("# uvicorn / starlette not installed: the asgi front is not measured")
    fronts.append("echo")
    print(
        f"# rltrain.bench.server  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  CPU, tiny model; "
        f"sequential: median / p99 ms of {a.sequential} requests (generate: {a.sequential // 4}); load: "
        f"{a.requests} /generate requests from {a.clients} connections, a quarter malformed"
    )
    rows = {front: measure(front, model, root, a) for front in fronts}
    print(
        f"# floor: a 200-byte message to another process and back over loopback TCP (echo), "
        f"{rows['echo']['GET /health'][0]:.3f} ms median"
    )
    print(f"{'':>22s}" + "".join(f"{f:>24s}" for f in fronts))
    for key in ("GET /health", "bucket by slot", "generate 1 token"):
        cells = [f"{rows[f][key][0]:.3f} / {rows[f][key][1]:.3f}" if key in rows[f] else "-" for f in fronts]
        print(f"{key:>22s}" + "".join(f"{c:>24s}" for c in cells))
    for key in ("req/s", "2xx", "4xx", "5xx", "error", "wrong"):
        cells = [
            (f"{rows[f]['load'][key]:.1f}" if key == "req/s" else f"{rows[f]['load'][key]:.0f}")
            if "load" in rows[f]
            else "-"
            for f in fronts
        ]
        print(f"{'load ' + key:>22s}" + "".join(f"{c:>24s}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
