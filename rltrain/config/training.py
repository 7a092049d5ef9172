"""What is trained and how: the RL algorithm's losses and advantages (algo), the trainer backend
and its parallelism, precision and micro-batches (trainer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rltrain.config.errors import ConfigError


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
