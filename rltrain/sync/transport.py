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
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from rltrain.config import SyncConfig
from rltrain.engine.client import EngineClient, EngineError
from rltrain.interfaces import World
from rltrain.runtime.bridge import Bridge
from rltrain.sync.plan import Bucket, SyncPlan

Named = list[tuple[str, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class EngineCaps:
    """What every engine of this node can do, asked once (`probe`): the weakest engine decides."""

    dtype: torch.dtype | None = None  # of the engine's weights, as its checksum report says
    checksums: bool = False  # it reports weight checksums
    synchronous: bool = False  # its update requests answer only after the copies out of the sender's buffers
    slots: int = 0  # buffers it keeps by slot number within a weight-update session (bucket.py)
    verifies_files: bool = False  # it checks a disk version's files against the version's manifest
    weights_checker: bool = False  # it answers SGLang's /weights_checker (per-TP-rank sha256 of its parameters)
    # Its tensor updates open and close the weight-update session themselves, and a session's end
    # scores a probe sequence (the embedded engine's "weight_update_sessions": "inline").
    inline_sessions: bool = False


def probe(clients: list[EngineClient]) -> EngineCaps:
    """The capabilities all of `clients` share (SGLang reports none of the embedded engine's)."""
    caps = [_probe_one(c) for c in clients]
    if not caps:
        return EngineCaps()
    return EngineCaps(
        dtype=caps[0].dtype,
        checksums=all(c.checksums for c in caps),
        synchronous=all(c.synchronous for c in caps),
        slots=min(c.slots for c in caps),
        verifies_files=all(c.verifies_files for c in caps),
        weights_checker=all(c.weights_checker for c in caps),
        inline_sessions=all(c.inline_sessions for c in caps),
    )


def _probe_one(client: EngineClient) -> EngineCaps:
    try:
        info = client.server_info()
    except (EngineError, ValueError, TypeError):
        info = {}
    synchronous = info.get("weight_updates") == "synchronous"
    verifies = info.get("weight_files") == "verified"
    slots = info.get("weight_buffer_slots", 0) if synchronous else 0
    slots = slots if isinstance(slots, int) else 0
    try:
        rep = client.weights_checksum()
    except (EngineError, ValueError, TypeError):
        rep = None
    checker = not synchronous and _has_weights_checker(client)  # SGLang's; the embedded engine has its own
    inline = info.get("weight_update_sessions") == "inline"
    if not isinstance(rep, dict) or "dtype" not in rep:
        return EngineCaps(None, False, synchronous, slots, verifies, checker, inline)
    return EngineCaps(getattr(torch, rep["dtype"]), True, synchronous, slots, verifies, checker, inline)


def _has_weights_checker(client: EngineClient) -> bool:
    """Whether the engine serves /weights_checker. An engine whose weights are released at start-up
    (colocated SGLang on a GPU) answers it with an error: it has it, and its digests are read after
    each sync, when its weights are back. Only a missing endpoint (404/405) or no answer means no."""
    try:
        return bool(client.weights_checker())
    except EngineError as e:
        return e.status is not None and e.status not in (404, 405)
    except (ValueError, TypeError):
        return False


@dataclasses.dataclass(frozen=True)
class SyncContext:
    """Everything a transport is built from."""

    cfg: SyncConfig
    world: World
    receivers: list[EngineClient]  # this rank's engines, by EP rank; the sender talks to them
    plan: SyncPlan
    caps: EngineCaps  # (the sender's probe; defaults on other ranks)
    device: torch.device  # the trainer's
    model_path: str  # the trainer's model: config files of a published version
    weights_dir: Path
    request_timeout_s: float
    sender: bool = True  # this rank talks to `receivers` (its engine's leader)
    tp_rank: int = 0  # this rank's TP rank in its engine
    tp_size: int = 1  # its engine's TP size
    tp_group: Bridge | None = None  # the engine's ranks, in TP order (tp_size > 1)
    engine_name: str = "engine"
    # A sequence the engines score as their weight-update session ends, where they can
    # (`caps.inline_sessions`; engines that keep their memory through the sync): the sync's
    # probe without a request of its own. Empty: none.
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
    `timings["gather"]`."""

    def __init__(self, plan: SyncPlan, gather: Callable[[list[str] | None], Iterator[tuple[str, torch.Tensor]]]):
        self.plan, self.gather = plan, gather

    def buckets(self, timings: dict[str, float]) -> Iterator[tuple[int, Bucket, Named]]:
        for i, bucket in enumerate(self.plan.buckets):
            t0 = time.perf_counter()
            named = list(self.gather(bucket.names))
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
        probe = list(ctx.probe) if ctx.caps.inline_sessions and ctx.probe else None
        return {"checksum": ctx.caps.checksums and ctx.cfg.verify, "probe": probe}

    def keep(self, receiver: int, answer: dict[str, Any], closed: bool = False) -> None:
        if closed:
            self.closed.add(receiver)
        rep = answer.get("weights_checksum")
        if isinstance(rep, dict):
            self.reports[receiver] = rep
        probe = answer.get("probe_logprobs", answer.get("probe_error"))
        if isinstance(probe, (list, str)):
            self.probes[receiver] = probe


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
        delivered; raises OSError/RuntimeError/ValueError on failure (the caller agrees)."""
        ...

    def engine_restarted(self) -> None:
        """This node's engine was started again: drop what pointed at the dead one."""
        ...

    def close(self) -> None: ...
