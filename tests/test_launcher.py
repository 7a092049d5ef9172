"""Node engine launcher: real server processes, real ranks, real crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import engine_config, start_engine
from multiproc import run_ranks, values
from rltrain.engine.launcher import NodeEngine
from rltrain.engine.process import EngineCrashed
from rltrain.generation import SamplingParams

HERE = Path(__file__).resolve().parent


def _launch_rank(rank: int, world_size: int, model: str, run_dir: str) -> tuple:
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=120)
    node = NodeEngine.launch(engine_config("embedded"), model, world, Path(run_dir))
    try:
        out = node.client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        pid = node.process.proc.pid if node.process else None
        world.bridge.barrier()
        return node.url, out[0].output_ids, pid
    finally:
        world.bridge.barrier()  # nobody stops the engine while a peer still uses it
        node.shutdown()
        world.close()


def test_each_rank_launches_its_own_embedded_engine_one_per_gpu(model_a, tmp_path):
    """The embedded engine's layout is one engine per GPU (rank): each rank is its engine's
    leader, owns its process and talks to it alone; each engine logs to its own file."""
    results = values(run_ranks(_launch_rank, 2, str(model_a), str(tmp_path), deadline_s=180))
    (url0, out0, pid0), (url1, out1, pid1) = results
    assert url0 != url1 and url0.startswith("http://127.0.0.1:") and url1.startswith("http://127.0.0.1:")
    assert out0 == out1 and len(out0) == 4  # the same model, greedy
    assert pid0 is not None and pid1 is not None and pid0 != pid1
    for pid in (pid0, pid1):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert "serving" in (tmp_path / "engine" / "node0-engine0.log").read_text()
    assert "serving" in (tmp_path / "engine" / "node0-engine1.log").read_text()


JOB = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import engine_config
from rltrain.engine.launcher import NodeEngine
proc = NodeEngine._start_healthy(engine_config("embedded"), {model!r}, Path({log!r}))
print(proc.proc.pid, flush=True)
if {mode!r} == "raise":
    raise RuntimeError("the job crashed")
time.sleep(600)
"""


def _wait_gone(pid: int, seconds: float = 60.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("start", ["forked", "new interpreter"])
@pytest.mark.parametrize("mode", ["sigkill", "raise"])
def test_engine_dies_with_a_crashing_job(model_a, tmp_path, mode, start):
    """Whether the engine was forked from its rank (one torch thread, as under torchrun) or
    started as a new interpreter (several: an OpenMP pool does not survive a fork)."""
    log = tmp_path / "engine.log"
    script = JOB.format(tests=str(HERE), model=str(model_a), log=str(log), mode=mode)
    env = {**os.environ, "OMP_NUM_THREADS": "1" if start == "forked" else "2"}
    job = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    engine_pid = int(job.stdout.readline())
    assert psutil.pid_exists(engine_pid)
    assert f"({'forked from its rank' if start == 'forked' else 'a new interpreter'})" in log.read_text()
    if mode == "sigkill":
        os.kill(job.pid, signal.SIGKILL)  # no atexit, no finally: only the kernel can clean up
    job.wait(60)
    assert _wait_gone(engine_pid), f"engine {engine_pid} outlived its job ({mode})"


FORKED = """
import os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from conftest import engine_config
from rltrain.engine import forked
from rltrain.engine.launcher import NodeEngine
from rltrain.engine.process import EngineCrashed
from rltrain.engine.client import EngineClient
from rltrain.generation import SamplingParams

cfg = engine_config("embedded")
first = NodeEngine._start_healthy(cfg, {model!r}, Path({log!r}))
os.kill(first.proc.pid, signal.SIGKILL)
first.proc.wait(30)
try:
    NodeEngine(None, first.url, first).check_alive()
except EngineCrashed as e:
    print("crashed", str(e).splitlines()[0], flush=True)
proc = NodeEngine._start_healthy(cfg, {model!r}, Path({log!r}))  # still one thread here: forked again
client = EngineClient(proc.url)
out = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
print("greedy", out[0].output_ids, flush=True)
print("pid", proc.proc.pid, type(proc.proc).__name__, flush=True)
proc.stop()  # SIGINT: the server shuts down cleanly
print("stopped", proc.proc.poll(), flush=True)
busy = threading.Thread(target=time.sleep, args=(5,))
busy.start()
cmd = ["python", "-m", "rltrain.engine.embedded", "--device", "cpu"]
print("blocked", forked.blocker(cmd), flush=True)
print("gpu", forked.blocker(["python", "-m", "rltrain.engine.embedded", "--device", "cuda:0"]), flush=True)
"""


def test_a_forked_engine_serves_stops_and_is_reported_as_a_new_one_is(model_a, tmp_path):
    """Forked from a one-thread process: the same answers as a new interpreter's engine (greedy,
    the same model), a clean stop on SIGINT, a SIGKILL reported with its exit code and log tail;
    a process with another thread running, or an engine on a GPU, is never forked."""
    log = tmp_path / "engine.log"
    script = FORKED.format(tests=str(HERE), model=str(model_a), log=str(log))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    srv = start_engine("embedded", model_a, tmp_path)  # a new interpreter (this process runs threads)
    try:
        want = srv.client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    finally:
        srv.process.stop()
    assert lines["greedy"] == str(want[0].output_ids)
    assert lines["pid"].endswith("ForkedProcess")
    assert lines["stopped"] == "0"  # exited by itself on SIGINT, not killed
    assert "exited (exit code -9)" in lines["crashed"]
    assert lines["blocked"].endswith("Python threads run in this process")  # the client's and the sleeper
    assert lines["gpu"] == "not on the CPU"
    text = log.read_text()
    assert text.count("(forked from its rank)") == 2 and text.count("serving") == 2


def test_crashed_engine_is_reported_with_its_log_tail(model_a, tmp_path):
    srv = start_engine("embedded", model_a, tmp_path)
    try:
        node = NodeEngine(srv.client, srv.process.url, srv.process)
        node.check_alive()
        os.kill(srv.process.proc.pid, signal.SIGKILL)
        srv.process.proc.wait(30)
        with pytest.raises(
            EngineCrashed, match=r"exited \(exit code -9\); last lines of .*embedded.log:\n(.|\n)*serving"
        ):
            node.check_alive()
        failed = srv.client.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert not failed[0].ok and "Connection refused" in failed[0].error  # failed, not an empty sample
    finally:
        srv.process.stop()


def test_engine_that_cannot_start_reports_why(tmp_path):
    cfg = engine_config("embedded")
    with pytest.raises(EngineCrashed, match=r"did not become healthy.*\n(.|\n)*does-not-exist"):
        NodeEngine._start_healthy(cfg, str(tmp_path / "does-not-exist"), tmp_path / "engine.log")


def test_a_server_that_bound_the_engines_port_first_is_not_taken_for_the_engine(tmp_path, model_a, monkeypatch):
    """The port `free_port` picked is bound by another server before the engine binds it (two
    jobs, or two test workers, starting at once): that server answers /health, but it is not this
    engine's. The launcher sees that the port's listener is not its process and starts the
    engine again on another port, instead of sending its weights to someone else's server."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    from rltrain.engine import launcher
    from rltrain.runtime.net import free_port

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - (the http.server API)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None: ...

    other = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    ports = iter([taken])
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or free_port())
    try:
        proc = NodeEngine._start_healthy(engine_config("embedded"), str(model_a), tmp_path / "engine.log")
    finally:
        other.shutdown()
    try:
        assert proc.url != f"http://127.0.0.1:{taken}" and proc.listens_on(int(proc.url.rsplit(":", 1)[1]))
    finally:
        proc.stop()


def test_set_up_failing_while_the_engine_starts_stops_the_engine(tmp_path, model_a):
    """The rank's own set-up runs while its engine starts (the trainer, on the CPU); if it fails,
    the engine it started is stopped, not left running without its rank."""
    before = {c.pid for c in psutil.Process().children()}
    started: list[int] = []

    def set_up() -> None:
        started.extend(c.pid for c in psutil.Process().children() if c.pid not in before)
        raise RuntimeError("the trainer could not be built")

    with pytest.raises(RuntimeError, match="could not be built"):
        NodeEngine._start_healthy(engine_config("embedded"), str(model_a), tmp_path / "engine.log", meanwhile=set_up)
    assert len(started) == 1, started  # the engine's process was running during the set-up ...
    assert not psutil.pid_exists(started[0])  # ... and is gone (stopped and reaped)


@pytest.mark.parametrize("deterministic", [False, True])
def test_sglang_command_places_the_server_on_the_configured_device(deterministic):
    from rltrain.config import EngineConfig
    from rltrain.engine.command import server_command

    cpu = server_command(EngineConfig(backend="sglang", device="cpu", deterministic=deterministic), "/m", 1)
    gpu = server_command(EngineConfig(backend="sglang", device="cuda", deterministic=deterministic), "/m", 1)
    assert cpu[cpu.index("--device") + 1] == "cpu" and "--disable-cuda-graph" in cpu
    assert "--device" not in gpu and "--enable-memory-saver" in gpu
    assert ("--enable-deterministic-inference" in cpu) == ("--enable-deterministic-inference" in gpu) == deterministic
    assert "--sleep-on-idle" in cpu and "--sleep-on-idle" in gpu


def test_multi_turn_rollouts_on_gpus_get_the_embedded_engines_http_in_a_process_of_its_own():
    """engine.embedded.separate_http_process=auto: on for a multi-turn rollout on GPUs (measured
    +10 points of single-turn tokens/s on an H100), off for single-turn and on the CPU; an explicit
    value is kept; an auto nothing resolved starts the engine in one process."""
    from rltrain.config import load_config
    from rltrain.engine.command import server_command
    from rltrain.setup import engine_config

    base = ["model.path=/m", "data.path=synthetic:addition", "engine.backend=embedded"]

    def split(*overrides: str) -> bool:
        cfg = load_config(None, [*base, *overrides])
        return "--separate-http-process" in server_command(engine_config(cfg), "/m", 1)

    tools = "rollout.tools=[rltrain.rollout.synthetic:lookup]"
    assert split("engine.device=cuda", tools)
    assert split("engine.device=cuda", "rollout.env=rltrain.bench.multiturn:RandomObservations")
    assert not split("engine.device=cuda")  # single-turn
    assert not split("engine.device=cpu", tools)
    assert not split("engine.device=cuda", tools, "engine.embedded.separate_http_process=false")
    assert split("engine.device=cpu", "engine.embedded.separate_http_process=true")
    unresolved = load_config(None, [*base, "engine.device=cuda", tools]).engine
    assert unresolved.embedded.separate_http_process == "auto"
    assert "--separate-http-process" not in server_command(unresolved, "/m", 1)


# ---------------------------------------------------------------------------------- engine layout


def _env(local_rank: int, local_world_size: int = 8, node: int = 0):
    from rltrain.runtime.env import DistEnv

    n = local_world_size
    return DistEnv(node * n + local_rank, 2 * n, local_rank, n, node, "127.0.0.1", 1, True)


def test_sglang_spans_the_node_by_default_and_the_embedded_engine_takes_one_gpu_each():
    from rltrain.config import EngineConfig
    from rltrain.engine.layout import EngineLayout

    sg = [EngineLayout.of(EngineConfig(backend="sglang"), "sglang", _env(r), 8) for r in range(8)]
    assert {(x.engines_per_node, x.gpus_per_engine, x.engine) for x in sg} == {(1, 8, 0)}
    assert [x.tp_rank for x in sg] == list(range(8)) and [x.is_engine_leader for x in sg] == [True] + [False] * 7
    embedded = [EngineLayout.of(EngineConfig(backend="embedded"), "embedded", _env(r), 8) for r in range(8)]
    assert [(x.engine, x.tp_rank, x.base_gpu_id, x.is_engine_leader) for x in embedded] == [
        (r, 0, r, True) for r in range(8)
    ]
    four = [
        EngineLayout.of(EngineConfig(backend="sglang", gpus_per_engine=4), "sglang", _env(r, node=1), 8)
        for r in range(8)
    ]
    assert [(x.engine, x.tp_rank, x.base_gpu_id) for x in four] == [(r // 4, r % 4, r // 4 * 4) for r in range(8)]
    assert four[5].name == "node1-engine1" and four[5].ranks(node_first_rank=8) == [12, 13, 14, 15]


def test_engine_layouts_that_cannot_work_are_refused_with_what_to_set():
    from rltrain.config import ConfigError, EngineConfig
    from rltrain.engine.layout import EngineLayout

    with pytest.raises(ConfigError, match=r"gpus_per_engine=3 does not divide the node's 8 GPUs.*\[1, 2, 4, 8\]"):
        EngineLayout.of(EngineConfig(backend="sglang", gpus_per_engine=3), "sglang", _env(0), 8)
    with pytest.raises(ConfigError, match=r"gpus_per_engine=16 is larger than the node: LOCAL_WORLD_SIZE=8"):
        EngineLayout.of(EngineConfig(backend="sglang", gpus_per_engine=16), "sglang", _env(0), 8)
    with pytest.raises(ConfigError, match=r"LOCAL_WORLD_SIZE=8 ranks .* only 4 GPU\(s\) visible.*--nproc-per-node=4"):
        EngineLayout.of(EngineConfig(backend="sglang"), "sglang", _env(0), 4)
    # The embedded engine over two GPUs: one process taking both TP ranks' payloads.
    embedded = EngineLayout.of(EngineConfig(backend="auto", gpus_per_engine=2), "embedded", _env(0), 8)
    assert embedded.gpus_per_engine == 2


def test_engines_on_gpus_of_their_own_start_past_the_trainers_gpus_and_share_out_the_ranks():
    """engine.gpus (#54): 6 trainer ranks and 2 GPUs of the engines' own on each node."""
    from rltrain.config import EngineConfig
    from rltrain.engine.command import engine_seed, server_command
    from rltrain.engine.layout import EngineLayout

    cfg = EngineConfig(backend="embedded", device="cuda", gpus=2)
    two = [EngineLayout.of(cfg, "embedded", _env(r, 6, node=1), 8) for r in range(6)]
    assert [(x.engine, x.is_engine_leader, x.base_gpu_id, x.tp_rank) for x in two] == [
        (0, True, 6, 0),
        (1, True, 7, 0),
        (0, False, 6, 0),
        (1, False, 7, 0),
        (0, False, 6, 0),
        (1, False, 7, 0),
    ]
    assert two[3].name == "node1-engine1" and two[3].local_ranks() == [1, 3, 5] and two[0].apart
    assert not two[0].trainer_tp_ranks and two[0].engines_per_node == 2
    cmd = server_command(cfg, "/m", 1, layout=two[1])
    assert cmd[cmd.index("--device") + 1] == "cuda:7" and "--tp-size" not in cmd
    assert len({engine_seed(0, x) for x in two}) == 2  # one seed per engine, none shared across nodes' counts
    # SGLang by default: one engine over all of engine.gpus, led by local rank 0
    sg_cfg = EngineConfig(backend="sglang", device="cuda", gpus=4)
    sg = [EngineLayout.of(sg_cfg, "sglang", _env(r, 4), 8) for r in range(4)]
    assert {(x.engine, x.gpus_per_engine, x.base_gpu_id) for x in sg} == {(0, 4, 4)}
    assert [x.is_engine_leader for x in sg] == [True, False, False, False]
    cmd = server_command(sg_cfg, "/m", 1, layout=sg[0])
    assert cmd[cmd.index("--tp-size") + 1] == "4" and cmd[cmd.index("--base-gpu-id") + 1] == "4"
    # On the CPU the cores are shared out over the trainer ranks' slots and the engines' own
    cpu = EngineLayout.of(EngineConfig(backend="sglang", gpus=2, gpus_per_engine=2), "sglang", _env(0, 2), None)
    assert cpu.cpu_binding([0, 1, 2, 3]) == "2|3"


def test_engines_of_their_own_that_cannot_work_are_refused_with_what_to_set(tmp_path):
    from rltrain.config import ConfigError, EngineConfig, load_config
    from rltrain.engine.layout import EngineLayout

    with pytest.raises(
        ConfigError,
        match=r"need 8 GPUs on each node, but this process sees 7: run torchrun "
        r"--nproc-per-node=5 .* or set engine.gpus=1",
    ):
        EngineLayout.of(EngineConfig(backend="embedded", gpus=2), "embedded", _env(0, 6), 7)
    with pytest.raises(ConfigError, match=r"gpus_per_engine=2 does not divide engine.gpus=3.*one of \[1, 3\]"):
        EngineLayout.of(EngineConfig(backend="sglang", gpus=3, gpus_per_engine=2), "sglang", _env(0, 4), 8)
    with pytest.raises(ConfigError, match=r"makes 4 engines per node, more than its 2 trainer rank\(s\).*to 2 or more"):
        EngineLayout.of(EngineConfig(backend="embedded", gpus=4), "embedded", _env(0, 2), 8)
    base = ["model.path=/m", "data.path=synthetic:addition"]
    with pytest.raises(ConfigError, match="engine.gpus=2 puts the engines on GPUs of their own.*loop.colocate=false"):
        load_config(None, [*base, "engine.gpus=2"])
    with pytest.raises(ConfigError, match="engine.gpus=-1"):
        load_config(None, [*base, "engine.gpus=-1", "loop.colocate=false"])
    # distributed on GPU: refused where engines share the trainer's GPUs, the message says how not to
    nccl = [*base, "sync.transport=distributed", "engine.device=cuda", "loop.colocate=false"]
    with pytest.raises(ConfigError, match=r"put the engines on GPUs of their own \(loop.colocate=false, engine.gpus"):
        load_config(None, nccl)
    load_config(None, [*nccl, "engine.gpus=1"])
    # tensor to engines of several GPUs of their own: no trainer rank is on their TP ranks' GPUs
    from types import SimpleNamespace

    from rltrain.setup import check_placement

    apart = [*base, "loop.colocate=false", "engine.backend=embedded", "engine.device=cpu", "engine.gpus=2"]
    world = SimpleNamespace(env=_env(0, 2))
    with pytest.raises(ConfigError, match=r"sync.transport=tensor to engines of 2 GPUs of their own.*distributed"):
        check_placement(load_config(None, [*apart, "engine.gpus_per_engine=2", "sync.transport=tensor"]), world)
    check_placement(load_config(None, [*apart, "sync.transport=tensor"]), world)  # engines of one GPU: fine
    with pytest.raises(ConfigError, match=r"makes 2 engines per node, more than its 1 trainer rank"):
        check_placement(load_config(None, [*apart, "sync.transport=disk"]), SimpleNamespace(env=_env(0, 1)))


def test_each_engine_gets_its_gpus_and_the_engine_environment_sglang_needs(monkeypatch):
    from rltrain.config import EngineConfig
    from rltrain.engine.command import server_command, server_environment
    from rltrain.engine.layout import EngineLayout

    cfg = EngineConfig(backend="sglang", device="cuda", gpus_per_engine=4)
    second = EngineLayout.of(cfg, "sglang", _env(4), 8)
    cmd = server_command(cfg, "/m", 1, layout=second)
    assert cmd[cmd.index("--tp-size") + 1] == "4" and cmd[cmd.index("--base-gpu-id") + 1] == "4"
    assert "--enable-weights-cpu-backup" not in cmd  # no device->host->device copy of the model every step
    assert "--enable-weights-cpu-backup" in server_command(
        EngineConfig(**{**cfg.__dict__, "weights_backup": True}), "/m", 1
    )
    embedded = server_command(EngineConfig(backend="embedded", device="cuda"), "/m", 1, layout=EngineLayout(3, 8, 0, 1))
    assert embedded[embedded.index("--device") + 1] == "cuda:3" and "--weights-backup" not in embedded
    assert "--tp-size" not in embedded
    over_two = server_command(EngineConfig(backend="embedded", device="cuda"), "/m", 1, layout=EngineLayout(2, 8, 0, 2))
    assert over_two[over_two.index("--device") + 1] == "cuda:2" and over_two[over_two.index("--tp-size") + 1] == "2"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    env = server_environment(cfg, second)
    # SGLang's memory saver does not take expandable segments; NCCL cuMem off on both ends.
    assert env["PYTORCH_CUDA_ALLOC_CONF"] is None and env["PYTORCH_ALLOC_CONF"] is None
    assert env["NCCL_CUMEM_ENABLE"] == "0"
    cpu = server_environment(EngineConfig(backend="sglang", device="cpu", gpus_per_engine=2), EngineLayout(0, 2, 0, 2))
    assert cpu["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1  # one core set per TP rank


def test_what_sglang_cannot_do_where_it_runs_is_refused_at_start_up():
    from rltrain.config import ConfigError, EngineConfig, load_config
    from rltrain.engine.command import check_engine

    with pytest.raises(ConfigError, match="SGLang on CPU cannot be deterministic"):
        check_engine(EngineConfig(backend="sglang", device="cpu", deterministic=True), seeded=True)
    check_engine(EngineConfig(backend="embedded", device="cpu", deterministic=True), seeded=True)
    with pytest.raises(ConfigError, match="NCCL refuses .* use sync.transport=tensor"):
        load_config(
            None, ["model.path=/m", "data.path=synthetic:addition", "sync.transport=distributed", "engine.device=cuda"]
        )


def test_an_engine_started_by_a_job_that_ignores_sigint_still_stops_on_sigint(tmp_path):
    """A job in the background of a non-interactive shell (`nohup torchrun ... &`) inherits SIGINT
    ignored. The engine must still take the SIGINT its rank stops it with (and clean up), not sit
    out the grace period and be killed."""
    import signal
    import sys
    import time

    from rltrain.engine.process import EngineProcess

    child = (
        "import signal, time; "
        "print('handler', 'default' if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 'other', "
        "flush=True); "
        "time.sleep(60)"
    )
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = EngineProcess.start([sys.executable, "-c", child], "http://127.0.0.1:1", tmp_path / "e.log")
    finally:
        signal.signal(signal.SIGINT, old)
    deadline = time.monotonic() + 30
    while not proc.log_tail().splitlines()[-1].startswith("handler ") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.log_tail().splitlines()[-1] == "handler default", proc.log_tail()
    t0 = time.monotonic()
    proc.stop(grace_s=10.0)
    assert time.monotonic() - t0 < 5.0 and proc.proc.returncode != -signal.SIGKILL


def test_the_embedded_engines_memory_saver_is_asked_for_where_it_can_run(monkeypatch):
    """engine.embedded.memory_saver: auto turns it on for the embedded engine on CUDA where
    torch_memory_saver is installed; true where it cannot run is refused with what to do; the
    engine's program itself refuses the flag without the package, before it loads anything."""
    from rltrain.config import ConfigError, EmbeddedEngineConfig, EngineConfig
    from rltrain.engine import command
    from rltrain.engine.embedded import saver

    cuda = EngineConfig(backend="embedded", device="cuda")
    for installed in (False, True):
        monkeypatch.setattr(saver, "installed", lambda v=installed: v)
        assert (saver.FLAG in command.server_command(cuda, "/m", 1)) == installed
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        env = command.server_environment(cuda)
        assert ("PYTORCH_CUDA_ALLOC_CONF" in env and env["PYTORCH_CUDA_ALLOC_CONF"] is None) == installed
        off = EngineConfig(backend="embedded", device="cuda", embedded=EmbeddedEngineConfig(memory_saver=False))
        assert saver.FLAG not in command.server_command(off, "/m", 1)
        assert saver.FLAG not in command.server_command(EngineConfig(backend="embedded", device="cpu"), "/m", 1)
    with pytest.raises(ConfigError, match="memory saver is CUDA-only"):
        command.check_engine(
            EngineConfig(backend="embedded", device="cpu", embedded=EmbeddedEngineConfig(memory_saver=True)),
            seeded=False,
        )
    monkeypatch.setattr(saver, "installed", lambda: False)
    with pytest.raises(ConfigError, match="pip install torch_memory_saver"):
        command.check_engine(
            EngineConfig(backend="embedded", device="cuda", embedded=EmbeddedEngineConfig(memory_saver=True)),
            seeded=False,
        )
    from rltrain.engine.embedded.engine import EmbeddedEngine

    with pytest.raises(ValueError, match="CUDA only"):  # (before it loads anything)
        EmbeddedEngine("/no/such/model", device="cpu", memory_saver=True)
    monkeypatch.undo()
    if not saver.installed():  # (CI, this machine): the engine's program says what to install
        r = subprocess.run(
            [sys.executable, "-m", "rltrain.engine.embedded", "--model-path", "/m", saver.FLAG],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and "pip install torch_memory_saver" in r.stderr


def _launch_refused(rank: int, world_size: int, extra: list[str], release: bool | str, colocate: bool) -> str:
    from rltrain.config import ConfigError, EngineConfig
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=60)
    try:
        cfg = EngineConfig(backend="sglang", device="cuda", extra_args=extra, release=release)
        NodeEngine.launch(cfg, "/m", world, Path("/nonexistent"), colocate=colocate)
        return "launched"
    except ConfigError as e:
        return str(e)
    finally:
        world.close()


def test_hicache_is_refused_at_start_up_where_the_engine_releases_its_memory():
    """SGLang 0.5.23 releases its weights, KV cache and CUDA graphs (its memory saver's tags), never
    HiCache's pinned host pool: with the trainer colocated and the engine's memory released, the
    pool would stay allocated through training. Refused before anything starts, in either of
    SGLang's spellings; kept where nothing is released (here the next check, the GPUs this CPU
    machine does not have, is what refuses)."""
    cases = [
        (["--enable-hierarchical-cache"], "auto", True),
        (["--hicache-ratio", "2", "--enable-hicache"], True, True),
        (["--enable-hierarchical-cache"], False, True),
        (["--enable-hierarchical-cache"], "auto", False),
    ]
    out = [values(run_ranks(_launch_refused, 1, *case, deadline_s=60))[0] for case in cases]
    for refused in out[:2]:
        assert "SGLang's HiCache" in refused and "never HiCache's host pool" in refused, refused
        assert "engine.release=false" in refused and "loop.colocate=false" in refused
    assert out[0].startswith("engine.extra_args has --enable-hierarchical-cache")
    assert out[1].startswith("engine.extra_args has --enable-hicache")
    for kept in out[2:]:
        assert "HiCache" not in kept and "GPU(s) visible" in kept, kept


def test_a_free_port_is_drawn_below_the_kernels_ephemeral_range_and_skips_one_in_use(monkeypatch):
    """Engines' and rendezvous ports (`runtime.net.free_port`): a port the kernel hands out is one
    every outgoing connection draws from too (a rollout opens one per trajectory), which can take
    it before the server listens: EADDRINUSE, seen in CI on a rendezvous store beside the tests'
    HTTP clients. Drawn from below the ephemeral range they are out of that race; one already
    bound is skipped."""
    import random
    import socket
    from pathlib import Path

    from rltrain.runtime import net

    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not path.exists():
        pytest.skip("no ephemeral port range to read here (not Linux)")
    low = int(path.read_text().split()[0])
    ports = [net.free_port() for _ in range(50)]
    assert all(max(1024, low - net.SPAN) <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 1  # (drawn, not one fixed port)
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))
        draws = iter([ports[0], ports[1]])
        monkeypatch.setattr(random.Random, "randrange", lambda self, a, b: next(draws))
        assert net.free_port() == ports[1]  # (the one in use skipped)
