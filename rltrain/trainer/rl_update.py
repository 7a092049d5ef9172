"""The RL update both trainer backends share, as functions over a small backend interface.

A backend (`trainer/fsdp.py`, `trainer/megatron/trainer.py`) supplies the model's forward to
per-token log-probs, its gradient step and the group its data-parallel ranks form; everything
else of a step is here, the same for both:

    train_step      `ppo_epochs` passes over `mini_batches` mini-batches, one optimizer step each
    optimizer_step  the micro-batches of one mini-batch, forward + loss + backward, then the step
    micro_batches   this rank's micro-batches, plus idle ones up to the busiest rank's count
    normalizers     the loss normaliser over the whole mini-batch on every rank
    micro_loss      the policy loss (algo/losses.py) with entropy and KL terms, and its statistics
    step_stats      token-weighted statistics summed over the data-parallel ranks
    logprobs        old / reference log-probs of a batch, micro-batched, without gradients
    lr_factor       warmup and the constant or cosine schedule

Losses are normalised by the global token (or sequence) count of the mini-batch and gradients are
summed over ranks, so a step is exactly the full-batch gradient wherever the samples are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rltrain.algo.losses import PolicyLossConfig, aggregate, kl_penalty, policy_loss
from rltrain.batch import TrainBatch, idle_batch, with_probe_row
from rltrain.config import AlgoConfig, TrainerConfig
from rltrain.interfaces import PROBE_STATS, ProbeRide
from rltrain.kernels import logprobs_entropy

# The order of `micro_loss`'s statistics; engine_diff: |log-prob - engine's| summed over the loss
# tokens, where the training forward is the old log-probs' (`AlgoConfig.old_logp_from_training`).
# is_weight, is_truncated, rs_rejected: rollout correction's (token-weighted), where the config asks for it.
STATS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "clip_frac",
    "approx_kl_old",
    "engine_diff",
    "engine_tokens",
    "is_weight",
    "is_truncated",
    "rs_rejected",
)

LogProbs = tuple[torch.Tensor, torch.Tensor | None]  # [B, L] log-probs, and entropies when asked


class Backend(Protocol):
    """What the shared update needs of a trainer backend."""

    cfg: TrainerConfig
    algo: AlgoConfig
    device: torch.device
    pad_id: int
    temperature: float  # log-probs are taken at the sampling temperature

    @property
    def sharded(self) -> bool: ...  # whether the ranks run collectives together (micro-batch counts agreed)

    def forward_logp(self, model: Any, mb: TrainBatch, with_entropy: bool) -> LogProbs: ...

    # the group whose ranks hold different samples (None: the world)
    def data_group(self) -> dist.ProcessGroup | None: ...

    def zero_grad(self) -> None: ...

    def apply_gradients(self) -> float: ...  # clip and step (skipped on a non-finite norm); the norm


def loss_config(algo: AlgoConfig) -> PolicyLossConfig:
    return PolicyLossConfig(
        eps_low=algo.clip_eps_low,
        eps_high=algo.clip_eps_high,
        dual_clip=algo.dual_clip,
        tis_cap=algo.tis_cap,
        is_level=algo.rollout_is,
        is_threshold=algo.rollout_is_threshold,
        rs_level=algo.rollout_rs,
        rs_upper=algo.rollout_rs_bounds[0],
        rs_lower=algo.rollout_rs_bounds[1],
        veto=algo.rollout_token_veto_threshold,
        aggregation=algo.loss_agg,
        kind=algo.policy_loss,
        importance_level=algo.importance_level,
    )


def lr_factor(cfg: TrainerConfig, total_steps: int, step: int) -> float:
    warm = cfg.warmup_steps
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return 1.0
    total = max(total_steps - warm, 1)
    progress = min(max(step - warm, 0) / total, 1.0)
    floor = cfg.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


OptimizerStep = Callable[[TrainBatch, PolicyLossConfig, ProbeRide | None], dict[str, float]]


def train_step(
    backend: Backend, batch: TrainBatch, seed: int, optimizer_step: OptimizerStep, probe: ProbeRide | None = None
) -> dict[str, float]:
    """One RL step's statistics averaged over its optimizer steps, and `train_tokens_per_s`.
    `seed` orders the mini-batches (the caller's seed and step count); `probe` rides the first
    optimizer step (its statistics are returned as they are). The caller steps its learning-rate
    schedule and adds `lr`."""
    algo = backend.algo
    cfg = loss_config(algo)
    n = len(batch)
    g = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    t0 = time.perf_counter()
    tokens_trained = 0
    probed: dict[str, float] = {}
    for _ in range(algo.ppo_epochs):
        order = torch.randperm(n, generator=g) if algo.mini_batches > 1 else torch.arange(n)
        # An empty batch still runs every optimizer step: the rank joins the collectives.
        for chunk in order.tensor_split(algo.mini_batches):
            mini = batch.slice(chunk)
            stats = optimizer_step(mini, cfg, probe)
            if probe is not None:
                probe = None
                probed = {k: stats.pop(k) for k in PROBE_STATS if k in stats}
            tokens_trained += int(mini.attention_mask.sum())
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
    updates = algo.ppo_epochs * algo.mini_batches
    metrics = {k: v / updates for k, v in sums.items()}
    metrics["train_tokens_per_s"] = tokens_trained / max(time.perf_counter() - t0, 1e-9)
    return {**metrics, **probed}


def optimizer_step(
    backend: Backend,
    model: torch.nn.Module,
    mini: TrainBatch,
    loss_cfg: PolicyLossConfig,
    probe: ProbeRide | None = None,
) -> dict[str, float]:
    """One optimizer step over `mini`'s micro-batches. `probe`: one more row of the first
    micro-batch's forward, judged before the gradients are applied (`ProbeRide`)."""
    normalizer, total_tokens = normalizers(backend, mini)
    backend.zero_grad()
    # Summed on the device: a copy to the host per micro-batch would wait for its backward and
    # leave the GPU idle while the next forward is launched.
    acc = torch.zeros(len(STATS), dtype=torch.float64, device=backend.device)
    probe_logp = None
    for mb, _ in micro_batches(backend, mini):
        mb = mb.to(backend.device)
        if probe is not None and probe_logp is None:
            logp, ent, probe_logp = forward_with_probe(backend, model, mb, probe.tokens)
        else:
            logp, ent = backend.forward_logp(model, mb, with_entropy=True)
        assert ent is not None
        loss, stats = micro_loss(backend.algo, mb, logp, ent, loss_cfg, normalizer)
        loss.backward()
        acc += stats
    probed = probe.judge(probe_logp) if probe is not None else {}  # before the weights move
    grad_norm = backend.apply_gradients()
    backend.zero_grad()  # no gradients live between steps
    return {**step_stats(backend, acc, total_tokens, grad_norm), **probed}


def make_optimizer_state(opt: torch.optim.Optimizer | None) -> None:
    """A torch optimizer's state made now, before the first step's activations and gradients
    exist (a no-op once it has state; the fsdp trainer's AdamW). AdamW makes its moments at its
    first step, out of the blocks the backward just freed: sharing their segments, a state kept on
    the device strands them (the caching allocator cannot hand back a segment that still holds
    state), and the first put-away that meant to keep it (loop.offload_trainer=auto) moved it all
    out and back instead (`HostPark.all_if_stranded`). Made as the first step makes it: a step on
    zero gradients at learning rate 0 (the moments stay zeros; the weights bitwise as they are: the
    decay multiplies them by exactly 1 and the update adds 0), its count set back to 0, so that the
    first real step computes bitwise what it would have. On CUDA the caching allocator's free
    segments go back to the driver first: a forward that ran before (a separate old log-probs
    pass) left its activations' segments cached, and moments made in them strand what the step
    frees there (in a memory snapshot of test_gpu.py's case on an H100, 2026-12-06: 189 MiB
    stranded after step 1 without it, 37 MiB with it, in small segments of the weights and moments)."""
    if opt is None or opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return
    if any(p.is_cuda for p in params):
        torch.cuda.empty_cache()  # (the moments in segments of their own)
    lrs = [g["lr"] for g in opt.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None
    for state in opt.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def dropout_in(config: Any) -> list[str]:
    """The dropout rates above 0 a transformers config sets (a training forward then differs
    from a scoring one)."""
    return [
        k
        for k, v in vars(config).items()
        if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
    ]


def forward_with_probe(
    backend: Backend, model: torch.nn.Module, mb: TrainBatch, tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The training forward of `mb` with the probe as one more row: `mb`'s log-probs and
    entropies (as `forward_logp` gives them) and the probe's log-probs of tokens 1.., detached."""
    B, L = mb.tokens.shape
    logp, ent = backend.forward_logp(model, with_probe_row(mb, tokens, backend.pad_id), with_entropy=True)
    probe_logp = logp[B, 1 : len(tokens)].detach().float()
    return logp[:B, :L], None if ent is None else ent[:B, :L], probe_logp


def micro_batches(backend: Backend, batch: TrainBatch) -> Iterator[tuple[TrainBatch, bool]]:
    """(micro-batch, is real), in the batch's order: `trainer.micro_batch_size` rows each, or,
    padding-free, as many consecutive rows as fit `trainer.max_tokens_per_micro_batch` real
    tokens. Sharded, every rank must run as many forward/backward passes as the busiest one
    (each pass runs collectives): the others add idle passes."""
    bounds = micro_batch_bounds(batch, backend.cfg)
    mine = len(bounds)
    total = mine
    if backend.sharded:
        count = torch.tensor([mine], device=backend.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        total = int(count)
    for start, stop in bounds:
        yield batch.slice(slice(start, stop)), True
    for _ in range(total - mine):
        yield idle_batch(batch, backend.pad_id), False


def micro_batch_bounds(batch: TrainBatch, cfg: TrainerConfig) -> list[tuple[int, int]]:
    """(start, stop) rows of each micro-batch."""
    n = len(batch)
    budget = cfg.max_tokens_per_micro_batch
    if not budget:
        size = cfg.micro_batch_size
        return [(i, min(i + size, n)) for i in range(0, n, size)]
    bounds, start, used = [], 0, 0
    for i, length in enumerate(batch.attention_mask.sum(dim=1).tolist()):
        if i > start and used + length > budget:
            bounds.append((start, i))
            start, used = i, 0
        used += length
    if n:
        bounds.append((start, n))
    return bounds


def packed(mb: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-padded micro-batch as one row without padding: (tokens [1, N], position ids
    [1, N] starting at 0 in each sequence, the [B, L] mask of where each packed token came from).
    transformers keeps packed sequences apart by their position ids (no attention mask given:
    a block-diagonal causal mask, or varlen flash attention)."""
    valid = mb.attention_mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    return mb.tokens[valid][None], positions[valid][None], valid


def unpacked(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-token values of a packed row [1, N] (each the score of its position's token given the
    ones before it in its sequence) back in the [B, L] layout; 0 at padding and at each
    sequence's first position (nothing precedes it), as the padded path has."""
    out = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
    out[valid] = values[0]
    out[:, 0] = 0.0
    return out


def normalizers(backend: Backend, mini: TrainBatch) -> tuple[float, float]:
    """(loss normaliser, total loss tokens) over the whole mini-batch on every rank: the same
    loss everywhere as if the mini-batch were in one place."""
    counts = torch.tensor([float(mini.loss_mask.sum()), float(len(mini))], device=backend.device)
    if dist.is_initialized():
        dist.all_reduce(counts, group=backend.data_group())
    normalizer = counts[0].item() if backend.algo.loss_agg == "token-mean" else counts[1].item()
    return normalizer, max(counts[0].item(), 1.0)


def micro_loss(
    algo: AlgoConfig,
    mb: TrainBatch,
    logp: torch.Tensor,
    ent: torch.Tensor,
    loss_cfg: PolicyLossConfig,
    normalizer: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch and its token-weighted statistics (in `STATS` order). Without
    `mb.old_logp` the old log-probs are this forward's, detached (one optimizer step per batch:
    the same weights), and the distance to the engine's log-probs is measured here."""
    assert mb.advantages is not None
    old_logp = mb.old_logp if mb.old_logp is not None else logp.detach()
    pg, stats = policy_loss(logp, old_logp, mb.advantages, mb.loss_mask, loss_cfg, mb.rollout_logp, normalizer)
    loss = pg
    kl_sum = torch.zeros((), device=logp.device)
    if algo.entropy_coef:
        loss = loss - algo.entropy_coef * aggregate(ent, mb.loss_mask, algo.loss_agg, normalizer)
    if algo.kl_coef and mb.ref_logp is not None:
        kl = kl_penalty(logp, mb.ref_logp, algo.kl_estimator)  # computed once: loss term and metric
        if algo.kl_in == "loss":
            loss = loss + algo.kl_coef * aggregate(kl, mb.loss_mask, algo.loss_agg, normalizer)
        kl_sum = (kl.detach() * mb.loss_mask).sum()
    w = mb.loss_mask.sum()
    engine_diff = engine_tokens = zero = torch.zeros((), device=logp.device)
    if mb.old_logp is None and mb.rollout_logp is not None:
        engine_diff = ((logp.detach() - mb.rollout_logp).abs() * mb.loss_mask).sum()
        engine_tokens = w
    acc = torch.stack(
        [
            loss.detach(),
            pg.detach(),
            kl_sum,
            (ent.detach() * mb.loss_mask).sum(),
            stats["clip_frac"].detach() * w,
            stats["approx_kl_old"].detach() * w,
            engine_diff,
            engine_tokens,
            *(stats[k].detach() * w if k in stats else zero for k in ("is_weight", "is_truncated", "rs_rejected")),
        ]
    ).double()
    return loss, acc


def step_stats(backend: Backend, acc: torch.Tensor, total_tokens: float, grad_norm: float) -> dict[str, float]:
    """Token-weighted statistics summed over the data-parallel ranks."""
    acc = acc.to(device=backend.device, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(acc, group=backend.data_group())
    loss_sum, pg_sum, kl, ent, clip, akl, engine_diff, engine_tokens, is_weight, is_truncated, rejected = acc.tolist()
    out = {
        "loss": loss_sum,
        "pg_loss": pg_sum,
        "kl": kl / total_tokens,
        "entropy": ent / total_tokens,
        "clip_frac": clip / total_tokens,
        "approx_kl_old": akl / total_tokens,
        "grad_norm": float(grad_norm),
    }
    if engine_tokens:
        out["logp_diff_engine_trainer"] = engine_diff / engine_tokens
    if backend.algo.corrects_rollout:
        out.update(
            is_weight=is_weight / total_tokens,
            is_truncated=is_truncated / total_tokens,
            rs_rejected=rejected / total_tokens,
        )
    return out


@torch.no_grad()
def logprobs(
    backend: Backend, model: torch.nn.Module, batch: TrainBatch, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [B, L] of `model` on `batch`, on the host. A collective
    when sharded (every rank calls it, with however many samples it has). `temperature`: instead
    of the sampling temperature (1.0: the engine's untempered scores of a probe)."""
    L = batch.tokens.shape[1]
    empty = torch.zeros(0, L, device=backend.device)
    outs, ents = [empty], [empty]
    sampling = backend.temperature
    backend.temperature = sampling if temperature is None else temperature
    try:
        for mb, real in micro_batches(backend, batch):
            lp, ent = backend.forward_logp(model, mb.to(backend.device), with_entropy=True)
            if real:
                assert ent is not None
                outs.append(lp.float())
                ents.append(ent.float())
    finally:
        backend.temperature = sampling
    return torch.cat(outs).cpu(), torch.cat(ents).cpu()  # one copy to the host, after the last pass


def logp_from_logits(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool, **vocab: Any
) -> LogProbs:
    """[B, L] log-probs of `tokens` under next-token `logits` [B, L, V] (0 at position 0), by
    rltrain.kernels (fused on CUDA: no float32 copy or log-softmax of the logits). `vocab`: the
    vocabulary-parallel arguments of `logprobs_entropy` (megatron, TP-sharded logits)."""
    # Every position, the last with a dummy target, so the logits stay one contiguous view
    # (slicing off the last position would copy them); that position is dropped after.
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    logp, ent = logprobs_entropy(logits, targets, temperature, **vocab)
    logp = torch.nn.functional.pad(logp[:, :-1], (1, 0))
    return logp, torch.nn.functional.pad(ent[:, :-1], (1, 0)) if with_entropy else None
