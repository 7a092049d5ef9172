"""The contracts between rltrain's components, as `typing.Protocol`s.

Each protocol names exactly the members its callers use — the loop, the sync, the checkpointer
and the memory ledger — and nothing else; the classes behind them are checked against them by
the type checker where `setup.py` wires them together:

    World       runtime.world.World                 the reloadable world, its bridge and groups
    Trainer     trainer.fsdp.FSDPTrainer,           the policy: create, train, offload/onload,
                trainer.megatron.trainer.            release and re-create, export weights,
                MegatronTrainer                      checkpoint state
    NodeEngine  engine.launcher.NodeEngine          this rank's engine (one of its node's), in the
                                                    loop's verbs, and the client it generates through
    Transport   sync/transport.py                   one way of moving weights (sync only)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from rltrain.batch import TrainBatch
from rltrain.generation import Completion, SamplingParams
from rltrain.runtime.bridge import Bridge
from rltrain.runtime.env import DistEnv
from rltrain.runtime.ledger import HeldTensors

# (checkpoint name, source name in the trainer, full shape, dtype) of one weight
WeightSpecRow = tuple[str, str, torch.Size, torch.dtype]
# Which ranks need which weights of an export (global rank, checkpoint name -> needed): given when
# the sync routes experts inside an engine, so each trainer rank is handed only its TP rank's
# payload (`Trainer.export_weights`); None: every rank needs every weight.
Needs = Callable[[int, str], bool]
# One rank's shard of a released trainer, in host memory (trainer-specific layout)
Snapshot = dict[str, Any]


@dataclass(frozen=True)
class ProbeRide:
    """The last sync's probe (sync/probe.py), scored for the trainer as one more row of the next
    training step's first micro-batch instead of by a forward of its own in the sync: the row
    takes no part in the loss, and `judge` (a collective over the bridge, every rank) gets the
    row's log-probs of tokens 1.. at temperature 1 (None where this rank ran no micro-batch) before
    the step's first optimizer step, raises if an engine scored it otherwise, and returns the
    probe's statistics for the step's metrics."""

    tokens: list[int]
    judge: Callable[[torch.Tensor | None], dict[str, float]]


PROBE_STATS = ("sync_probe_diff", "sync_probe_worst")  # the probe's figures in a metrics row (mean, worst)


class Group(Protocol):
    """A subgroup that survives the world's destroy/rebuild (`GroupHandle`)."""

    @property
    def pg(self) -> Any: ...  # torch's ProcessGroup of the current generation

    def rank(self) -> int: ...

    def size(self) -> int: ...


class World(Protocol):
    """The surface of `runtime.world.World` its callers use."""

    env: DistEnv
    bridge: Bridge
    device: torch.device
    backend: str  # of the default group: nccl or gloo
    reload: bool  # whether destroy/rebuild tear the default group down (world.reload, resolved)
    generation: int
    nccl_bytes: int
    cuda_context: tuple[int | None, int | None]

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_up(self) -> bool: ...

    def new_group(
        self,
        ranks: list[int] | tuple[int, ...] | None = None,
        *,
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        pg_options: Any = None,
        description: str | None = None,
    ) -> Group: ...

    def destroy(self, block: bool | None = None) -> None: ...

    def wait_destroyed(self) -> float: ...

    def rebuild(self) -> None: ...

    def close(self) -> None: ...

    def communicator_bytes(self) -> int: ...


class Trainer(Protocol):
    """The policy being trained, as the loop, the sync, checkpoints and the ledger use it."""

    device: torch.device
    model_path: str
    pad_id: int  # the tokenizer's padding token (batches and idle passes are padded with it)
    timings: dict[str, float]  # seconds of the parts of the last offload / onload (benchmarks)

    @property
    def released(self) -> bool: ...

    @property
    def sharded(self) -> bool: ...  # whether a forward is a collective (every rank must run it)

    # lifecycle (the loop)
    def create(self, load_weights: bool = True) -> None: ...

    def onload(self) -> None: ...

    # keep: bytes of the state that may stay on the device (None: none; loop.offload_trainer=fit)
    def offload(self, keep: int | None = None) -> None: ...

    # after the optimizer step: begin the offload that `offload` finishes (copies beside the sync)
    def stage_offload(self, keep: int | None = None) -> None: ...

    def trim(self) -> None: ...

    def release(self) -> None: ...

    def snapshot(self) -> Snapshot: ...

    def restore_snapshot(self, snap: Snapshot) -> None: ...

    # the RL update (the loop)
    def logprobs(
        self, batch: TrainBatch, reference: bool = False, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # `probe`: the last sync's probe rides the step's first micro-batch (where `rides_probe`)
    def train_step(self, batch: TrainBatch, probe: ProbeRide | None = None) -> dict[str, float]: ...

    # Whether a training forward gives the probe's log-probs as a forward of its own would: at
    # temperature 1, no dropout, and a micro-batch whose rows do not interact (not pipelined)
    @property
    def rides_probe(self) -> bool: ...

    def data_group(self) -> Any: ...  # the group whose ranks hold different samples (None: the world)

    # weights (the sync)
    def weight_specs(self) -> list[WeightSpecRow]: ...

    # A collective: every rank iterates it with the same `names`. With `needs`, each rank yields
    # only what it needs, and a weight held by one rank is moved only to the ranks that need it.
    def export_weights(
        self, names: list[str] | None = None, needs: Needs | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    # A context in which export_weights and logprobs share one gathering of the weights, where
    # the trainer's sharding allows it (a sync exports every weight, then scores its probe).
    def gathered(self) -> AbstractContextManager[None]: ...

    # checkpoints
    def distributed_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def load_distributed_state_dict(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None: ...

    def host_state(self) -> dict[str, Any]: ...

    def load_host_state(self, state: dict[str, Any]) -> None: ...

    # the memory ledger
    def held_tensors(self) -> HeldTensors: ...


class RolloutClient(Protocol):
    """What the rollout asks of a node's engine client (`engine.client.EngineClient`)."""

    def generate(
        self,
        input_ids: list[list[int]],
        params: SamplingParams,
        return_logprob: bool = True,
        positions: list[int] | None = None,
    ) -> list[Completion]: ...


class NodeEngine(Protocol):
    """This rank's engine as the loop uses it (`engine.launcher.NodeEngine`; `engine/layout.py`
    says which of its node's engines): the phase verbs are collectives over the bridge (each
    engine's leader talks to it); the client is what this rank generates through."""

    url: str

    @property
    def client(self) -> RolloutClient: ...

    def release_memory(self) -> None: ...

    def resume_weights(self) -> None: ...

    def resume_kv(self, room: bool = False) -> None: ...

    def recover(self) -> bool: ...

    def pause_generation(self) -> None: ...

    def continue_generation(self) -> None: ...

    def weight_version(self) -> str | None: ...

    def memory_report(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...
