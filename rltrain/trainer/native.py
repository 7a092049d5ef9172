"""The torch-native trainer: a transformers causal LM, AdamW, data parallel by gradient all-reduce.

Data parallelism. Every rank holds the full model and trains on its own samples; after the
backward passes of a mini-batch, gradients are summed across ranks with one all_reduce per
dtype over the world's *current* default group. Because the loss is normalised by the global
token (or sequence) count of the mini-batch, the summed gradient is exactly the full-batch
gradient. Holding no process group (unlike DDP or FSDP, which keep the group they were built
with) is what lets the world be destroyed and rebuilt under the trainer between steps.
This is the data-parallel mode on CPU (gloo) and, for now, on GPU too (NCCL).

Batch layout. All per-token tensors are [B, L] over the full sequence (prompt + response, right
padded): `tokens`, `attention_mask`, `loss_mask` (1 on response tokens), `advantages`,
`old_logp`, `ref_logp`, `rollout_logp`. `logp[:, t]` is the log-prob of `tokens[:, t]` given the
tokens before it (position 0 has none and is never in the loss mask).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rltrain.algo.losses import PolicyLossConfig, aggregate, kl_penalty, policy_loss
from rltrain.runtime.memory import free_cuda_caches, trim_host_heap

log = logging.getLogger("rltrain.trainer")


@dataclass
class TrainBatch:
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    rollout_logp: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def slice(self, idx: slice | torch.Tensor) -> "TrainBatch":
        return TrainBatch(**{k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})

    def to(self, device: torch.device) -> "TrainBatch":
        return TrainBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


class TorchTrainer:
    """Trainer protocol: create, logprobs, train_step, export_weights, offload/onload, release,
    state_dict/load_state_dict. `cfg` is `TrainerConfig`, `algo` is `AlgoConfig`."""

    def __init__(self, cfg: Any, algo: Any, model_path: str, device: torch.device, seed: int = 0,
                 total_steps: int = 1, temperature: float = 1.0):
        self.cfg, self.algo = cfg, algo
        self.total_steps = total_steps
        # Log-probs are taken at the sampling temperature, as the engine reports them.
        self.temperature = temperature
        self.model_path = model_path
        self.device = device
        self.dtype = _dtype(cfg.dtype, device)
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.offloaded = False
        self.steps = 0
        self.pad_id = 0

    # ------------------------------------------------------------------ lifecycle

    def create(self, load_weights: bool = True) -> None:
        """Build model, reference model and optimizer. `load_weights=False`: architecture only,
        for a re-creation that restores its state from a checkpoint or a host snapshot next."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if load_weights:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
        else:
            # Allocate straight on the device and skip the random init: the state is restored
            # next, and initialising a large model on the host costs seconds (measured on the H200).
            # fork_rng: whatever init remains must not move the global RNG of a re-created run.
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    _no_init_weights(), self.device:
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path),
                                                              dtype=self.dtype)
        self.model.train()
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if self.algo.kl_coef > 0:
            # The reference is always the initial checkpoint, also after a re-creation.
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2),
                                           eps=self.cfg.eps, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.offloaded = False

    @property
    def released(self) -> bool:
        return self.model is None

    def _lr_factor(self, step: int) -> float:
        warm = self.cfg.warmup_steps
        if warm and step < warm:
            return (step + 1) / warm
        if self.cfg.lr_schedule == "constant":
            return 1.0
        total = max(self.total_steps - warm, 1)
        progress = min(max(step - warm, 0) / total, 1.0)
        floor = self.cfg.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def release(self) -> None:
        """Drop model, reference, optimizer (with grads and state) and allocator caches entirely.
        Re-create with `create(load_weights=False)` and restore from a checkpoint or snapshot."""
        self.model = self.ref_model = self.optimizer = self.scheduler = None
        gc.collect()
        if self.device.type == "cuda":
            free_cuda_caches()
        else:
            trim_host_heap()

    # ------------------------------------------------------------------ offload

    def offload(self) -> None:
        """Params, grads and optimizer state to host memory (pinned on GPU). No-op on a CPU device."""
        if self.device.type == "cpu" or self.offloaded or self.released:
            self.offloaded = True
            return
        self._move(torch.device("cpu"))
        free_cuda_caches()
        self.offloaded = True

    def onload(self) -> None:
        if self.device.type == "cpu" or not self.offloaded:
            self.offloaded = False
            return
        self._move(self.device)
        self.offloaded = False

    def _move(self, device: torch.device) -> None:
        pin = device.type == "cpu"
        for module in (self.model, self.ref_model):
            if module is None:
                continue
            for p in module.parameters():
                p.data = _moved(p.data, device, pin)
                if p.grad is not None:
                    p.grad = _moved(p.grad, device, pin)
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state[k] = _moved(v, device, pin)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # ------------------------------------------------------------------ forward

    def _forward_logp(self, model: torch.nn.Module, mb: TrainBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False)
        logits = out.logits[:, :-1].float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logsm = torch.log_softmax(logits, dim=-1)
        logp = logsm.gather(-1, mb.tokens[:, 1:, None]).squeeze(-1)
        logp = torch.nn.functional.pad(logp, (1, 0))
        ent = None
        if with_entropy:
            ent = torch.nn.functional.pad(-(logsm.exp() * logsm).sum(-1), (1, 0))
        return logp, ent

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, L] (and entropy) of the policy, or of the reference model."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0" if reference else "trainer not created")
        was_training = model.training
        model.eval()
        outs, ents = [], []
        for mb in self._micro_batches(batch):
            lp, ent = self._forward_logp(model, mb.to(self.device), with_entropy=True)
            outs.append(lp.cpu())
            ents.append(ent.cpu())
        model.train(was_training)
        return torch.cat(outs), torch.cat(ents)

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        size = self.cfg.micro_batch_size
        for i in range(0, len(batch), size):
            yield batch.slice(slice(i, i + size))

    # ------------------------------------------------------------------ train

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step: `ppo_epochs` passes over `mini_batches` mini-batches, one optimizer step each."""
        assert self.model is not None and self.optimizer is not None
        algo = self.algo
        loss_cfg = PolicyLossConfig(eps_low=algo.clip_eps_low, eps_high=algo.clip_eps_high, dual_clip=algo.dual_clip,
                                    tis_cap=algo.tis_cap, aggregation=algo.loss_agg)
        n = len(batch)
        g = torch.Generator().manual_seed(self.seed * 100003 + self.steps)
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        tokens_trained = 0
        for _ in range(algo.ppo_epochs):
            order = torch.randperm(n, generator=g) if algo.mini_batches > 1 else torch.arange(n)
            # An empty batch still runs every optimizer step: the rank joins the collectives.
            for chunk in order.tensor_split(algo.mini_batches):
                mini = batch.slice(chunk)
                stats = self._optimizer_step(mini, loss_cfg)
                tokens_trained += int(mini.attention_mask.sum())
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
        updates = algo.ppo_epochs * algo.mini_batches
        metrics = {k: v / updates for k, v in sums.items()}
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.steps += 1
        metrics["train_tokens_per_s"] = tokens_trained / max(time.perf_counter() - t0, 1e-9)
        return metrics

    def _optimizer_step(self, mini: TrainBatch, loss_cfg: PolicyLossConfig) -> dict[str, float]:
        algo = self.algo
        # Global normalisers: the same loss on every rank as if the whole mini-batch were here.
        counts = torch.tensor([float(mini.loss_mask.sum()), float(len(mini))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(counts)
        normalizer = counts[0].item() if algo.loss_agg == "token-mean" else counts[1].item()
        total_tokens = max(counts[0].item(), 1.0)
        self.optimizer.zero_grad(set_to_none=True)
        acc = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "approx_kl_old": 0.0}
        for mb in self._micro_batches(mini):
            mb = mb.to(self.device)
            logp, ent = self._forward_logp(self.model, mb, with_entropy=True)
            pg, stats = policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask, loss_cfg, mb.rollout_logp, normalizer)
            loss = pg
            local_tokens = mb.loss_mask.sum()
            if algo.entropy_coef:
                loss = loss - algo.entropy_coef * aggregate(ent, mb.loss_mask, algo.loss_agg, normalizer)
            if algo.kl_coef and mb.ref_logp is not None:
                kl = kl_penalty(logp, mb.ref_logp, algo.kl_estimator)  # computed once: loss term and metric
                if algo.kl_in == "loss":
                    loss = loss + algo.kl_coef * aggregate(kl, mb.loss_mask, algo.loss_agg, normalizer)
                acc["kl"] += float((kl.detach() * mb.loss_mask).sum())
            loss.backward()
            w = float(local_tokens)
            acc["loss"] += float(loss.detach())
            acc["pg_loss"] += float(pg.detach())
            acc["entropy"] += float((ent.detach() * mb.loss_mask).sum())
            acc["clip_frac"] += float(stats["clip_frac"].detach()) * w
            acc["approx_kl_old"] += float(stats["approx_kl_old"].detach()) * w
        self._all_reduce_grads()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        else:
            self.optimizer.step()
        # Token-weighted statistics, summed over ranks.
        vec = torch.tensor([acc["loss"], acc["pg_loss"], acc["kl"], acc["entropy"], acc["clip_frac"], acc["approx_kl_old"]],
                           dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(vec)
        loss_sum, pg_sum, kl, ent, clip, akl = vec.tolist()
        return {"loss": loss_sum, "pg_loss": pg_sum, "kl": kl / total_tokens, "entropy": ent / total_tokens,
                "clip_frac": clip / total_tokens, "approx_kl_old": akl / total_tokens, "grad_norm": float(grad_norm)}

    def _all_reduce_grads(self) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)

    # ------------------------------------------------------------------ weights and state

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, in the training dtype; tied weights once."""
        assert self.model is not None
        seen: set[int] = set()
        for name, t in self.model.state_dict().items():
            if t.numel() and t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            yield name, t.detach()

    def save_pretrained(self, path: str) -> None:
        """An HF checkpoint directory (config + safetensors), loadable by `from_pretrained`."""
        assert self.model is not None
        self.model.save_pretrained(path, safe_serialization=True)

    # -------------------------------------------------------------- checkpoint state

    def distributed_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """FQN-keyed model and optimizer state for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer)

    def load_distributed_state_dict(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def host_state(self) -> dict[str, Any]:
        """The small state that is not tensors of the model: schedule and step count."""
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    def snapshot(self) -> dict[str, Any]:
        """A host-memory copy of everything needed to re-create the trainer (pinned on GPU)."""
        pin = self.device.type == "cuda"

        def copy(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                out = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
                out.copy_(x, non_blocking=pin)
                return out
            if isinstance(x, dict):
                return {k: copy(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(copy(v) for v in x)
            return x

        snap = {"model": copy(self.model.state_dict()), "optimizer": copy(self.optimizer.state_dict()),
                **self.host_state()}
        if pin:
            torch.cuda.synchronize(self.device)
        return snap

    def restore_snapshot(self, snap: dict[str, Any]) -> None:
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self.load_host_state(snap)


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _moved(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    if pin:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
    return t.to(device, non_blocking=True)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
