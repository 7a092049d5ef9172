"""Shared fixtures: tiny local models and live engine servers (real processes, real HTTP)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# Without a GPU the Triton kernels run in Triton's interpreter (test_kernels.py). It must be on
# before triton is first imported (transformers and torch may import it): triton's own library
# functions are made interpreted or compiled at import.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from models import make_model  # noqa: E402
from rltrain.config import EmbeddedEngineConfig, EngineConfig  # noqa: E402
from rltrain.engine.client import EngineClient  # noqa: E402
from rltrain.engine.command import server_command  # noqa: E402
from rltrain.engine.process import EngineProcess  # noqa: E402
from rltrain.runtime.net import free_port  # noqa: E402

SGLANG_SHIM = HERE / "sglang_shim"
# The README's install includes SGLang (CPU); without it the SGLang half of the contract suite
# fails loudly unless RLTRAIN_SKIP_SGLANG=1 says to skip it on purpose.
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_SGLANG = os.environ.get("RLTRAIN_SKIP_SGLANG") == "1"


def sglang_gpu_args() -> list[str]:
    """SGLang's flags for the GPU tests: none with its own kernels installed; with the test-only
    stand-in for sglang-kernel (tests/sglang_gpu_shim on PYTHONPATH), what the stand-in needs:
    Triton attention, the PyTorch sampler, no CUDA graphs, no radix cache (its README says why)."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None or HERE / "sglang_gpu_shim" not in Path(spec.origin).parents:
        return []
    return [
        "--attention-backend",
        "triton",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--disable-radix-cache",
    ]


@pytest.fixture(scope="session")
def model_a(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model_a"), seed=1)


@pytest.fixture(scope="session")
def model_b(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("model_b"), seed=2)


SGLANG_POOL_TOKENS = 4096  # engine.max_total_tokens of the CPU SGLang servers (SGLang's --max-total-tokens)
# On the CPU SGLang's "GPU memory" is the host's free memory, read before and after the weights
# load; it refuses to start where it fell by more than 1 - mem_fraction_static in between (another
# test worker loading a model meanwhile was enough at 0.1). The pool is SGLANG_POOL_TOKENS whatever
# the fraction (SGLang takes the smaller), so a larger fraction costs nothing here.
SGLANG_CPU_MEM_FRACTION = 0.5


def engine_config(kind: str, **kw) -> EngineConfig:
    """`kw`: EngineConfig's keys, and the embedded engine's own (EmbeddedEngineConfig) beside them."""
    own = {k: kw.pop(k) for k in [f.name for f in dataclasses.fields(EmbeddedEngineConfig)] if k in kw}
    if kind == "embedded-split":  # the embedded engine with its HTTP in a process of its own (split.py)
        kind, own["separate_http_process"] = "embedded", True
    kw = {"backend": kind, "device": "cpu", "dtype": "float32", "startup_timeout_s": 180, **kw}
    cfg = EngineConfig(**kw, embedded=EmbeddedEngineConfig(**own))
    if kind == "sglang":
        # CPU settings from shared/sglang-cpu/README.md.
        cfg.mem_fraction_static = SGLANG_CPU_MEM_FRACTION
        cfg.max_total_tokens = SGLANG_POOL_TOKENS
    return cfg


def start_server(
    cfg: EngineConfig,
    model: Path,
    log: Path,
    env: dict[str, str] | None = None,
    request_timeout_s: float = 120,
    retries: int = 1,
) -> SimpleNamespace:
    """Start the engine server `cfg` describes on a free port and wait until it is healthy; its
    log's tail is the error when it does not come up. A port another test worker's server bound
    first (it answers, or ours cannot bind) is given up for another, as the launcher does; SGLang's
    check of its TP ranks' memory balance, on the host's moving free memory, is tried again."""
    for attempt in range(3):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = EngineProcess.start(server_command(cfg, str(model), port), url, log, env=env or {})
        client = EngineClient(proc.url, request_timeout_s=request_timeout_s, retries=retries)
        try:
            client.wait_healthy(cfg.startup_timeout_s, alive=lambda: proc.alive)
            if proc.listens_on(port) is False:
                raise RuntimeError(f"port {port}: address already in use (another server answered)")
        except Exception as e:
            tail = f"{proc.log_tail()}\n{e}"
            proc.stop()
            client.close()
            # SGLang at --tp-size > 1 on the CPU compares its ranks' free memory, which is the host's
            # and moves while other test workers allocate: a start-up that saw it move is tried again.
            transient = ("address already in use", "memory capacity is unbalanced")
            if any(t in tail.lower() for t in transient) and attempt < 2:
                continue
            raise RuntimeError(f"{cfg.backend} engine did not start:\n{tail}") from None
        return SimpleNamespace(kind=cfg.backend, client=client, process=proc, model=model)
    raise AssertionError("unreachable")


def start_engine(kind: str, model: Path, log_dir: Path, env: dict[str, str] | None = None, **kw) -> SimpleNamespace:
    """A CPU engine of `kind` (SGLang with its CPU shim on PYTHONPATH) serving `model`."""
    env = dict(env or {})
    if kind == "sglang":
        env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")])
    return start_server(engine_config(kind, **kw), model, log_dir / f"{kind}.log", env)


def _served(kind: str, model_a: Path, tmp_path_factory) -> Iterator[SimpleNamespace]:
    if kind == "sglang" and not HAVE_SGLANG:
        if SKIP_SGLANG:
            pytest.skip("SGLang not installed and RLTRAIN_SKIP_SGLANG=1")
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    srv = start_engine(kind, model_a, tmp_path_factory.mktemp(f"{kind}_logs"))
    yield srv
    srv.client.close()
    srv.process.stop()


# One server of each kind per test process, kept for the whole session: a parametrized session
# fixture would be started again each time the test order switches between its params (every
# module that uses both), and SGLang's start costs ~20 s of CPU. Each test leaves it serving
# model A, as it found it.
@pytest.fixture(scope="session")
def embedded_server(model_a, tmp_path_factory):
    yield from _served("embedded", model_a, tmp_path_factory)


@pytest.fixture(scope="session")
def embedded_split_server(model_a, tmp_path_factory):
    yield from _served("embedded-split", model_a, tmp_path_factory)


@pytest.fixture(scope="session")
def sglang_server(model_a, tmp_path_factory):
    yield from _served("sglang", model_a, tmp_path_factory)


@pytest.fixture(params=["embedded", "embedded-split", "sglang"])
def server(request):
    """A live engine serving model A: the embedded engine, the same with its HTTP in a process of
    its own (`--separate-http-process`), and real SGLang on CPU."""
    return request.getfixturevalue(f"{request.param.replace('-', '_')}_server")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    # ~40 MB of fp32 weights, so freeing them shows clearly in the server's RSS.
    return make_model(tmp_path_factory.mktemp("big"), seed=3, vocab=8192, hidden=512, layers=2)


@pytest.fixture(scope="module")
def embedded(big_model, tmp_path_factory):
    # With a backup: these tests check that release and resume keep what the engine serves.
    srv = start_engine("embedded", big_model, tmp_path_factory.mktemp("embedded_logs"), weights_backup=True)
    yield srv
    srv.client.close()
    srv.process.stop()


@contextlib.contextmanager
def answering_server(
    answer: Callable[[bytes], tuple[int, bytes]],
    idle_timeout_s: float | None = None,
    paths: list[str] | None = None,
) -> Iterator[EngineClient]:
    """A real HTTP/1.1 server on loopback answering every POST with `answer(body)` -> (status,
    JSON bytes), as an engine would, and a client talking to it (no retries). `idle_timeout_s`:
    the server closes a keep-alive connection idle this long; `paths`: each POST's path (with
    its query) is appended to it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = idle_timeout_s

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if paths is not None:
                paths.append(self.path)
            status, out = answer(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = EngineClient(f"http://127.0.0.1:{httpd.server_address[1]}", request_timeout_s=10, retries=0)
    try:
        yield client
    finally:
        client.close()
        httpd.shutdown()
        httpd.server_close()
