"""Typed configuration: dataclasses, YAML files and dotted command-line overrides.

A config is a tree of dataclasses. `load_config(path, overrides)` reads YAML, applies
`key.sub=value` overrides on top, converts every leaf to its declared type and validates
the result. Every error names the key, the value seen, what was expected and, for typos,
the closest valid keys — before any expensive work starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message says which and what to do."""


# --------------------------------------------------------------------------- sections


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
class DataConfig:
    """Prompts: a jsonl/parquet file, a `datasets.save_to_disk` directory, or synthetic:addition or
    synthetic:lookup (written into the run directory)."""

    path: str = ""
    prompts_per_step: int = 32  # global batch of prompts per step, split across ranks
    max_prompt_tokens: int = 1024
    chat_template: bool = False
    # rltrain's field name -> the dataset's column, e.g. {prompt: question, answer: solution}
    fields: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if not self.path:
            raise ConfigError(
                "data.path is required: a .jsonl or .parquet file, a datasets save_to_disk directory, "
                "or synthetic:addition"
            )
        if self.path.startswith("synthetic:") and self.path not in ("synthetic:addition", "synthetic:lookup"):
            raise ConfigError(f"data.path={self.path!r}: the synthetic tasks are: synthetic:addition, synthetic:lookup")
        if self.prompts_per_step < 1:
            raise ConfigError(f"data.prompts_per_step={self.prompts_per_step}: expected >= 1")
        bad = {k: v for k, v in self.fields.items() if not isinstance(k, str) or not isinstance(v, str) or not v}
        if bad:
            raise ConfigError(
                f"data.fields {bad}: expected rltrain's field names mapped to the dataset's column names, e.g. "
                "{prompt: question, answer: solution}"
            )


@dataclass
class EvalConfig:
    """Evaluation during training on held-out prompts (rollout/evaluation.py): off while `path`
    is empty. Sampled greedily by default; pass@k for k = 1, 2, 4, ... up to n."""

    path: str = ""  # the formats of data.path (its data.fields too), or synthetic:addition
    every: int = 0  # evaluate after every this many steps (0: never after a step)
    before_train: bool = False  # and the weights the run starts from
    n: int = 1  # samples per prompt
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    max_prompts: int = 0  # the first this many of the file's prompts (0: all)

    def check(self) -> None:
        if self.every < 0 or self.n < 1 or self.max_prompts < 0 or self.max_new_tokens < 0:
            raise ConfigError(
                f"eval: every={self.every}, n={self.n}, max_prompts={self.max_prompts}, max_new_tokens="
                f"{self.max_new_tokens}: expected every, max_prompts, max_new_tokens >= 0 and n >= 1"
            )
        if self.path and not (self.every or self.before_train):
            raise ConfigError(
                f"eval.path={self.path!r} is set but never used: set eval.every (steps) or eval.before_train=true"
            )
        if not self.path and (self.every or self.before_train):
            raise ConfigError("eval.every / eval.before_train need eval.path: the held-out prompts to evaluate on")
        if self.path.startswith("synthetic:") and self.path != "synthetic:addition":
            raise ConfigError(f"eval.path={self.path!r}: the synthetic evaluation set is synthetic:addition")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"eval: temperature={self.temperature}, top_p={self.top_p}: expected >= 0 and (0, 1]")


@dataclass
class RolloutConfig:
    """Sampling on the engine."""

    n: int = 8  # samples per prompt (one group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Token ids that end a response besides the model's EOS (SGLang's stop_token_ids); the
    # stop token is part of the response, as EOS is.
    stop_token_ids: list[int] = field(default_factory=list)
    # Each step's requests carry sampling seeds derived from (run.seed, step, rank): a resumed
    # run samples what the uninterrupted run sampled (exactly so with engine.deterministic).
    # false: every sample still has its own seed, drawn from the rank's own generator (an
    # unseeded row would get SGLang's fixed seed 42 under engine.deterministic); a resumed run
    # then samples otherwise.
    seeded: bool = True
    # Multi-turn rollouts (rollout/env.py, rollout/multiturn.py): an environment per trajectory,
    # module:Class made with the data record; or `tools` (module:function each) for the built-in
    # tool environment (Qwen/Hermes <tool_call> JSON). Neither: one prompt, one response.
    env: str | None = None
    tools: list[str] = field(default_factory=list)
    max_turns: int = 8  # model turns per trajectory
    # Tokens after the first prompt (sampled and observations); 0: max_new_tokens x max_turns.
    max_trajectory_tokens: int = 0
    tool_timeout_s: float = 10.0  # a tool call that takes longer gives the model an error text
    # A turn cut at max_new_tokens ends its trajectory (finish reason length), or (true) goes to
    # the environment like any other turn.
    continue_after_length: bool = False

    @property
    def multi_turn(self) -> bool:
        return bool(self.env or self.tools)

    def check(self) -> None:
        if self.max_turns < 1 or self.max_trajectory_tokens < 0 or not self.tool_timeout_s > 0:
            raise ConfigError(
                f"rollout.max_turns={self.max_turns} (>= 1), rollout.max_trajectory_tokens="
                f"{self.max_trajectory_tokens} (>= 0) and rollout.tool_timeout_s={self.tool_timeout_s} (> 0)"
            )
        if self.n < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"rollout.n={self.n}, rollout.max_new_tokens={self.max_new_tokens}: both must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature}: RL needs sampling, expected > 0")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ConfigError(f"rollout.stop_token_ids: {bad[:5]} are not token ids (expected >= 0)")


@dataclass
class RewardConfig:
    # math, exact_match, format, or module:function (called as fn(response_text, record) -> float)
    function: str = "math"
    format_regex: str | None = None
    timeout_s: float = 10.0
    workers: int = 4
    pass_threshold: float = 1.0  # a sample "passes" when its reward is at least this


@dataclass
class AlgoConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = "grpo"
    norm_std: bool = True  # grpo only
    gamma: float = 1.0  # reinforce_plus_plus*
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_in: Literal["loss", "reward"] = "loss"
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    tis_cap: float | None = None  # truncated importance sampling cap: rollout_is=token at this threshold
    # Rollout correction against the engine's per-token log-probs (algo/losses.py's module doc;
    # verl's rollout_correction names). rollout_is: importance weights per token or per sequence,
    # truncated at rollout_is_threshold. rollout_rs: rejection (masked IS, IcePop) of a token, a
    # sequence, or a sequence by its geometric-mean ratio, outside [rollout_rs_threshold_lower,
    # rollout_rs_threshold] (null: rollout_is_threshold and its reciprocal). rollout_token_veto_threshold:
    # a sequence with a token ratio below it is rejected. Metrics: is_weight, is_truncated, rs_rejected.
    rollout_is: Literal["token", "sequence"] | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: Literal["token", "sequence", "geometric"] | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    # ppo: the clipped surrogate; cispo (MiniMax-M1): the clipped importance weight, without its
    # gradient, on a REINFORCE token loss (clip_eps_low/high bound the weight; >= 1 low: no floor).
    policy_loss: Literal["ppo", "cispo"] = "ppo"
    # token: a ratio per token (PPO); sequence: GSPO's length-normalised ratio per sequence.
    importance_level: Literal["token", "sequence"] = "token"
    # DAPO's overlong handling. overlong_filter: responses cut at rollout.max_new_tokens are kept
    # out of the loss. overlong_buffer > 0: the soft overlong penalty, a reward falling linearly
    # from 0 to -overlong_penalty over the last overlong_buffer tokens before the limit.
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage) are dropped and
    # more prompts sampled, at most dynamic_sampling_max_batches batches of data.prompts_per_step
    # per step (the first included), until data.prompts_per_step informative groups are kept.
    dynamic_sampling: bool = False
    dynamic_sampling_max_batches: int = 4
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch

    @property
    def rollout_rs_bounds(self) -> tuple[float, float]:
        """Rejection's (upper, lower) ratio bounds, defaults filled in."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return upper, lower

    @property
    def corrects_rollout(self) -> bool:
        """Whether the loss reads the engine's log-probs (importance weights, rejection or veto)."""
        return (
            self.tis_cap is not None
            or self.rollout_is is not None
            or self.rollout_rs is not None
            or self.rollout_token_veto_threshold is not None
        )

    @property
    def old_logp_from_training(self) -> bool:
        """One optimizer step per batch and no reference KL: the old log-probs equal the training
        forward's own log-probs (same weights, same tokens), so they are taken from it, detached,
        instead of from a separate pass (the loss and its gradients are the same)."""
        return self.ppo_epochs == 1 and self.mini_batches == 1 and self.kl_coef == 0

    def check(self) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"algo.dual_clip={self.dual_clip}: expected > 1 (or null to disable)")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"algo.tis_cap={self.tis_cap}: expected > 0 (or null to disable)")
        if self.tis_cap is not None and self.rollout_is is not None:
            raise ConfigError(
                f"algo.tis_cap={self.tis_cap} is rollout_is=token at that threshold, and algo.rollout_is="
                f"{self.rollout_is} is set too: keep one (rollout_is with rollout_is_threshold)"
            )
        if self.rollout_is_threshold <= 0:
            raise ConfigError(f"algo.rollout_is_threshold={self.rollout_is_threshold}: expected > 0")
        upper, lower = self.rollout_rs_bounds
        if self.rollout_rs is not None and not 0 < lower <= 1 <= upper:
            raise ConfigError(
                f"algo.rollout_rs keeps ratios in [{lower}, {upper}] (rollout_rs_threshold_lower, "
                "rollout_rs_threshold): expected 0 < lower <= 1 <= upper, so that a ratio of 1 (the engine "
                "agreeing with the trainer) is kept"
            )
        veto = self.rollout_token_veto_threshold
        if veto is not None and not 0 < veto < 1:
            raise ConfigError(f"algo.rollout_token_veto_threshold={veto}: expected a ratio in (0, 1), e.g. 1e-4")
        if self.ppo_epochs < 1 or self.mini_batches < 1:
            raise ConfigError("algo.ppo_epochs and algo.mini_batches must be >= 1")
        if self.policy_loss == "cispo" and self.dual_clip is not None:
            raise ConfigError(
                "algo.dual_clip caps PPO's clipped surrogate; algo.policy_loss=cispo has none (its weight is "
                "already clipped to [1 - clip_eps_low, 1 + clip_eps_high]): set algo.dual_clip=null"
            )
        if self.dynamic_sampling_max_batches < 1:
            raise ConfigError(f"algo.dynamic_sampling_max_batches={self.dynamic_sampling_max_batches}: expected >= 1")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError("algo.overlong_buffer and algo.overlong_penalty must be >= 0")


@dataclass
class TrainerConfig:
    # fsdp: transformers model + FSDP2; megatron: megatron-core GPTModel (needs megatron-core)
    backend: Literal["fsdp", "megatron"] = "fsdp"
    tensor_parallel_size: int = 1  # megatron only; must divide the world size and the KV heads
    distributed_optimizer: bool = False  # megatron only: shard optimizer state over data parallel
    expert_parallel_size: int = 1  # megatron MoE only: experts split over this many data-parallel ranks
    pipeline_parallel_size: int = 1  # megatron only; must divide the world size and the layers
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    lr: float = 1e-6
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    # > 0: padding-free. Micro-batches are cut by token count (at most this many real tokens, a
    # longer sequence alone), and each is one packed row with per-sequence position ids, so no
    # token attends across sequences and no padding is computed (fsdp backend). Replaces
    # micro_batch_size.
    max_tokens_per_micro_batch: int = 0
    # The fsdp backend's attention (transformers' attn_implementation). auto: transformers'
    # default (SDPA), and flex_attention for packed micro-batches on a GPU. Packed, sdpa and eager
    # compute a block-diagonal mask over the whole row, flex_attention skips the blocks across
    # sequences, flash_attention_2 (if installed) is varlen.
    attention: Literal["auto", "sdpa", "eager", "flex_attention", "flash_attention_2"] = "auto"
    gradient_checkpointing: bool = False
    # torch.compile each transformer block's forward (fsdp backend; regional compilation, dynamic
    # shapes, so packed micro-batches of any length reuse one graph): fuses the norms, rotary and
    # gated activations around the matmuls. The first step pays the compilation (tens of seconds).
    compile: bool = False
    # Deterministic kernels in every rank (torch.use_deterministic_algorithms) and a fixed cuBLAS
    # workspace (:4096:8) in every rank and its engine: with engine.deterministic, a GPU run
    # repeats bitwise (resume and release-train are compared so). Slower: some kernels lose their atomics.
    deterministic: bool = False

    def check(self) -> None:
        if self.lr <= 0 or self.micro_batch_size < 1 or self.grad_clip <= 0:
            raise ConfigError("trainer.lr, trainer.grad_clip must be > 0 and trainer.micro_batch_size >= 1")
        if min(self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size) < 1:
            raise ConfigError(
                "trainer.tensor_parallel_size, expert_parallel_size and pipeline_parallel_size must be >= 1"
            )
        if self.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"trainer.max_tokens_per_micro_batch={self.max_tokens_per_micro_batch}: expected >= 0")
        if self.max_tokens_per_micro_batch and self.backend == "megatron":
            raise ConfigError(
                "trainer.max_tokens_per_micro_batch (padding-free packed sequences) needs trainer.backend=fsdp: "
                "megatron-core takes packed sequences (THD, PackedSeqParams) only through Transformer Engine's "
                "attention, and rltrain builds megatron's local layer spec without it; use "
                "trainer.micro_batch_size with the megatron backend"
            )
        if self.backend == "fsdp" and (self.expert_parallel_size != 1 or self.pipeline_parallel_size != 1):
            raise ConfigError(
                "trainer.expert_parallel_size and pipeline_parallel_size > 1 need trainer.backend=megatron"
            )
        if self.backend == "fsdp" and self.distributed_optimizer:
            raise ConfigError(
                "trainer.distributed_optimizer is megatron's (trainer.backend=megatron); the fsdp "
                "trainer shards optimizer state with FSDP2 anyway"
            )
        if self.backend == "fsdp" and self.tensor_parallel_size != 1:
            raise ConfigError(
                "trainer.tensor_parallel_size > 1 needs trainer.backend=megatron (the fsdp "
                "trainer shards with FSDP2 over all ranks)"
            )
        if self.backend == "megatron" and self.compile:
            raise ConfigError(
                "trainer.compile compiles the fsdp backend's transformer blocks; megatron-core's GPTModel is "
                "not compiled by rltrain: set trainer.compile=false with trainer.backend=megatron"
            )
        if self.backend == "megatron" and self.gradient_checkpointing:
            raise ConfigError("trainer.gradient_checkpointing is not supported by trainer.backend=megatron yet")


@dataclass
class LoopConfig:
    steps: int = 100
    colocate: bool = True  # release engine memory while training, and trainer memory while rolling out
    offload_trainer: bool = True  # params/grads/optimizer to host memory between train phases (GPU)
    # Stop cleanly after this step (0: run all `steps`). The LR schedule still spans `steps`,
    # so a run stopped here and resumed is the same run (for time-limited allocations).
    stop_after: int = 0


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


@dataclass
class WandbConfig:
    """Weights & Biases (the `wandb` extra): off while `project` is empty. Offline runs write
    under the run directory (`wandb sync` uploads them later); a resumed run logs to the same
    W&B run (its id is kept in the run directory)."""

    project: str = ""
    name: str = ""  # the W&B run's name (default: run.name)
    mode: Literal["offline", "online"] = "offline"
    entity: str = ""

    def check(self) -> None:
        _installed("wandb", "metrics.wandb.project", self.project)


@dataclass
class MlflowConfig:
    """MLflow (the `mlflow` extra, mlflow-skinny): off while `tracking_uri` is empty. A server
    (`http://host:5000`, `databricks`) or a local `file:/path/mlruns` store; a resumed run logs
    to the same MLflow run (its id is kept in the run directory)."""

    tracking_uri: str = ""
    experiment: str = "rltrain"
    run_name: str = ""  # default: run.name

    def check(self) -> None:
        _installed("mlflow", "metrics.mlflow.tracking_uri", self.tracking_uri)


def _installed(package: str, key: str, value: str) -> None:
    """A tracker asked for (`key` set) needs its package, rltrain's extra of the same name."""
    if value and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f'{key}={value!r} but {package} is not installed: pip install "rltrain[{package}]" (or leave {key} empty)'
        )


@dataclass
class MetricsConfig:
    progress_bar: bool = True
    tensorboard: bool = False
    plot: bool = True  # write PNGs into the run directory at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class EmbeddedEngineConfig:
    """Keys only the embedded engine reads (`engine.backend: embedded`); SGLang takes its own
    through `engine.extra_args`."""

    max_batch_size: int = 256  # sequences decoded together
    # On CUDA: the decode step's transformer blocks torch.compiled (fused norms, rotary and
    # activations; start-up pays the compilation once).
    compile: bool = True
    # On CUDA: the weights, KV cache and CUDA graphs' memory through
    # torch_memory_saver (SGLang's --enable-memory-saver; SGLang on CUDA always has it), so they
    # are released and resumed at the same addresses and the captured graphs are kept, not
    # captured again at every rollout. auto: where torch_memory_saver is installed.
    memory_saver: bool | Literal["auto"] = "auto"
    # How the engine's process starts on the CPU. auto: forked from its rank, which has
    # imported torch and transformers already (no second import per engine), where a fork is
    # safe (engine/forked.py: no CUDA, no other thread in the rank), else a new interpreter;
    # exec: always a new interpreter. SGLang and engines on GPUs always start as new programs.
    start: Literal["auto", "exec"] = "auto"

    def check(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError(f"engine.embedded.max_batch_size={self.max_batch_size}: expected >= 1")


@dataclass
class EngineConfig:
    """The node's rollout engine: real SGLang or the embedded engine, same HTTP protocol."""

    # auto: SGLang where it is installed and a GPU is present, else the embedded engine.
    backend: Literal["auto", "embedded", "sglang"] = "auto"
    # Empty: model.path.
    model_path: str = ""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Each engine's GPUs (its TP size): the node's GPUs are split into LOCAL_WORLD_SIZE /
    # gpus_per_engine engines (engine/layout.py). 0: SGLang one engine over the node, the
    # embedded engine one per GPU.
    gpus_per_engine: int = 0
    # Share of GPU memory for weights + KV cache (SGLang; the embedded engine's paged path).
    mem_fraction_static: float = 0.8
    seed: int = 0
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    max_inflight: int = 32  # concurrent HTTP requests per rank
    prompts_per_request: int = 16
    retries: int = 3  # transport errors only
    # An engine process that dies during rollout is started again this many times per job (its
    # weights re-sent, the generations it lost retried); one more death stops the job with the
    # engine's log tail.
    max_restarts: int = 1
    extra_args: list[str] = field(default_factory=list)  # appended to the server command line
    # Batch-invariant rollouts: the embedded engine runs each request on its own (no batching
    # across requests), SGLang gets --enable-deterministic-inference. With per-step sampling
    # seeds this makes runs, and resumed runs, repeat exactly.
    deterministic: bool = False
    # Every endpoint of the engine then needs `Authorization: Bearer <api_key>` (servers bind to
    # loopback anyway). The embedded engine gets the key through its environment, SGLang through
    # its --api-key flag (visible in the process list: SGLang takes it no other way).
    api_key: str = ""
    # Release the engines' memory (weights, KV cache, CUDA graphs) while the trainer trains
    # (colocated). auto: on GPUs, where that device memory is what the trainer needs; an engine on
    # the CPU keeps its memory (what it would free is host memory, and release, resume and the
    # weights' rewrite would cost every step for it). SGLang releases on CUDA only.
    release: bool | Literal["auto"] = "auto"
    # Keep a host copy of the weights while they are released (SGLang's
    # --enable-weights-cpu-backup; the embedded engine's --weights-backup). Off: released weights
    # are discarded and come back as garbage until the sync rewrites every parameter — the
    # post-sync verification is what proves it did — and no step pays a device->host->device
    # copy of the whole model.
    weights_backup: bool = False
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)  # engine.embedded.*

    def check(self) -> None:
        if self.gpus_per_engine < 0:
            raise ConfigError(f"engine.gpus_per_engine={self.gpus_per_engine}: expected >= 1, or 0 for the default")
        for key in ("max_inflight", "prompts_per_request"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected >= 1")
        for key in ("retries", "max_restarts"):
            if getattr(self, key) < 0:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected >= 0")
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"engine.mem_fraction_static={self.mem_fraction_static}: expected a fraction in (0, 1)")
        for key in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"engine.{key}={getattr(self, key)}: expected a positive number of seconds")


@dataclass
class Config:
    """The whole run. Sections are added as the system grows; unknown keys are errors."""

    run: RunConfig = field(default_factory=RunConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def sync_transport(self) -> str:
        """sync.transport, with auto resolved: tensor when colocated, else disk."""
        if self.sync.transport != "auto":
            return self.sync.transport
        return "tensor" if self.loop.colocate else "disk"

    @property
    def engine_model_path(self) -> str:
        return self.engine.model_path or self.model.path

    def check(self) -> None:
        """Cross-section checks (each section checks itself first)."""
        if self.release.train and self.release.source == "host" and self.checkpoint.interval == 0:
            raise ConfigError(
                "release.train with release.source=host keeps the released trainer only in RAM: "
                "set checkpoint.interval >= 1 so it is also written to disk"
            )
        if self.sync_transport == "delta" and self.loop.colocate:
            raise ConfigError(
                "sync.transport=delta needs loop.colocate=false: a delta saves bytes on a slow shared "
                "disk, but colocated engines read the trainer's memory directly (use tensor)"
            )
        if self.sync_transport == "distributed" and self.engine.device == "cuda":
            raise ConfigError(DISTRIBUTED_COLOCATED)
        if (
            self.sync_transport == "distributed"
            and self.engine.backend == "embedded"
            and self.engine.gpus_per_engine > 1
        ):
            raise ConfigError(
                f"sync.transport=distributed with engine.backend=embedded and engine.gpus_per_engine="
                f"{self.engine.gpus_per_engine}: the embedded engine's TP ranks are one process, which cannot join "
                "the weight-update group as each of them; use sync.transport=tensor or disk (or engine.backend=sglang)"
            )
        if self.algo.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline") and self.rollout.n < 2:
            raise ConfigError(
                f"algo.advantage={self.algo.advantage} compares samples of a prompt: needs rollout.n >= 2, "
                f"got {self.rollout.n}"
            )
        if self.algo.dynamic_sampling and self.rollout.n < 2:
            raise ConfigError("algo.dynamic_sampling keeps groups whose samples' rewards differ: needs rollout.n >= 2")
        if self.algo.overlong_buffer >= self.rollout.max_new_tokens:
            raise ConfigError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} must be smaller than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens} (the penalty ramps over the last overlong_buffer tokens)"
            )
        if (
            self.algo.kl_in == "reward"
            and self.algo.kl_coef
            and self.algo.advantage not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
        ):
            raise ConfigError(
                "algo.kl_in=reward is the REINFORCE++ form; with "
                f"algo.advantage={self.algo.advantage} put the KL in the loss (algo.kl_in=loss)"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def weights_dir(self) -> Path:
        return Path(self.sync.weights_dir) if self.sync.weights_dir else self.run_dir / "weights"


# Engines always run on their ranks' GPUs (engine/layout.py), colocated or not.
DISTRIBUTED_COLOCATED = (
    "sync.transport=distributed on GPU: every engine runs on the GPUs of its own ranks (engine/layout.py; "
    "with loop.colocate=false too), so each trainer rank and the engine TP rank on its GPU would be one NCCL "
    "weight-update group's two ranks on one device, which NCCL refuses (a duplicate GPU): use "
    "sync.transport=tensor (CUDA IPC) or disk"
)


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (optional), apply `key.sub=value` overrides, convert and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r}: expected a mapping at the top level, got {type(loaded).__name__}"
            )
        raw = loaded
    for item in overrides:
        key, value = _parse_override(item)
        _set_dotted(raw, key, value)
    return build_config(raw)


def build_config(raw: dict[str, Any]) -> Config:
    """Build a validated `Config` from plain nested dicts (YAML-shaped)."""
    cfg = _build(Config, raw, prefix="")
    _check_tree(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# --------------------------------------------------------------------------- internals

# Keys that moved to another section: the old name is an error that names the new one.
MOVED = {
    "loop.weights_dir": "sync.weights_dir",
    "loop.keep_weight_versions": "sync.keep_weight_versions",
    "engine.tp_size": "engine.gpus_per_engine",
    **{f"engine.{k}": f"engine.embedded.{k}" for k in ("max_batch_size", "compile", "memory_saver", "start")},
}

# Values that were renamed: the old value is an error that names the new one.
RENAMED = {
    ("engine.backend", "native"): "embedded",
    ("trainer.backend", "native"): "fsdp",
}


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.sub=value (for example world.timeout_s=60)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: the key {key!r} is empty or has an empty part")
    # YAML parsing gives numbers, booleans, null and lists their natural types;
    # the declared field type converts further (and rejects what does not fit).
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _close(word: str, choices: list[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a section (mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    for k in unknown:
        moved = MOVED.get(f"{prefix}{k}")
        if moved:
            raise ConfigError(f"config key {prefix}{k} moved to {moved}: rename it in the config or override")
    if unknown:
        k = unknown[0]
        names = sorted(fields)
        raise ConfigError(
            f"unknown config key {prefix}{k!r}{_close(str(k), names)} (valid keys in {where}: {', '.join(names)})"
        )
    kwargs = {}
    for name in fields:
        if name not in raw:
            continue
        kwargs[name] = _convert(hints[name], raw[name], f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed:
            return value
        if isinstance(value, str) and (key, value) in RENAMED:
            new = RENAMED[key, value]
            raise ConfigError(f"{key}={value} was renamed {key}={new}: change it in the config or override")
        text = str(value)
        raise ConfigError(
            f"{key}={value!r} is not allowed; expected one of {', '.join(repr(a) for a in allowed)}"
            f"{_close(text, [str(a) for a in allowed])}"
        )
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise ConfigError(errors[0])
        choices = [_describe(arg) for arg in args if arg is not type(None)]
        raise ConfigError(f"{key}={value!r}: expected {', or '.join(choices)}")
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        items = [_convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r}: expected an integer") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r}: expected a number") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported field type {tp}")  # a programming error in a section


def _describe(tp: Any) -> str:
    """What a value of type `tp` looks like, for an error message."""
    if tp is bool:
        return "true or false"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _check_tree(node: Any) -> None:
    for f in dataclasses.fields(node):
        child = getattr(node, f.name)
        if dataclasses.is_dataclass(child):
            _check_tree(child)
    check = getattr(node, "check", None)
    if check is not None:
        check()
