"""The reloadable world: a default process group that can be torn down and rebuilt between phases.

Colocated RL alternates phases that each want the whole GPU. NCCL communicators hold device
memory (BENCHMARKS.md has the figures), so between phases rltrain destroys the default group and
every NCCL subgroup made through `World.new_group`, and rebuilds them when the trainer needs them
again. Gloo subgroups hold no accelerator memory: they stay up across the cycle, the same
communicators taken out of torch's registry and put back (`kept_groups.py`). Ranks keep
coordinating over the persistent Gloo `Bridge`.

Store prefixes. torchrun's TCPStore (reached through the `env://` rendezvous) is the base store
and stays up for the whole job, across torchrun's restarts of it: the attempt
(TORCHELASTIC_RESTART_COUNT) is part of every prefix. Each generation initialises the default
group on `PrefixStore(f"rltrain/world/{attempt}/{generation}", base)`.
Gloo and NCCL publish peer addresses / unique ids under fixed keys and torch restarts its group
counter at 0 after a destroy, so reusing a prefix would make a rank read the previous
generation's keys and connect to dead peers; a fresh prefix per generation makes that impossible.

Group handles. `new_group` records the creation arguments and returns a `GroupHandle`. After a
rebuild the registry puts the kept gloo groups back and replays every other recorded group in
creation order (all ranks call `dist.new_group` in the same order, as torch requires), and points
the handles at them, so code that holds a handle keeps working. Nothing in torch.distributed is
patched; its registry is edited for the kept groups only, checked first.

Priming. After replay every group runs one all_reduce on its device in creation order. Gloo
connects eagerly anyway; NCCL would otherwise create communicators lazily on first use, and a
point-to-point op between a subset of ranks as a group's first op can then hang.

Teardown off the critical path. `destroy_process_group` is slow for NCCL and
holds no information the next phase needs, so by default it runs in a background thread:
`destroy()` returns once the handles are detached; `wait_destroyed()` (called by `rebuild()` and
before memory is handed to the engine) joins it. Until then `dist.is_initialized()` may read either
way, as the thread gets to it: code running meanwhile (the trainer's put-away) decides nothing from
it. `World.is_up` is False from `destroy()` on.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rltrain.config import WorldConfig
from rltrain.runtime import kept_groups
from rltrain.runtime.bridge import Bridge, BridgeError, restart_attempt
from rltrain.runtime.env import DistEnv
from rltrain.runtime.ledger import device_used, measure_cuda_context

log = logging.getLogger("rltrain.world")

RELOAD_ENV = "RLTRAIN_RELOAD_WORLD"


class WorldError(RuntimeError):
    """A world transition failed; the message names the phase, the generation and the rank."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def reload_setting(configured: bool, env_value: str | None) -> bool:
    """`world.reload`, unless RLTRAIN_RELOAD_WORLD says otherwise (any usual spelling of true or
    false, any case); what it did is logged. Another value is an error that names the spellings."""
    if env_value is None:
        return configured
    value = env_value.strip().lower()
    if value not in _TRUE + _FALSE:
        raise WorldError(
            f"{RELOAD_ENV}={env_value!r}: expected one of {', '.join(_TRUE)} (reload on) or {', '.join(_FALSE)} (off)"
        )
    wanted = value in _TRUE
    if wanted == configured:
        log.info("%s=%s: reload %s, as world.reload says", RELOAD_ENV, env_value, "on" if wanted else "off")
    else:
        log.info(
            "%s=%s overrides world.reload=%s: reload %s (%s)",
            RELOAD_ENV,
            env_value,
            str(configured).lower(),
            "on" if wanted else "off",
            "groups are torn down and rebuilt between phases"
            if wanted
            else "destroy/rebuild are no-ops, groups stay up",
        )
    return wanted


# A World's number among those this process made: with the torchrun attempt, part of every store
# prefix it uses, so a World opened after another was closed never reads the closed one's keys.
# Every rank makes its Worlds in the same order (SPMD), so the numbers agree across ranks.
_INSTANCES = itertools.count()


@dataclass(frozen=True)
class GroupSpec:
    """The arguments a group was created with, replayed verbatim on every rebuild."""

    index: int
    ranks: tuple[int, ...] | None  # None: all ranks
    backend: str | None  # None: the default group's backend
    timeout: timedelta | None
    pg_options: Any
    description: str


class GroupHandle:
    """A subgroup that survives destroy/rebuild. Use `handle.pg` wherever torch wants a group.

    `pg` is resolved at call time, so hold the handle, not the ProcessGroup: a ProcessGroup
    taken out of a handle is dead after the next destroy.
    """

    def __init__(self, world: World, spec: GroupSpec):
        self._world = world
        self.spec = spec
        self._pg: Any = None
        self._kept: kept_groups.Detached | None = None  # out of torch's registry while the world is down

    @property
    def description(self) -> str:
        return self.spec.description

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.spec.ranks if self.spec.ranks is not None else tuple(range(self._world.world_size))

    @property
    def is_member(self) -> bool:
        return self._world.rank in self.ranks

    @property
    def pg(self) -> dist.ProcessGroup:
        if self._pg is None:
            raise WorldError(
                f"rank {self._world.rank}: group {self.description!r} used while the world is down "
                f"(generation {self._world.generation}); call world.rebuild() first"
            )
        if not self.is_member:
            raise WorldError(f"rank {self._world.rank} is not a member of group {self.description!r} {self.ranks}")
        return self._pg

    def rank(self) -> int:
        """This process's rank inside the group (-1 if not a member)."""
        return self.ranks.index(self._world.rank) if self.is_member else -1

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        state = "up" if self._pg is not None else "down"
        return f"GroupHandle({self.description!r}, ranks={list(self.ranks)}, {state})"


@dataclass
class Transition:
    """Timings of one world transition, in seconds (also logged)."""

    kind: str  # "init", "destroy", "rebuild"
    generation: int
    groups: int
    seconds: dict[str, float] = field(default_factory=dict)


class World:
    """Default process group + Gloo bridge + group registry; see the module docstring."""

    def __init__(
        self,
        env: DistEnv | None = None,
        backend: str = "auto",
        timeout: timedelta | float = 600.0,
        reload: bool | str = True,
        async_destroy: bool = True,
        keep_cpu_groups: bool = True,
    ):
        self.env = env or DistEnv.from_environ()
        self.timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and not torch.cuda.is_available():
            raise WorldError("world.backend=nccl needs CUDA, and no CUDA device is visible; use gloo or auto")
        self.backend = backend
        # auto: tear down and rebuild only what holds accelerator memory (NCCL); a gloo world
        # frees nothing by going down, and its cycle would cost every step for nothing.
        self.reload = reload_setting(
            backend == "nccl" if reload == "auto" else bool(reload), os.environ.get(RELOAD_ENV)
        )
        self.async_destroy = async_destroy
        # Gloo subgroups hold no accelerator memory: kept across destroy/rebuild (kept_groups.py).
        self.keep_cpu_groups = keep_cpu_groups
        if keep_cpu_groups and (why := kept_groups.unsupported()) is not None:
            log.warning("gloo subgroups are torn down and rebuilt with the world: cannot keep them (%s)", why)
            self.keep_cpu_groups = False
        self.device = torch.device("cpu")
        # (bytes this process's CUDA context took, bytes in use on the device before it): the ledger's
        self.cuda_context: tuple[int | None, int | None] = (None, None)
        self.nccl_bytes = 0  # bytes the current generation's communicators took (memory ledger)
        if backend == "nccl":
            self.device = torch.device("cuda", self.env.local_rank)
            self.cuda_context = measure_cuda_context(self.device)  # first touch of the GPU: measured
            torch.cuda.set_device(self.device)

        self.instance = next(_INSTANCES)
        self._kept_names: set[str] = set()  # torch's names of the kept groups (every rank's, members or not)
        self.generation = -1
        self._groups: list[GroupHandle] = []
        self._destroyer: threading.Thread | None = None
        self._destroy_error: BaseException | None = None
        self.transitions: list[Transition] = []

        t0 = time.perf_counter()
        self._base_store = self._connect_store()
        t_store = time.perf_counter()
        try:
            self.bridge = Bridge(
                self._base_store,
                self.rank,
                self.world_size,
                self.timeout,
                name=f"w{self.instance}" if self.instance else "",
            )
        except BridgeError as e:
            raise WorldError(f"rank {self.rank}: world init failed at the Gloo bridge: {e}") from e
        t_bridge = time.perf_counter()
        self._start_generation(0, "init")
        self.transitions[-1].seconds.update(store=t_store - t0, bridge=t_bridge - t_store)

    @classmethod
    def from_config(cls, world_cfg: WorldConfig, env: DistEnv | None = None) -> World:
        return cls(
            env=env,
            backend=world_cfg.backend,
            timeout=world_cfg.timeout_s,
            reload=world_cfg.reload,
            async_destroy=world_cfg.async_destroy,
        )

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_up(self) -> bool:
        """Whether collectives may run: False from `destroy()` on, wherever its teardown is."""
        return self._destroyer is None and dist.is_initialized()

    @property
    def groups(self) -> list[GroupHandle]:
        return list(self._groups)

    def communicator_bytes(self) -> int:
        """Device bytes the current generation's NCCL communicators hold (measured at its build;
        0 once the world is down, and off GPU). A teardown still running in the background has
        not given them back yet: they count until it ends."""
        tearing_down = self._destroyer is not None and self._destroyer.is_alive()
        return self.nccl_bytes if self.is_up or tearing_down else 0

    def store_prefix(self, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        world = f"/w{self.instance}" if self.instance else ""
        return f"rltrain/world/{restart_attempt()}{world}/{g}"

    # ------------------------------------------------------------------ groups

    def new_group(
        self,
        ranks: list[int] | tuple[int, ...] | None = None,
        *,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        pg_options: Any = None,
        description: str | None = None,
    ) -> GroupHandle:
        """Create a subgroup now and on every rebuild. Collective: every rank calls it, same order."""
        self._require_up("new_group")
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        if ranks is not None:
            ranks = tuple(int(r) for r in ranks)
            bad = [r for r in ranks if not 0 <= r < self.world_size]
            if bad or len(set(ranks)) != len(ranks):
                raise WorldError(f"new_group ranks {list(ranks)}: expected distinct ranks in [0, {self.world_size})")
            # torch orders a group's ranks: group rank i is the i-th smallest global rank.
            ranks = tuple(sorted(ranks))
        spec = GroupSpec(
            index=len(self._groups),
            ranks=ranks,
            backend=backend,
            timeout=timeout,
            pg_options=pg_options,
            description=description or f"group{len(self._groups)}",
        )
        handle = GroupHandle(self, spec)
        handle._pg = self._create(spec, "new_group")
        self._groups.append(handle)
        self._prime([handle], "new_group")
        return handle

    def _create(self, spec: GroupSpec, phase: str) -> Any:
        name = None
        if self.keep_cpu_groups:
            # torch names groups by a counter that restarts with every generation; the kept groups
            # keep the names they were given (the same on every rank), so new ones go around them.
            kept_groups.skip_names(self._kept_names)
            name = kept_groups.next_name()
        try:
            pg = dist.new_group(
                ranks=list(spec.ranks) if spec.ranks is not None else None,
                timeout=spec.timeout or self.timeout,
                backend=spec.backend,
                pg_options=spec.pg_options,
                group_desc=spec.description,
            )
        except Exception as e:
            raise self._error(phase, f"creating group {spec.description!r} {spec.ranks}", e) from e
        if name is not None and self.keeps(spec):
            self._kept_names.add(name)
        return pg

    def keeps(self, spec: GroupSpec) -> bool:
        """Whether the group outlives the world's destroy: a gloo group (it holds no accelerator
        memory), when this torch lets it be kept. A group's backend decides, the same on every rank."""
        backend = spec.backend or self.backend
        return self.keep_cpu_groups and str(backend).lower() == "gloo"

    def _group_device(self, spec: GroupSpec | None) -> torch.device:
        backend = (spec.backend if spec is not None else None) or self.backend
        return self.device if "nccl" in str(backend) else torch.device("cpu")

    def _prime(self, handles: list[GroupHandle | None], phase: str) -> None:
        """One all_reduce per member group, in creation order, so communicators exist now."""
        results = []
        for h in handles:
            if h is not None and not h.is_member:
                continue
            pg = None if h is None else h.pg
            t = torch.ones(1, device=self._group_device(None if h is None else h.spec))
            try:
                dist.all_reduce(t, group=pg)
            except Exception as e:
                name = "default" if h is None else h.description
                raise self._error(phase, f"priming group {name!r}", e) from e
            results.append((h, t))
        for h, t in results:
            expected = self.world_size if h is None else h.size()
            if int(t.item()) != expected:
                name = "default" if h is None else h.description
                raise WorldError(
                    f"rank {self.rank}: world {phase} generation {self.generation}: group {name!r} "
                    f"all_reduce gave {int(t.item())}, expected {expected}"
                )

    # ------------------------------------------------------------------ transitions

    def destroy(self, block: bool | None = None) -> None:
        """Barrier on the bridge, then tear down the default group and every registered subgroup.

        With `block=False` (default: `world.async_destroy`) the teardown runs in a background
        thread; the world is unusable as soon as this returns, and `wait_destroyed()` joins it.
        """
        if not self.reload:
            log.debug("rank %d: world destroy skipped (reload off), generation %d stays up", self.rank, self.generation)
            return
        self._require_up("destroy")
        block = (not self.async_destroy) if block is None else block
        tr = Transition("destroy", self.generation, len(self._groups))
        t0 = time.perf_counter()
        try:
            self.bridge.barrier(phase=f"world destroy (generation {self.generation})")
        except BridgeError as e:
            raise self._error("destroy", "waiting for every rank at the bridge barrier", e) from e
        t1 = time.perf_counter()
        for h in self._groups:
            if self.keeps(h.spec) and h.is_member:
                h._kept = kept_groups.detach(h._pg)  # out of torch's registry: the teardown leaves it alone
            h._pg = None
        if block:
            self._teardown()
            self._raise_destroy_error()
        else:
            self._destroyer = threading.Thread(target=self._teardown, name="rltrain-world-destroy", daemon=True)
            self._destroyer.start()
        t2 = time.perf_counter()
        tr.seconds.update(barrier=t1 - t0, teardown=t2 - t1, critical_path=t2 - t0)
        self._record(tr, "async" if not block else "blocking")

    def _teardown(self) -> None:
        try:
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait_destroyed()
            self._destroy_error = e

    def wait_destroyed(self) -> float:
        """Join a background teardown (no-op if none); returns seconds waited."""
        t0 = time.perf_counter()
        if self._destroyer is not None:
            self._destroyer.join(self.timeout.total_seconds())
            if self._destroyer.is_alive():
                raise WorldError(
                    f"rank {self.rank}: world destroy of generation {self.generation} did not finish within "
                    f"{self.timeout.total_seconds():.0f}s"
                )
            self._destroyer = None
        self._raise_destroy_error()
        return time.perf_counter() - t0

    def _raise_destroy_error(self) -> None:
        if self._destroy_error is not None:
            e, self._destroy_error = self._destroy_error, None
            raise self._error("destroy", "tearing down process groups", e) from e

    def rebuild(self) -> None:
        """New default group on a fresh store prefix, then replay and prime every registered group."""
        if not self.reload:
            log.debug("rank %d: world rebuild skipped (reload off), generation %d is up", self.rank, self.generation)
            return
        waited = self.wait_destroyed()
        if dist.is_initialized():
            raise WorldError(f"rank {self.rank}: world rebuild called while generation {self.generation} is up")
        self._start_generation(self.generation + 1, "rebuild")
        self.transitions[-1].seconds["wait_destroyed"] = waited

    def _start_generation(self, generation: int, kind: str) -> None:
        tr = Transition(kind, generation, len(self._groups))
        self.generation = generation
        outside = self._outside_allocator()
        t0 = time.perf_counter()
        store = dist.PrefixStore(self.store_prefix(generation), self._base_store)
        try:
            dist.init_process_group(
                backend=self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=self.timeout,
                device_id=self.device if self.backend == "nccl" else None,
            )
        except Exception as e:
            raise self._error(kind, "initialising the default group", e) from e
        t1 = time.perf_counter()
        for h in self._groups:  # the same communicators, back in torch's registry
            if h._kept is not None:
                kept_groups.attach(h._kept)
                h._pg, h._kept = h._kept.pg, None
        fresh = []
        for h in self._groups:
            if self.keeps(h.spec) and kind != "init":
                if not h.is_member:
                    h._pg = dist.GroupMember.NON_GROUP_MEMBER
                continue
            h._pg = self._create(h.spec, kind)
            fresh.append(h)
        t2 = time.perf_counter()
        self._prime([None, *fresh], kind)
        t3 = time.perf_counter()
        try:
            self.bridge.barrier(phase=f"world {kind} (generation {generation})")
        except BridgeError as e:
            raise self._error(kind, "waiting for every rank at the bridge barrier", e) from e
        t4 = time.perf_counter()
        now = self._outside_allocator()
        if outside is not None and now is not None:
            # What the communicators took: device memory outside the allocator, before vs. after
            # (the memory ledger's "nccl"; the engine is idle while the world is built).
            self.nccl_bytes = max(now - outside, 0)
        tr.seconds.update(init=t1 - t0, groups=t2 - t1, prime=t3 - t2, barrier=t4 - t3, critical_path=t4 - t0)
        self._record(tr, f"{self.backend}, store prefix {self.store_prefix()}")

    def _outside_allocator(self) -> int | None:
        """Bytes in use on this rank's GPU that its caching allocator does not hold (None off GPU)."""
        if self.backend != "nccl" or self.device.type != "cuda":
            return None
        return device_used(self.device) - torch.cuda.memory_reserved(self.device)

    def close(self) -> None:
        """End of job: barrier, tear everything down (bridge last), collect garbage.

        Gloo groups still alive at interpreter exit can abort the process; closing in this
        order before exit avoids that.
        """
        try:
            if self._destroyer is not None:
                self.wait_destroyed()
            if not dist.is_initialized():
                for h in self._groups:  # kept groups, out of torch's registry while the world is down
                    if h._kept is not None:
                        h._kept.pg.shutdown()
                        h._kept = None
            elif dist.is_initialized():
                self.bridge.barrier(phase="close")
                for h in self._groups:
                    h._pg = None
                dist.destroy_process_group()
            self.bridge.barrier(phase="close")
        finally:
            self.bridge.close()
            self._groups.clear()
            gc.collect()

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()

    # ------------------------------------------------------------------ internals

    def _connect_store(self) -> dist.Store:
        """torchrun's store (per-attempt prefix included), or a private one for world size 1."""
        if not self.env.under_torchrun and self.env.world_size == 1 and self.env.master_port is None:
            return dist.HashStore()
        os.environ.setdefault("MASTER_ADDR", self.env.master_addr or "127.0.0.1")
        try:
            store, _, _ = next(
                dist.rendezvous("env://", rank=self.rank, world_size=self.world_size, timeout=self.timeout)
            )
        except Exception as e:
            raise WorldError(
                f"rank {self.rank}: could not reach the rendezvous store at "
                f"{self.env.master_addr}:{self.env.master_port} within {self.timeout.total_seconds():.0f}s: {e}"
            ) from e
        return store

    def _require_up(self, what: str) -> None:
        if not self.is_up:
            raise WorldError(
                f"rank {self.rank}: {what} needs the world up, but generation {self.generation} was destroyed; "
                "call world.rebuild() first"
            )

    def _error(self, phase: str, doing: str, cause: BaseException) -> WorldError:
        return WorldError(
            f"rank {self.rank}: world {phase} failed at generation {self.generation} while {doing} "
            f"(timeout {self.timeout.total_seconds():.0f}s; a rank that crashed or never arrived makes the "
            f"others fail like this — look for the first error among the ranks): {type(cause).__name__}: {cause}"
        )

    def _record(self, tr: Transition, detail: str) -> None:
        self.transitions.append(tr)
        parts = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in tr.seconds.items())
        # DEBUG: one line per transition is too chatty next to the progress bar (RLTRAIN_LOG_LEVEL=DEBUG shows it).
        log.debug(
            "rank %d: world %s generation %d (%d groups, %s): %s",
            self.rank,
            tr.kind,
            tr.generation,
            tr.groups,
            detail,
            parts,
        )
