"""The node's engine servers: each started by its leader rank, shared with its ranks, never orphaned.

The node's GPUs are split into engines (`engine/layout.py`); the first rank of each engine's GPUs
starts its server (real SGLang over those GPUs, or the embedded engine on one; the command line
from `engine/command.py`) as a child process on a free loopback port (`engine/process.py`: its
own process group, killed with its rank) and waits for /health with a timeout. The server's
output goes to `<run_dir>/engine/node<k>-engine<e>.log`; a server that dies is reported with the
tail of that log. A healthy server is asked for its layout (/server_info) and refused unless it is
the one laid out (`EngineLayout.check_reported`). Every rank learns its engine's address over the
Gloo bridge and generates through it.

An engine spans its ranks' GPUs, and only its leader talks to it: the ranks of an engine meet on
their own bridge subgroup so that its memory is never taken or given back on a GPU whose rank is
not ready for it (the phase verbs below).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rltrain.config import ConfigError, EngineConfig
from rltrain.engine.client import EngineClient, EngineError
from rltrain.engine.command import (
    refuse_host_cache,
    resolve_backend,
    resolve_device,
    server_command,
    server_environment,
)
from rltrain.engine.layout import EngineLayout
from rltrain.engine.process import EngineCrashed, EngineProcess
from rltrain.interfaces import World
from rltrain.runtime.bridge import Bridge
from rltrain.runtime.net import free_port

log = logging.getLogger("rltrain.engine")


class NodeEngine:
    """This rank's engine (one of its node's, `engine/layout.py`) in the loop's verbs: a client,
    and on the engine's leader rank the process too. The phase verbs are collectives over the
    bridge (every rank of the job calls them): each engine's leader talks to its engine, the
    other ranks wait for it. A failure of the leader's request is raised on every rank that waits
    for it (`EnginePhaseError`).

        release_memory   every rank done generating, then each leader pauses its engine
                         (aborting what is still in flight: a request a client gave up on) and
                         frees its weights, KV cache and CUDA graphs; the engine's other ranks
                         wait for that before their trainer comes back        [colocated]
        resume_weights   the leader takes the weights' memory back (garbage until the sync
                         rewrites every parameter, unless engine.weights_backup), then every
                         rank goes on                                             [colocated]
        resume_kv        once every rank of the engine has put its trainer away and finished its
                         NCCL teardown (`World.wait_destroyed`; not where the rank says the
                         last rollout left room for its NCCL memory), the leader takes the KV cache
                         and CUDA graphs back on all of the engine's GPUs and lets the engine
                         generate again, then every rank goes on                  [colocated]
        recover          after a rollout: restart what died (or stop the job with its log tail)

    The engine's leader maps and unmaps memory on every GPU of the engine, so the waits of
    release_memory and resume_kv are over the engine's ranks (`engine_ranks`, a bridge subgroup;
    None for an engine of one GPU): without them a peer could bring its trainer back while the
    engine still holds its GPU, or the KV pool could be mapped on a GPU whose trainer state and
    NCCL communicators are still there.

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
        engine_ranks: Bridge | None = None,
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
        self.engine_ranks = engine_ranks  # the bridge among this engine's ranks (None: one GPU)

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
        pool: Callable[[EngineLayout], int] | None = None,
    ) -> NodeEngine:
        """Collective over the bridge: each engine's leader starts and health-checks its engine,
        every rank connects to its own. `vocab_size`: the model's, so that the client refuses
        token ids outside it. Refused (ConfigError): SGLang's HiCache where the engine's memory
        is released for the trainer (`refuse_host_cache`), a layout the node cannot hold, and,
        once healthy, an engine that is not the one laid out. `meanwhile`: the rank's own set-up,
        run on every rank while the engines start (between starting the process and waiting for
        its health). `pool`: engine.max_total_tokens for the layout (`engine.pool.pool_tokens`;
        None: the configured count, auto left to the engine's own default)."""
        backend, device = resolve_backend(cfg.backend), resolve_device(cfg.device)
        releases = engine_releases(cfg, backend, device)
        if colocate and releases and backend == "sglang":
            refuse_host_cache(cfg.extra_args)
        visible = torch.cuda.device_count() if device == "cuda" else None
        layout = EngineLayout.of(cfg, backend, world.env, visible)
        log_path = run_dir / "engine" / f"{layout.name}.log"
        if pool is not None:
            configured, cfg = cfg.max_total_tokens, dataclasses.replace(cfg, max_total_tokens=pool(layout))
            if world.rank == 0 and cfg.max_total_tokens:
                log.info(
                    "engines: a KV pool of at most %d tokens each (engine.max_total_tokens=%s)",
                    cfg.max_total_tokens,
                    "auto: what a step's rollout holds at once" if configured == "auto" else configured,
                )
        if world.rank == 0:
            log.info(
                "engines: %d per node of %d GPU(s) each (%s, %s)%s",
                layout.engines_per_node,
                layout.gpus_per_engine,
                backend,
                device,
                f", on GPUs of their own from GPU {layout.local_world_size} on (engine.gpus={layout.engine_gpus}), "
                f"shared round robin by the node's {layout.local_world_size} rank(s)"
                if layout.apart
                else "",
            )
            if cfg.release is True and backend == "sglang" and device == "cpu" and colocate:
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
        engine_ranks = None
        if colocate and releases and layout.gpus_per_engine > 1:  # (made by its members: all are here)
            ranks = layout.ranks(world.rank - world.env.local_rank)
            engine_ranks = world.bridge.subgroup(ranks, f"engine/{layout.name}")
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
        return cls(
            client,
            url,
            process,
            world,
            colocate,
            start,
            cfg.max_restarts,
            layout,
            releases,
            device == "cuda",
            engine_ranks,
        )

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
        request whose client timed out) is aborted first: SGLang releases only when idle. The
        engine's ranks return once their engine has let go of their GPUs (their trainer comes
        back next, and with world.reload=false nothing else would make them wait)."""
        world = self._world()
        if not self.releases:  # nothing to let go of: no rank waits for another
            return
        world.bridge.barrier(phase="rollout done")

        def release() -> None:
            self.client.pause("abort")
            self.client.release(self.REGIONS)

        self._on_leader(release, self.engine_ranks, "engine released")

    def resume_weights(self) -> None:
        world = self._world()
        if not self.releases:
            return
        self._on_leader(lambda: self.client.resume(["weights"]), world.bridge, "engine resume weights")

    def resume_kv(self, room: bool = False) -> None:
        """After the trainer's put-away: the KV cache and CUDA graphs are mapped on every GPU of
        the engine, so the leader waits for every rank of its engine to have put its trainer
        away and finished its NCCL teardown (waited for here), unless `room`: this rank's last
        rollout left room for the world's NCCL memory beside them (the loop's
        `TrainerCycle.room_for`; the next rebuild joins the teardown instead)."""
        world = self._world()
        if not self.releases:
            return
        if not room:
            world.wait_destroyed()
        if self.engine_ranks is not None:
            self.engine_ranks.barrier(phase=f"{self.name}: every rank's trainer put away")

        def resume() -> None:
            self.client.resume(["kv_cache", "cuda_graph"])
            self.client.continue_generation()

        self._on_leader(resume, world.bridge, "engine resume kv")

    def pause_generation(self) -> None:
        """A weight update to engines that keep serving (loop.in_flight_update): every engine ends
        the rows in flight (SGLang's /pause_generation, mode abort: each answered with its tokens
        so far) and holds new requests until `continue_generation`. A collective over the job."""
        self._on_leader(lambda: self.client.pause("abort"), self._world().bridge, "engine paused")

    def continue_generation(self) -> None:
        """After the update: the engines take requests again (those held, and the cut rows'
        continuations). A collective over the job: no engine serves before every engine is updated."""
        self._on_leader(self.client.continue_generation, self._world().bridge, "engine continued")

    def _on_leader(self, action: Callable[[], None], ranks: Bridge | None, phase: str) -> None:
        """`action` (requests to the engine) on its leader; the ranks of `ranks` (a collective
        over it; None: this rank alone) wait for it and learn every leader's failure, raised on
        each of them as EnginePhaseError."""
        error: str | None = None
        cause: EngineError | None = None
        if self.is_leader:
            try:
                action()
            except EngineError as e:
                error, cause = f"{self.name}: {e}", e
        errors = [error] if ranks is None else ranks.all_gather_object(error, phase=phase)
        failed = [e for e in errors if e]
        if failed:
            raise EnginePhaseError(f"{phase} failed on the engine's leader rank: " + "; ".join(failed)) from cause

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
                # Another server may have bound the port first and answered for it (ours then
                # fails to bind, or is still starting).
                if proc.listens_on(port) is False:
                    raise EngineError("/health", f"port {port} is served by another process: address already in use")
                log.info("engine healthy at %s after %.1fs", url, waited)
            except EngineError as e:
                probe.close()
                tail = proc.log_tail() + f"\n{e}"
                proc.stop()
                # Another job may have taken the port between our probe and the server's bind.
                if "address already in use" in tail.lower() and attempt + 1 < attempts:
                    log.warning("engine port %d was taken; retrying on another port", port)
                    continue
                raise proc.crashed_error(f"did not become healthy ({e})") from None
            try:
                (layout or EngineLayout(0, 1, 0, 1)).check_reported(probe.server_info())
            except EngineError as e:
                proc.stop()
                raise proc.crashed_error(f"did not report its layout ({e})") from None
            except ConfigError:
                proc.stop()
                raise
            finally:
                probe.close()
            return proc
        raise AssertionError("unreachable")

    def check_alive(self) -> None:
        """The engine's leader: raise EngineCrashed (with log tail) if the server process has exited."""
        if self.process is not None and not self.process.alive:
            raise self.process.crashed_error("exited")

    def shutdown(self) -> None:
        self.client.close()
        if self.process is not None:
            self.process.stop()
        if self.engine_ranks is not None:
            self.engine_ranks.close()
            self.engine_ranks = None


class EnginePhaseError(RuntimeError):
    """A phase verb's request failed on an engine's leader; raised on every rank that waited for it."""


def engine_releases(cfg: EngineConfig, backend: str, device: str) -> bool:
    """Whether the engine frees its memory between rollouts when colocated: engine.release, auto
    on CUDA; never SGLang on CPU, whose release frees nothing there (its memory saver needs CUDA)."""
    if cfg.release == "auto":
        return device == "cuda"
    return bool(cfg.release) and not (backend == "sglang" and device == "cpu")


def _started_everywhere(
    world: World,
    layout: EngineLayout,
    start: Callable[[], EngineProcess] | None,
    phase: str,
    engines: set[str] | None = None,
) -> tuple[EngineProcess | None, str | None]:
    """Collective over the bridge: ranks given `start` (engine leaders) start their engine;
    every rank learns its engine's URL. A failure anywhere raises on every rank (ConfigError
    where every failure is one: an engine that is not the one laid out); engines that did start
    are stopped. `engines`: only these engines (by name) were started; the others' ranks get
    (None, None)."""
    process, url, error, refused = None, None, None, False
    if start is not None:
        try:
            process = start()
            url = process.url
        except (EngineCrashed, EngineError, OSError, ConfigError) as e:
            error, refused = str(e), isinstance(e, ConfigError)
    entries = world.bridge.all_gather_object((layout.name, start is not None, url, error, refused), phase=phase)
    failed = [e for e in entries if e[3] is not None]
    if failed:
        if process is not None:
            process.stop()
        message = "; ".join(err if config else f"{name}: {err}" for name, _, _, err, config in failed)
        raise ConfigError(message) if all(e[4] for e in failed) else EngineCrashed(message)
    if engines is not None and layout.name not in engines:
        return None, None
    return process, next(e[2] for e in entries if e[0] == layout.name and e[1])
