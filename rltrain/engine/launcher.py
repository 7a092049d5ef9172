"""The node's engine servers: each started by its leader rank, shared with its ranks, never orphaned.

The node's GPUs are split into engines (`engine/layout.py`); the first rank of each engine's GPUs
starts its server (real SGLang over those GPUs, or the embedded engine on one) as a child process
on a free loopback port, in its own process group, with the parent-death signal set to SIGKILL —
so the server dies with the rank even when the rank is SIGKILLed — and waits for /health with a
timeout. The server's output goes to `<run_dir>/engine/node<k>-engine<e>.log`; a server that dies
is reported with the tail of that log. Every rank learns its engine's address over the Gloo bridge
and generates through it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from rltrain.config import ConfigError, EngineConfig
from rltrain.engine import forked
from rltrain.engine.client import EngineClient, EngineError
from rltrain.engine.embedded import saver
from rltrain.engine.layout import EngineLayout
from rltrain.interfaces import World
from rltrain.runtime.net import free_port

log = logging.getLogger("rltrain.engine")


class EngineCrashed(RuntimeError):
    """The engine process exited; the message carries the tail of its log."""


def resolve_device(device: str) -> str:
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_backend(backend: str) -> str:
    """auto: SGLang where it is installed and a GPU is present, else the embedded engine."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available():
        try:
            if importlib.util.find_spec("sglang") is not None:
                return "sglang"
        except (ImportError, ValueError):
            pass
    return "embedded"


def memory_saver_on(cfg: EngineConfig) -> bool:
    """Whether the embedded engine runs with its memory saver (engine/embedded/saver.py):
    engine.embedded.memory_saver, auto resolved (on CUDA where torch_memory_saver is installed)."""
    if resolve_backend(cfg.backend) != "embedded" or resolve_device(cfg.device) == "cpu":
        return False
    return cfg.embedded.memory_saver is True or (cfg.embedded.memory_saver == "auto" and saver.installed())


API_KEY_VARIABLE = "RLTRAIN_ENGINE_API_KEY"  # the embedded engine reads its API key here


def check_engine(cfg: EngineConfig, seeded: bool) -> None:
    """What the resolved engine cannot do, refused (or said) before it starts."""
    backend, device = resolve_backend(cfg.backend), resolve_device(cfg.device)
    if backend == "sglang" and device == "cpu" and cfg.deterministic:
        raise ConfigError(
            "engine.deterministic=true: SGLang on CPU cannot be deterministic (it refuses "
            "--enable-deterministic-inference with the torch_native attention it runs on CPU); set "
            "engine.deterministic=false (rollouts are then not repeatable), or use the embedded engine "
            "(engine.backend=embedded), which is deterministic everywhere"
        )
    if cfg.embedded.memory_saver is True and backend == "embedded":
        if device != "cuda":
            raise ConfigError(
                "engine.embedded.memory_saver=true: the embedded engine's memory saver is CUDA-only (the engine "
                f"runs on {device}); set engine.embedded.memory_saver=auto"
            )
        if not saver.installed():
            raise ConfigError(
                "engine.embedded.memory_saver=true: torch_memory_saver is not installed (pip install "
                "torch_memory_saver), or set engine.embedded.memory_saver=auto"
            )
    if backend == "sglang" and seeded and not cfg.deterministic:
        log.warning(
            "rollout.seeded=true but SGLang honours sampling seeds only with --enable-deterministic-inference "
            "(engine.deterministic=true): every sample still gets its own seed, but rollouts will not repeat"
        )


def server_command(
    cfg: EngineConfig,
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    weights_roots: list[str] | tuple[str, ...] = (),
    layout: EngineLayout | None = None,
) -> list[str]:
    """The command line that starts the configured engine server (config: `EngineConfig`) for
    `layout`'s engine (None: one engine on the first device). `weights_roots`: the only
    directories the embedded engine loads weight versions from (besides its own model); SGLang
    loads any path it is given."""
    backend = resolve_backend(cfg.backend)
    device = resolve_device(cfg.device)
    tp_size, base_gpu = (layout.gpus_per_engine, layout.base_gpu_id) if layout is not None else (1, 0)
    if backend == "embedded":
        cmd = [
            sys.executable,
            "-m",
            "rltrain.engine.embedded",
            "--model-path",
            model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--device",
            device if device == "cpu" else f"cuda:{base_gpu}",
            "--dtype",
            cfg.dtype,
            "--seed",
            str(cfg.seed),
            "--max-batch-size",
            str(cfg.embedded.max_batch_size),
            "--parent-pid",
            str(os.getpid()),
        ]
        if device != "cpu":  # the paged KV cache's share of the GPU, as SGLang's
            cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
            if cfg.embedded.compile:
                cmd.append("--enable-torch-compile")
            if memory_saver_on(cfg):
                cmd.append(saver.FLAG)
        if tp_size > 1:  # SGLang's per-TP-rank payloads, received in one process (engine/embedded/receiver.py)
            cmd += ["--tp-size", str(tp_size)]
        if cfg.deterministic:
            cmd.append("--deterministic")
        if cfg.weights_backup:
            cmd.append("--weights-backup")
        for root in weights_roots:
            cmd += ["--weights-root", str(root)]
    elif backend == "sglang":
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(tp_size),
            "--mem-fraction-static",
            str(cfg.mem_fraction_static),
            "--skip-tokenizer-init",
            "--random-seed",
            str(cfg.seed),
            "--dtype",
            cfg.dtype,
            # The engine idles through every training phase; without this its scheduler spins a
            # whole CPU core the whole time.
            "--sleep-on-idle",
        ]
        if device == "cuda":
            cmd += ["--base-gpu-id", str(base_gpu), "--enable-memory-saver"]
            if cfg.weights_backup:
                cmd.append("--enable-weights-cpu-backup")
        else:
            # What runs on CPU (docs/engines.md): torch-native attention, no CUDA graphs.
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        if cfg.deterministic:
            cmd.append("--enable-deterministic-inference")
        if cfg.api_key:
            cmd += ["--api-key", cfg.api_key]
    else:
        raise ValueError(f"engine.backend={cfg.backend!r}: expected auto, embedded or sglang")
    return cmd + list(cfg.extra_args)


TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def secret_environment(cfg: EngineConfig) -> dict[str, str]:
    """What the engine server gets through its environment rather than its command line."""
    return {API_KEY_VARIABLE: cfg.api_key} if cfg.api_key else {}


# The memory saver (SGLang's, and the embedded engine's) does not support expandable segments:
# the trainer's allocator settings stay with the trainer.
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def engine_environment() -> dict[str, str]:
    """This process's environment without torchrun's rank variables: the engine is not a rank,
    and e.g. TORCHELASTIC_USE_AGENT_STORE would make its weight-update rendezvous wait for a
    store that torchrun's agent does not serve."""
    return {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}


def server_environment(cfg: EngineConfig, layout: EngineLayout | None = None) -> dict[str, str | None]:
    """What the engine server's environment adds to (or, as None values, drops from) this process's."""
    env: dict[str, str | None] = dict(secret_environment(cfg))
    # Inherited as the trainer has it (cli sets 0 by default): both ends of an NCCL weight group
    # must agree on cuMem, and SGLang's memory saver wants it off.
    env["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE", "0")
    sglang = resolve_backend(cfg.backend) == "sglang"
    if sglang or memory_saver_on(cfg):
        env.update(dict.fromkeys(ALLOCATOR_VARIABLES))
    if sglang:
        on_cpu = resolve_device(cfg.device) == "cpu"
        if on_cpu and layout is not None and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = layout.cpu_binding()
    return env


def _engine_preexec(parent_pid: int) -> None:
    """preexec_fn: the job's stop signals (runtime/stop.py) are for the ranks, which stop the
    engine themselves: a scheduler signals every process of the job, and an engine gone before
    its rank's checkpoint would fail that step. SIGTERM and SIGUSR1 stay ignored across exec
    (SGLang's server still takes SIGTERM: it installs its own handler). SIGINT, how the rank
    stops it (`EngineProcess.stop`), is back to its default: a job started in the background of
    a non-interactive shell (`nohup torchrun ... &`) inherits it ignored, and the engine would
    then be killed after the grace period every time, its clean-up skipped. And SIGKILL this
    child when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@dataclass
class EngineProcess:
    """A running engine server owned by this process."""

    proc: subprocess.Popen | forked.ForkedProcess
    url: str
    log_path: Path
    _ps: psutil.Process | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls,
        cmd: list[str],
        url: str,
        log_path: Path,
        env: dict[str, str | None] | None = None,
        fork: bool = False,
    ) -> EngineProcess:
        """`env`: added to this process's environment (without torchrun's variables); a None
        value removes the variable. `fork`: the embedded CPU engine is forked from this process
        where that is safe (`engine/forked.py`), else started as a new interpreter."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in {**engine_environment(), **(env or {})}.items() if v is not None}
        parent = os.getpid()
        why_not = forked.blocker(cmd) if fork else "engine.embedded.start=exec"
        how = "forked from its rank" if why_not is None else "a new interpreter"
        with open(log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} ({how}) {' '.join(cmd)}\n".encode())
            out.flush()
            proc: subprocess.Popen | forked.ForkedProcess
            if why_not is None:
                proc = forked.fork_engine(cmd, str(log_path), full_env, lambda: _engine_preexec(parent))
            else:
                proc = subprocess.Popen(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=full_env,
                    start_new_session=True,
                    preexec_fn=lambda: _engine_preexec(parent),
                )
        log.info(
            "engine started: pid %d, %s, log %s (%s)",
            proc.pid,
            url,
            log_path,
            how + (f": {why_not}" if why_not else ""),
        )
        return cls(proc, url, log_path)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int | None:
        """The server process's resident memory (bytes; None once it is gone). Read after every
        phase: the process handle is made once."""
        try:
            if self._ps is None:
                self._ps = psutil.Process(self.proc.pid)
            return int(self._ps.memory_info().rss)
        except psutil.Error:
            return None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_bytes()[-65536:].decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def crashed_error(self, what: str) -> EngineCrashed:
        return EngineCrashed(
            f"engine process {self.proc.pid} {what} (exit code {self.proc.poll()}); "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGINT the server's whole process group (SIGTERM it ignores: `_engine_preexec`),
        SIGKILL what is left after `grace_s`."""
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children of the server (SGLang's scheduler/detokenizer) share its process group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class NodeEngine:
    """This rank's engine (one of its node's, `engine/layout.py`) in the loop's verbs: a client,
    and on the engine's leader rank the process too. The phase verbs are collectives over the
    bridge (every rank of the job calls them): each engine's leader talks to its engine, the
    other ranks wait for it.

        release_memory   every rank done generating, then each leader pauses its engine
                         (aborting what is still in flight: a request a client gave up on) and
                         frees its weights, KV cache and CUDA graphs              [colocated]
        resume_weights   the leader takes the weights' memory back (garbage until the sync
                         rewrites every parameter, unless engine.weights_backup), then every
                         rank goes on                                             [colocated]
        resume_kv        the leader takes the KV cache and CUDA graphs back (after the world's
                         NCCL memory is freed: the caller waits for that) and lets the engine
                         generate again, then every rank goes on                  [colocated]
        recover          after a rollout: restart what died (or stop the job with its log tail)

    Not colocated (`loop.colocate=false`), the engine keeps its memory and only the barriers run.
    SGLang releases memory on CUDA only: on CPU the release is skipped (said once in the log).
    """

    REGIONS = ["weights", "kv_cache", "cuda_graph"]  # SGLang's memory regions, all released

    def __init__(
        self,
        client: EngineClient,
        url: str,
        process: EngineProcess | None,
        world: World | None = None,
        colocate: bool = True,
        start: Callable[[], EngineProcess] | None = None,
        max_restarts: int = 0,
        layout: EngineLayout | None = None,
        releases: bool = True,
        reports_memory: bool = True,
    ):
        self.client = client
        self.url = url
        self.process = process
        self.world = world
        self.colocate = colocate
        self.layout = layout or EngineLayout(0, 1, 0, 1)
        # The engine frees memory between phases: colocated, and where it can (not SGLang on CPU).
        self.releases = colocate and releases
        self._start = start  # () -> a new healthy EngineProcess (the engine's leader)
        self.max_restarts, self.restarts = max_restarts, 0
        # Ask the engine's /memory: on a GPU (the ledger's device parts), until it says it has none
        # (SGLang). On the CPU the ledger needs its RSS alone, read from the process (no request).
        self._reports_memory = self._asks_memory = reports_memory

    @classmethod
    def launch(
        cls,
        cfg: EngineConfig,
        model_path: str,
        world: World,
        run_dir: Path,
        weights_roots: list[str] | tuple[str, ...] = (),
        colocate: bool = True,
        vocab_size: int | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> NodeEngine:
        """Collective over the bridge: each engine's leader starts and health-checks its engine,
        every rank connects to its own. `vocab_size`: the model's, so that the client refuses
        token ids outside it. The layout is checked against the node first (ConfigError).
        `meanwhile`: the rank's own set-up, run on every rank while the engines start (between
        starting the process and waiting for its health)."""
        backend, device = resolve_backend(cfg.backend), resolve_device(cfg.device)
        visible = torch.cuda.device_count() if device == "cuda" else None
        layout = EngineLayout.of(cfg, backend, world.env, visible)
        log_path = run_dir / "engine" / f"{layout.name}.log"
        if world.rank == 0:
            log.info(
                "engines: %d per node of %d GPU(s) each (%s, %s)",
                layout.engines_per_node,
                layout.gpus_per_engine,
                backend,
                device,
            )
        releases = device == "cuda" if cfg.release == "auto" else bool(cfg.release)
        if releases and backend == "sglang" and device == "cpu":
            releases = False
            if colocate and world.rank == 0:
                log.warning(
                    "SGLang releases memory on CUDA only: on CPU the engines keep their memory through training "
                    "(release and resume are skipped)"
                )

        def start(meanwhile: Callable[[], None] | None = None) -> EngineProcess:
            return cls._start_healthy(cfg, model_path, log_path, weights_roots, layout, meanwhile=meanwhile)

        if meanwhile is not None and not layout.is_engine_leader:
            meanwhile()
        first = (lambda: start(meanwhile)) if layout.is_engine_leader else None  # restarts run no set-up
        process, url = _started_everywhere(world, layout, first, "engine launch")
        assert url is not None
        client = EngineClient(
            url,
            request_timeout_s=cfg.request_timeout_s,
            max_inflight=cfg.max_inflight,
            prompts_per_request=cfg.prompts_per_request,
            retries=cfg.retries,
            api_key=cfg.api_key,
            vocab_size=vocab_size,
            logprob_values=backend == "embedded",
        )
        return cls(client, url, process, world, colocate, start, cfg.max_restarts, layout, releases, device == "cuda")

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def is_leader(self) -> bool:
        """This rank started this engine and talks to it for the engine's ranks."""
        return self.layout.is_engine_leader

    def _world(self) -> World:
        if self.world is None:
            raise RuntimeError("this NodeEngine was made without a world: launch() it to use the phase verbs")
        return self.world

    # ------------------------------------------------------------------ the loop's verbs

    def release_memory(self) -> None:
        """Every rank of the job must be done generating before an engine lets go of its memory:
        a release under a slower rank's requests fails them all. What is still in flight (a
        request whose client timed out) is aborted first: SGLang releases only when idle."""
        world = self._world()
        if not self.releases:  # nothing to let go of: no rank waits for another
            return
        world.bridge.barrier(phase="rollout done")
        if self.is_leader:
            self.client.pause("abort")
            self.client.release(self.REGIONS)

    def resume_weights(self) -> None:
        world = self._world()
        if not self.releases:
            return
        if self.is_leader:
            self.client.resume(["weights"])
        world.bridge.barrier(phase="engine resume weights")

    def resume_kv(self) -> None:
        world = self._world()
        if not self.releases:
            return
        if self.is_leader:
            self.client.resume(["kv_cache", "cuda_graph"])
            self.client.continue_generation()
        world.bridge.barrier(phase="engine resume kv")

    def weight_version(self) -> str | None:
        return self.client.weight_version()

    def memory_report(self) -> dict[str, Any]:
        """The engine's own memory figures (bytes) on the rank that owns its process ({} on the
        others, or once it has died): its /memory report where it has one (the embedded engine;
        SGLang reports sizes, not what is allocated now), and its process's RSS."""
        if self.process is None or not self.process.alive:
            return {}
        rep: Any = {}
        if self._reports_memory:
            try:
                rep = self.client.memory_report()
            except Exception as e:  # noqa: BLE001 - a memory report never fails a step
                self._reports_memory = getattr(e, "status", None) != 404  # SGLang: no /memory, do not ask again
                log.debug("engine memory report unavailable: %s", e)
        if not isinstance(rep, dict):
            rep = {}
        if "rss_bytes" not in rep and (rss := self.process.rss()) is not None:
            rep["rss_bytes"] = rss
        return rep

    def recover(self) -> bool:
        """Collective over the bridge, after a rollout: has any engine process died? Their
        leaders start them again and their ranks talk to the new ones; True then (the caller
        sends the weights again and retries what failed). A death beyond `max_restarts` raises
        EngineCrashed on every rank, with the dead engine's log tail."""
        world = self._world()
        report = None
        try:
            self.check_alive()
        except EngineCrashed as e:
            report = str(e)
        died = report is not None
        deaths = [(n, r) for n, r in world.bridge.all_gather_object((self.name, report), phase="engine check") if r]
        if not deaths:
            return False
        if self.restarts >= self.max_restarts:
            raise EngineCrashed(
                f"the engine died again after {self.restarts} restart(s) "
                f"(engine.max_restarts={self.max_restarts}); stopping.\n" + "\n".join(f"{n}: {r}" for n, r in deaths)
            )
        self.restarts += 1
        dead = {n for n, _ in deaths}
        log.warning(
            "engine(s) %s died during rollout; starting them again (restart %d of %d). %s",
            sorted(dead),
            self.restarts,
            self.max_restarts,
            deaths[0][1],
        )
        process, url = _started_everywhere(
            world, self.layout, self._start if died else None, "engine restart", engines=dead
        )
        if self.name in dead:
            if died:
                self.process = process
                self._reports_memory = self._asks_memory
            assert url is not None
            self.url = url
            self.client.repoint(url)
        return True

    @staticmethod
    def _start_healthy(
        cfg: EngineConfig,
        model_path: str,
        log_path: Path,
        weights_roots: list[str] | tuple[str, ...] = (),
        layout: EngineLayout | None = None,
        attempts: int = 2,
        meanwhile: Callable[[], None] | None = None,
    ) -> EngineProcess:
        """Start the engine and wait until it is healthy; `meanwhile` runs once, after its
        process started and before the wait (the engine is stopped if it raises)."""
        for attempt in range(attempts):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = EngineProcess.start(
                server_command(cfg, model_path, port, weights_roots=weights_roots, layout=layout),
                url,
                log_path,
                env=server_environment(cfg, layout),
                fork=cfg.embedded.start == "auto",
            )
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    proc.stop()
                    raise
                meanwhile = None
            probe = EngineClient(url, retries=0, api_key=cfg.api_key)
            try:
                waited = probe.wait_healthy(cfg.startup_timeout_s, alive=lambda: proc.alive)
                log.info("engine healthy at %s after %.1fs", url, waited)
                return proc
            except EngineError as e:
                tail = proc.log_tail()
                proc.stop()
                # Another job may have taken the port between our probe and the server's bind.
                if "address already in use" in tail.lower() and attempt + 1 < attempts:
                    log.warning("engine port %d was taken; retrying on another port", port)
                    continue
                raise proc.crashed_error(f"did not become healthy ({e})") from None
            finally:
                probe.close()
        raise AssertionError("unreachable")

    def check_alive(self) -> None:
        """The engine's leader: raise EngineCrashed (with log tail) if the server process has exited."""
        if self.process is not None and not self.process.alive:
            raise self.process.crashed_error("exited")

    def shutdown(self) -> None:
        self.client.close()
        if self.process is not None:
            self.process.stop()


def _started_everywhere(
    world: World,
    layout: EngineLayout,
    start: Callable[[], EngineProcess] | None,
    phase: str,
    engines: set[str] | None = None,
) -> tuple[EngineProcess | None, str | None]:
    """Collective over the bridge: ranks given `start` (engine leaders) start their engine;
    every rank learns its engine's URL. A failure anywhere raises on every rank; engines that
    did start are stopped. `engines`: only these engines (by name) were started; the others'
    ranks get (None, None)."""
    process, url, error = None, None, None
    if start is not None:
        try:
            process = start()
            url = process.url
        except (EngineCrashed, EngineError, OSError) as e:
            error = str(e)
    entries = world.bridge.all_gather_object((layout.name, start is not None, url, error), phase=phase)
    failed = [e for e in entries if e[3] is not None]
    if failed:
        if process is not None:
            process.stop()
        raise EngineCrashed("; ".join(f"{name}: {err}" for name, _, _, err in failed))
    if engines is not None and layout.name not in engines:
        return None, None
    return process, next(e[2] for e in entries if e[0] == layout.name and e[1])
