"""The job's own sections: the run directory and seeds (run), the process world (world), the
model (model), the loop's shape (loop), checkpoints, releasing the trainer (release), the weight
sync (sync)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config.errors import ConfigError


@dataclass
class RunConfig:
    """Where a run writes its files and how it is seeded."""

    name: str = "rltrain"
    # Run directory = <dir>/<name>. Resolved config, logs and metrics go there.
    dir: str = "runs"
    seed: int = 0
    # Begin again at step 1 where the run directory has history (metrics, checkpoints): the old
    # files are kept beside, renamed *.before-<time>. Without it such a start is refused.
    start_over: bool = False

    def check(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name={self.name!r}: expected a non-empty name without '/'")


@dataclass
class WorldConfig:
    """The SPMD runtime: default process group, Gloo bridge, destroy/rebuild between phases."""

    # auto: nccl when CUDA is available, else gloo.
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Every distributed wait (store, bridge, collectives, rebuild) gives up after this long.
    timeout_s: float = 600.0
    # Tear the default group down between phases and rebuild it (frees NCCL memory). auto: with
    # the nccl backend only (a gloo world holds no accelerator memory: its cycle frees nothing).
    # The environment variable RLTRAIN_RELOAD_WORLD=0/1 overrides it without editing configs.
    reload: bool | Literal["auto"] = "auto"
    # Run the teardown in a background thread so it is off the step's critical path;
    # `World.wait_destroyed()` (and `rebuild()`) join it before memory is needed again.
    async_destroy: bool = True

    def check(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"world.timeout_s={self.timeout_s!r}: expected a positive number of seconds")


@dataclass
class ModelConfig:
    """The policy model: a local HF checkpoint directory (config.json + safetensors + tokenizer)."""

    path: str = ""
    # tiny-addition: if `path` does not exist, build a random tiny Qwen2 and the word-level
    # tokenizer of the synthetic addition task there (the quickstart; no downloads).
    # tiny-addition-moe: the same with a tiny Qwen3-MoE (4 experts, top 2) instead.
    # tiny-lookup: the same for the tool quickstart's task (rollout/synthetic.py).
    build: Literal["none", "tiny-addition", "tiny-addition-moe", "tiny-lookup"] = "none"
    build_hidden: int = 64  # size of the built model
    build_layers: int = 2

    def check(self) -> None:
        if not self.path:
            raise ConfigError("model.path is required: a local HF checkpoint directory")


@dataclass
class LoopConfig:
    steps: int = 100
    colocate: bool = True  # release engine memory while training, and trainer memory while rolling out
    # Params/grads/optimizer to host memory between train phases (GPU). auto: when colocated (the
    # engines need the memory); not colocated, the engines keep memory of their own and nothing
    # would use what the offload frees. On GPUs with the fsdp backend, auto moves nothing where
    # the last rollout left room for the whole state (less loop.offload_headroom_gib), else all of
    # it (the engines' KV pool is sized to the rollout: engine.max_total_tokens). true: all of it,
    # every step.
    # fit: move only what must move. The first step offloads all; then each put-away keeps on the
    # device what the last rollout left free, less loop.offload_headroom_gib (the optimizer state
    # leaves first, its copies beside the sync and the next forward). fsdp, colocated.
    offload_trainer: bool | Literal["auto", "fit"] = "auto"
    offload_headroom_gib: float = 4.0  # auto and fit: device memory left free at a rollout's end
    # Stop cleanly after this step (0: run all `steps`). The LR schedule still spans `steps`,
    # so a run stopped here and resumed is the same run (for time-limited allocations).
    stop_after: int = 0
    # Rollout ahead of training (one-step off-policy): 1 generates step t+1's samples while step
    # t trains, from the weights before step t (each sample one version behind the policy it
    # trains); 0 is the synchronous loop. Needs loop.colocate=false (the engines keep serving
    # while the trainer trains). Rollout correction (algo.rollout_is / rollout_rs) is on with it:
    # algo.rollout_is=token where none is set. k > 1 needs a loop.in_flight_update that does not
    # wait (the rollouts ahead then span the weight updates of the steps between).
    max_staleness: int = 0
    # What a weight update does to the rollout ahead still in flight (loop.max_staleness >= 1):
    # wait: the sync waits for it to finish (the engines never change weights under a request;
    #   every sample is of one version). The default: at k = 1 the rollout ahead started when
    #   training did, so the wait is only what generation takes beyond training, and no sample
    #   mixes versions.
    # continue (partial rollout): the engines are paused with mode abort, the update is made, and
    #   each cut sample goes on from its tokens (token-in: the prompt and what it had sampled)
    #   on the new weights; every token records the version that sampled it (a sample's version
    #   for the staleness bound is its oldest token's), the engine's log-probs of each token kept
    #   for the correction.
    # requeue: the cut samples are sampled again from their prompts on the new weights.
    in_flight_update: Literal["wait", "continue", "requeue"] = "wait"

    def check(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"loop.max_staleness={self.max_staleness}: expected 0 (synchronous) or more")
        if self.in_flight_update != "wait" and not self.max_staleness:
            raise ConfigError(
                f"loop.in_flight_update={self.in_flight_update}: nothing is in flight at a weight update of the "
                "synchronous loop (loop.max_staleness=0); set loop.max_staleness >= 1 or leave it at wait"
            )
        if self.max_staleness > 1 and self.in_flight_update == "wait":
            raise ConfigError(
                f"loop.max_staleness={self.max_staleness} with loop.in_flight_update=wait: each sync would wait for "
                "every rollout ahead, so none could be more than one version behind; set loop.in_flight_update="
                "continue (partial rollout) or requeue, or loop.max_staleness=1"
            )
        if self.offload_headroom_gib < 0:
            raise ConfigError(f"loop.offload_headroom_gib={self.offload_headroom_gib}: expected >= 0")
        if self.offload_trainer == "fit" and not self.colocate:
            raise ConfigError(
                "loop.offload_trainer=fit sizes what the trainer keeps beside colocated engines' rollout; with "
                "loop.colocate=false the engines have memory of their own: use loop.offload_trainer=false or true"
            )
        if self.max_staleness and self.colocate:
            raise ConfigError(
                f"loop.max_staleness={self.max_staleness} generates while the trainer trains: the engines must keep "
                "their memory, so set loop.colocate=false"
            )


@dataclass
class CheckpointConfig:
    """Sharded atomic checkpoints (torch.distributed.checkpoint + per-rank state + manifest)."""

    dir: str = ""  # empty: <run dir>/checkpoints
    interval: int = 0  # save every N steps (0: never, unless release.train=true with source=disk)
    keep_last: int = 3
    resume: str = "auto"  # auto: newest complete checkpoint if any; none; or a step_* directory

    def check(self) -> None:
        if self.interval < 0 or self.keep_last < 0:
            raise ConfigError("checkpoint.interval and checkpoint.keep_last must be >= 0")


@dataclass
class ReleaseConfig:
    """Release-train: drop the trainer entirely after each step's verified save, re-create it next step."""

    train: bool = False
    source: Literal["disk", "host"] = "disk"  # re-create from the checkpoint, or from a host-RAM snapshot


@dataclass
class SyncConfig:
    """How new weights reach the engines after each step (rltrain/sync/)."""

    # tensor: handles to one buffer per bucket (CUDA IPC on GPU, shared memory on CPU), colocated;
    # disk: HF safetensors per version; delta: XOR+zstd against the last version, applied next
    # to the engine before a disk load (for slow shared storage, not colocated); distributed:
    # broadcast over a weight-update group made through /init_weights_update_group.
    # auto: tensor where the engines are colocated with the trainer (nothing is written or copied
    # twice), disk where they are not (`Config.sync_transport` resolves it; the log says which).
    transport: Literal["auto", "disk", "tensor", "delta", "distributed"] = "auto"
    bucket_mb: int = 512
    delta_full_every: int = 10  # every K-th version is published in full
    # Verify every sync (sync/verify.py): the version each engine serves; the embedded engine's
    # checksum against the trainer's; SGLang's weights reset before the sync and every parameter
    # found rewritten after it (its /weights_checker), engines of one shard in agreement; the probe.
    verify: bool = True
    weights_dir: str = ""  # where weight versions are published (disk, delta); empty: <run dir>/weights
    keep_weight_versions: int = 2  # 0: keep every version
    # After every sync (with sync.verify) each engine scores the probe, this many tokens: the first
    # data prompt's first half of them and the engine's greedy continuation (made at start-up); its
    # log-probs must match the trainer's within bounds on the mean and the worst position
    # |difference| (nats), calibrated at start-up where engine and trainer hold model.path's weights
    # (sync/probe.py). probe_tolerance, probe_worst_tolerance > 0: those bounds instead. 0 tokens: no probe.
    probe_tokens: int = 32
    probe_tolerance: float = 0.0
    probe_worst_tolerance: float = 0.0
    # A warning when a rank's engine-vs-trainer log-prob gap of a step's rollout
    # (logp_diff_engine_trainer) exceeds this many times the median of its earlier steps: weights
    # the verification passed may still not be what the engine computes with. 0: no alarm.
    logp_gap_alarm: float = 3.0

    def check(self) -> None:
        if self.bucket_mb < 1 or self.delta_full_every < 1:
            raise ConfigError("sync.bucket_mb and sync.delta_full_every must be >= 1")
        if self.probe_tokens < 0 or self.probe_tokens == 1:
            raise ConfigError(f"sync.probe_tokens={self.probe_tokens}: expected 0 (no probe) or >= 2")
        for key in ("probe_tolerance", "probe_worst_tolerance", "logp_gap_alarm"):
            if not getattr(self, key) >= 0:  # (NaN too)
                raise ConfigError(f"sync.{key}={getattr(self, key)}: expected a number >= 0 (0: the default)")
        if 0 < self.logp_gap_alarm <= 1:
            raise ConfigError(
                f"sync.logp_gap_alarm={self.logp_gap_alarm}: expected 0 (off) or a factor > 1 over the gap's median"
            )
