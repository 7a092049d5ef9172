"""What a transport is given and what it must do: the contract between `WeightSync` and the
files `tensor.py`, `distributed.py` and `disk.py`.

`WeightSync` owns what every transport shares — the plan, the stream of the trainer's tensors
(a collective: every rank gathers every bucket), the verification after the load and the
agreement of all ranks on errors. A transport only moves one version's tensors to this rank's
engines (`receivers`), by its own means: each engine's leader rank (`sender`) talks to it; the
engine's other TP ranks help where the transport needs them (tensor: each builds its TP rank's
payload on its own GPU) and otherwise only join the gathers. It is built once per run from a
`SyncContext`, and every rank calls `send`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from rltrain.config import SyncConfig
from rltrain.engine.client import EngineCapabilities, EngineClient, EngineError
from rltrain.interfaces import World
from rltrain.runtime.bridge import Bridge
from rltrain.sync.plan import Bucket, SyncPlan

Named = list[tuple[str, torch.Tensor]]

log = logging.getLogger("rltrain.sync")


@dataclasses.dataclass(frozen=True)
class SyncContext:
    """Everything a transport is built from."""

    cfg: SyncConfig
    world: World
    receivers: list[EngineClient]  # this rank's engines, by EP rank; the sender talks to them
    plan: SyncPlan
    caps: EngineCapabilities  # what the engines can do (the leader asks, its TP ranks share it; else defaults)
    device: torch.device  # the trainer's
    model_path: str  # the trainer's model: config files of a published version
    weights_dir: Path
    request_timeout_s: float
    sender: bool = True  # this rank talks to `receivers` (its engine's leader)
    tp_rank: int = 0  # this rank's TP rank in its engine
    tp_size: int = 1  # its engine's TP size
    tp_group: Bridge | None = None  # the engine's ranks, in TP order (tp_size > 1)
    engine_name: str = "engine"
    # What the engines report as their weight-update session ends (`SessionEnds`): their
    # checksum (`verify.Checks.checksums`), and a sequence they score, the sync's probe without
    # a request of its own (`ProbeMoment.SESSION_END`; empty: none).
    checksums: bool = False
    probe: tuple[int, ...] = ()

    @property
    def node_leader(self) -> bool:
        """Does what is done once per node (disk: verify or rebuild the version)."""
        return self.world.env.is_node_leader


class WeightStream:
    """The trainer's tensors for one push, in checkpoint names: a collective, so every rank
    iterates what it is handed to the end (also after its own failure), in the same order.
    `gather(names)` is the trainer's export (the leader checksums each tensor as it passes);
    `buckets(timings)` walks the plan's buckets, one gather each, adding the gathers' seconds to
    `timings["gather"]`. A gather that fails on this rank does not end the walk: its bucket
    comes as None, the first such error is kept in `failure` (its traceback logged here), and the
    next buckets are gathered still, as the other ranks go on. (Where the export is itself a
    collective, one that fails part-way through a bucket leaves the other ranks in that
    collective until the world's timeout: nothing here can finish it for them.)"""

    def __init__(self, plan: SyncPlan, gather: Callable[[list[str] | None], Iterator[tuple[str, torch.Tensor]]]):
        self.plan, self.gather = plan, gather
        self.failure: str | None = None

    def buckets(self, timings: dict[str, float]) -> Iterator[tuple[int, Bucket, Named | None]]:
        for i, bucket in enumerate(self.plan.buckets):
            t0 = time.perf_counter()
            named: Named | None = None
            try:
                named = list(self.gather(bucket.names))
            except Exception as e:  # noqa: BLE001 - kept for the transport to report, after every gather
                if self.failure is None:
                    self.failure = f"gathering bucket {i} of the trainer's weights failed: {failure_text(e)}"
                    log.error("%s", self.failure, exc_info=e)
            timings["gather"] = timings.get("gather", 0.0) + time.perf_counter() - t0
            yield i, bucket, named


class SessionEnds:
    """What the engines reported as their weight-update sessions ended, last send, by receiver:
    the checksum report (where the engines report checksums and syncs are verified) and the
    probe's log-probs or the engine's error text (`SyncContext.probe`): the verification reads
    them instead of asking again, one request fewer each."""

    def __init__(self) -> None:
        self.reports: dict[int, dict[str, Any]] = {}
        self.probes: dict[int, list[float] | str] = {}
        self.closed: set[int] = set()  # receivers whose session an update request closed (inline)

    @staticmethod
    def asked(ctx: SyncContext) -> dict[str, Any]:
        """What a session's end asks these engines for (`checksum`, `probe` of the client's calls)."""
        return {"checksum": ctx.checksums, "probe": list(ctx.probe) or None}

    def keep(self, receiver: int, answer: dict[str, Any], closed: bool = False) -> None:
        if closed:
            self.closed.add(receiver)
        rep = answer.get("weights_checksum")
        if isinstance(rep, dict):
            self.reports[receiver] = rep
        probe = answer.get("probe_logprobs", answer.get("probe_error"))
        if isinstance(probe, (list, str)):
            self.probes[receiver] = probe


def failure_text(e: BaseException) -> str:
    """An error as a failed push reports it on every rank: the engine's, the filesystem's and a bad
    value's in their own words (they say what failed), any other with its type (an out-of-memory,
    a bug)."""
    return str(e) if isinstance(e, (EngineError, OSError, ValueError)) else f"{type(e).__name__}: {e}"


def end_session(ctx: SyncContext, receiver: int, ends: SessionEnds) -> None:
    """End receiver `receiver`'s weight-update session, keeping what it reports in `ends`."""
    ends.keep(receiver, ctx.receivers[receiver].end_weight_update(**SessionEnds.asked(ctx)))


class Transport(Protocol):
    """One way of moving a weight version to this node's engines."""

    timings: dict[str, float]  # seconds per part of the last send (benchmarks)
    # What the engines reported as their sessions ended, last send (empty: no sessions).
    ends: SessionEnds

    def send(self, version: str, weights: WeightStream) -> int:
        """Deliver every planned tensor to the engines that own it, as `version` (the last
        tensor an engine gets carries the version). Collective. Returns the bytes this rank
        delivered; raises OSError/RuntimeError/ValueError on failure (the caller agrees). Any
        error on a rank is kept, not raised, until this rank has joined every collective of the
        push to the end (the stream's gathers and the transport's own, which carry it to the
        ranks that need to know): a rank never leaves another waiting in a collective."""
        ...

    def engine_restarted(self) -> None:
        """This node's engine was started again: drop what pointed at the dead one."""
        ...

    def close(self) -> None: ...
