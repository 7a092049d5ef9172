"""The torch-native trainer: a transformers causal LM, AdamW, FSDP2 data parallel.

Data parallelism. Under torch.distributed the model is sharded with FSDP2 (`fully_shard`) over
the world's *current* default group, gloo on CPU and NCCL on GPU; every rank trains on its own
samples. The loss is normalised by the global token (or sequence) count of the mini-batch and
FSDP2 sums the gradients, so the result is exactly the full-batch gradient. FSDP binds a module to
its group, and the world destroys that group between steps: `onload` re-binds the modules to the
rebuilt group, or re-shards fresh ones from the local shards where it cannot (`sharding.py`).

Batch layout. All per-token tensors are [B, L] over the full sequence (prompt + response, right
padded): `tokens`, `attention_mask`, `loss_mask` (1 on response tokens), `advantages`,
`old_logp`, `ref_logp`, `rollout_logp`. `logp[:, t]` is the log-prob of `tokens[:, t]` given the
tokens before it (position 0 has none and is never in the loss mask).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rltrain.algo.losses import PolicyLossConfig, aggregate, kl_penalty, policy_loss
from rltrain.weights.names import checkpoint_specs, module_weights, to_checkpoint
from rltrain.runtime.memory import free_cuda_caches, trim_host_heap
from rltrain.trainer.sharding import (HostPark, capture, current_group, free_storage, full_tensor, full_tensors,
                                      load, rebind, reshard, shard)

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


GC_EVERY = 8  # onloads of a sharded trainer between full garbage collections (see onload)


class TorchTrainer:
    """Trainer protocol: create, logprobs, train_step, export_weights, offload/onload, release,
    snapshot/restore_snapshot, distributed_state_dict. `cfg` is `TrainerConfig`, `algo` is `AlgoConfig`.

    Under torch.distributed the model (and the reference model) is sharded with FSDP2 over the
    world's current default group, on CPU (gloo) and GPU (NCCL) alike; see `sharding.py` for how it
    follows the world across destroy/rebuild. Without torch.distributed it is a plain module."""

    rebinds = True  # modules follow a world rebuild by `sharding.rebind` (megatron's are re-assembled)

    def __init__(self, cfg: Any, algo: Any, model_path: str, device: torch.device, seed: int = 0,
                 total_steps: int = 1, temperature: float = 1.0):
        self.cfg, self.algo = cfg, algo
        self.total_steps = total_steps
        # Log-probs are taken at the sampling temperature, as the engine reports them.
        self.temperature = temperature
        self._reshards = 0  # onloads of a sharded trainer (a full gc every GC_EVERY; see onload)
        self.timings: dict[str, float] = {}  # seconds of the parts of the last offload / onload
        self.model_path = model_path
        self.device = device
        self.dtype = _dtype(cfg.dtype, device)
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.steps = 0
        self.pad_id = 0
        self._group: Any = None  # the process group the modules are sharded over
        self._parked: dict[str, Any] | None = None  # captured state while offloaded (megatron)
        self._park: HostPark | None = None  # the host copy of the storages while offloaded in place
        self._rebind_refused = False  # rebind said no once: said in the log once
        self._hf_config: Any = None
        self._specs: list[tuple[str, str, torch.Size, torch.dtype]] | None = None
        # From `_specs`: checkpoint name -> module tensor, and the module tensors stored converted.
        self._sources: tuple[dict[str, str], set[str]] | None = None
        self._module_tensors: dict[str, torch.Tensor] | None = None  # of `self.model`; cleared with it

    @property
    def sharded(self) -> bool:
        return dist.is_initialized()

    @property
    def released(self) -> bool:
        return self.model is None and self._parked is None

    @property
    def offloaded(self) -> bool:
        return self._parked is not None or bool(self._park is not None and self._park.parked)

    # ------------------------------------------------------------------ lifecycle

    def create(self, load_weights: bool = True) -> None:
        """Build model, reference model and optimizer. `load_weights=False`: architecture only,
        for a re-creation that restores its state from a checkpoint next."""
        self._module_tensors = None
        self.model = self._build("checkpoint" if load_weights else "empty")
        self.ref_model = self._build_reference()
        self._new_optimizer()
        self._group = current_group()
        self._parked = self._park = None

    def _build(self, init: str) -> torch.nn.Module:
        """init: "checkpoint" (weights from model_path), "empty" (allocated on the device, no
        random init; buffers computed), "meta" (nothing allocated; filled by `sharding.load`)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        if init == "checkpoint":
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).to(self.device)
        else:
            # Skip the random init: the state is restored next, and initialising a large model on
            # the host costs seconds (measured on the H200). fork_rng: whatever init remains must
            # not move the global RNG of a re-created run.
            where = torch.device("meta") if init == "meta" else self.device
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []), \
                    _no_init_weights(), where:
                if self._hf_config is None:
                    self._hf_config = AutoConfig.from_pretrained(self.model_path)
                model = AutoModelForCausalLM.from_config(self._hf_config, dtype=self.dtype)
        if self.sharded:
            shard(model, self.device)
        if init == "meta":
            model.to_empty(device=self.device)
        return model

    def _build_reference(self) -> torch.nn.Module | None:
        if self.algo.kl_coef <= 0:
            return None
        # The reference is always the initial checkpoint, also after a re-creation.
        ref = self._build("checkpoint").eval()
        ref.requires_grad_(False)
        return ref

    def _new_optimizer(self) -> None:
        self.model.train()
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2),
                                           eps=self.cfg.eps, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

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
        Re-create with `create(load_weights=False)` + a checkpoint, or `restore_snapshot`."""
        self._free()
        self._drop()
        self._parked = self._park = None
        gc.collect()
        if self.device.type == "cuda":
            free_cuda_caches()
        else:
            trim_host_heap()

    def _drop(self) -> None:
        self.model = self.ref_model = self.optimizer = self.scheduler = None
        self._module_tensors = None

    def _free(self) -> None:
        """Empty the modules' storage (see sharding.free_storage); call only right before `_drop`."""
        for module in (self.model, self.ref_model):
            if module is not None:
                free_storage(module)

    @contextlib.contextmanager
    def _timed(self, what: str) -> Iterator[None]:
        """Seconds of a part of offload/onload (device work included), for the benchmarks."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings[what] = time.perf_counter() - t0

    # ------------------------------------------------------------------ memory ledger

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor this trainer holds, by kind, wherever it is (the memory ledger sizes them;
        each storage counts once, in the first kind it appears in)."""
        weights: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        optim: list[torch.Tensor] = []
        for module in (self.model, self.ref_model):
            if module is not None:
                # (nn.Module's own methods: megatron's DDP has a `buffers` list of its own)
                weights += [*torch.nn.Module.parameters(module), *torch.nn.Module.buffers(module)]
                for p in torch.nn.Module.parameters(module):
                    grads += [g for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
        for opt in _optimizers(self.optimizer):
            optim += [p for group in opt.param_groups for p in group["params"]]  # fp32 main params (megatron)
            tensors_in(list(opt.state.values()), optim)
        parked = self._parked or {}
        model_state = parked.get("model")
        if isinstance(model_state, dict) and "params" in model_state:  # this trainer's capture
            tensors_in([model_state["params"], model_state["buffers"]], weights)
            tensors_in(model_state.get("optim"), optim)
        else:  # megatron's capture
            tensors_in(model_state, weights)
            tensors_in(parked.get("optimizer"), optim)
        tensors_in(parked.get("reference"), weights)
        return {"weights": weights, "grads": grads, "optimizer": optim, "spare": self._spare_host_buffers()}

    def _spare_host_buffers(self) -> list[torch.Tensor]:
        """Host buffers kept between offloads for reuse: the offload buffer (which holds the
        weights and optimizer state while offloaded)."""
        return [self._park.buffer] if self._park is not None and self._park.buffer is not None else []

    # ------------------------------------------------------------------ offload

    def offload(self) -> None:
        """Params and optimizer state (and the reference) to pinned host memory, and every GPU
        byte returned. Gradients are freed after each optimizer step, so there are none to move.
        A no-op on a CPU device. The modules are kept, their storages emptied in place
        (`sharding.HostPark`); `onload` refills them and, after a world rebuild, re-binds them
        to the new group."""
        if self.device.type == "cpu" or self.offloaded or self.released:
            return
        for module in (self.model, self.ref_model):
            if module is not None and self.sharded:
                reshard(module)  # the root keeps its gathered parameters after a forward without backward
        with self._timed("offload: copy to host"):
            if self._park is None:
                self._park = HostPark()
            self._park.park(self._device_tensors())
        with self._timed("offload: return memory to the device"):
            self._reclaim()

    def trim(self) -> None:
        """Hand the allocator's cached blocks (the last step's activations) back to the device,
        keeping the state. The loop calls it after the train step when the trainer is put away
        after the step anyway (offload would return them then): the engine takes its weights back
        next, and on a full GPU it would not fit beside the trainer's cache (23.6 GiB after a
        train step of a 2B model on the H200, in the e2e ledger)."""
        if self.device.type == "cuda":
            free_cuda_caches()

    def _device_tensors(self) -> list[torch.Tensor]:
        held = self.held_tensors()
        return held["weights"] + held["grads"] + held["optimizer"]

    def _reclaim(self) -> None:
        """Hand the memory of the dropped modules back to the device."""
        free_cuda_caches()

    def _stale(self) -> bool:
        """Whether the modules were built on groups the world has destroyed since."""
        return self.sharded and self.model is not None and self._group is not current_group()

    def onload(self) -> None:
        """Back on the device, sharded over the current default group. A sharded trainer whose
        group was destroyed since (a world rebuild) is re-bound to the new group (offloaded or
        not), or, where FSDP2 cannot be re-bound, re-sharded from its local shards."""
        if self._parked is not None:  # a capture (a subclass's offload)
            parked, self._parked = self._parked, None
            self._rebuild(parked)
        if self.offloaded:
            with self._timed("onload: copy to device"):
                self._park.unpark()
        if not self._stale():
            return
        if self.rebinds:
            with self._timed("onload: re-bind to the new group"):
                why = self._rebind(current_group())
            if why is None:
                self._group = current_group()
                return
            if not self._rebind_refused:
                log.warning("trainer: re-sharding fresh modules after each world rebuild (slower): %s", why)
                self._rebind_refused = True
        self._reshard_fresh()

    def _rebind(self, group: Any) -> str | None:
        for module in (self.model, self.ref_model):
            if module is not None:
                why = rebind(module, group)
                if why is not None:
                    return why
        return None

    def _reshard_fresh(self) -> None:
        old = (self.model, self.ref_model)
        self._rebuild(self._capture(to_host=False, with_reference=True))
        for module in old:  # copied into the new modules (the optimizer state was re-wrapped, not copied)
            if module is not None:
                free_storage(module)
        del old
        # The modules dropped above hold the destroyed group through their mesh, partly in
        # reference cycles, and a Gloo group keeps its sockets and threads until it is freed:
        # ~1.5 fds and ~1 thread per world cycle stayed behind (seen in rltrain.bench.soak). A
        # full collection frees them (a young-generation one does not) but costs ~0.1-0.3 s:
        # one every GC_EVERY re-shards bounds the growth.
        self._reshards += 1
        if self._reshards % GC_EVERY == 0:
            gc.collect()

    def _capture(self, to_host: bool, with_reference: bool) -> dict[str, Any]:
        pin = to_host and self.device.type == "cuda"
        state = {"model": capture(self.model, self.optimizer, to_host, pin), **self.host_state()}
        if with_reference and self.ref_model is not None:
            state["reference"] = capture(self.ref_model, None, to_host, pin)
        return state

    def _rebuild(self, state: dict[str, Any]) -> None:
        """Fresh modules sharded over the current group, filled from a capture."""
        self._drop()
        with self._timed("onload: build and shard modules"):
            self.model = self._build("meta")
            self._new_optimizer()
        with self._timed("onload: copy to device"):
            load(self.model, self.optimizer, state["model"])
        self.load_host_state(state)
        if "reference" in state:
            self.ref_model = self._build("meta").eval()
            self.ref_model.requires_grad_(False)
            load(self.ref_model, None, state["reference"])
        else:
            self.ref_model = self._build_reference()
        self._group = current_group()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ forward

    def _forward_logp(self, model: torch.nn.Module, mb: TrainBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = model.get_output_embeddings()
        if not _fusable(head, model.config):
            out = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False)
            return self._logp_from_logits(out.logits, mb.tokens, with_entropy)
        from rltrain.kernels import linear_logprobs_entropy

        # The LM head computes (log-prob, entropy) of the next tokens from the hidden states
        # directly, in chunks of tokens: no logits of the whole micro-batch, and under FSDP2 the
        # head's weight is the gathered one, inside the model's forward, as for the plain head.
        targets = torch.nn.functional.pad(mb.tokens[:, 1:], (0, 1))  # the last position's is a dummy

        def fused(hidden: torch.Tensor) -> torch.Tensor:
            return torch.stack(linear_logprobs_entropy(hidden, head.weight, targets, self.temperature), dim=-1)

        head.forward = fused
        try:
            out = model(input_ids=mb.tokens, attention_mask=mb.attention_mask, use_cache=False)
        finally:
            del head.forward
        logp, ent = (torch.nn.functional.pad(x[:, :-1], (1, 0)) for x in out.logits.unbind(-1))
        return logp, ent if with_entropy else None

    def _logp_from_logits(self, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool,
                          **vocab: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, L] log-probs of `tokens` under next-token `logits` [B, L, V] (0 at position 0), by
        rltrain.kernels (fused on CUDA: no float32 copy or log-softmax of the logits). `vocab`:
        the vocabulary-parallel arguments of `logprobs_entropy` (megatron, TP-sharded logits)."""
        from rltrain.kernels import logprobs_entropy

        # Every position, the last with a dummy target, so the logits stay one contiguous view
        # (slicing off the last position would copy them); that position is dropped after.
        targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
        logp, ent = logprobs_entropy(logits, targets, self.temperature, **vocab)
        logp = torch.nn.functional.pad(logp[:, :-1], (1, 0))
        return logp, torch.nn.functional.pad(ent[:, :-1], (1, 0)) if with_entropy else None

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, L] (and entropy) of the policy, or of the reference model.
        Sharded: a collective (every rank calls it, with however many samples it has)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0" if reference else "trainer not created")
        was_training = model.training
        model.eval()
        L = batch.tokens.shape[1]
        outs, ents = [torch.zeros(0, L)], [torch.zeros(0, L)]
        for mb, real in self._micro_batches(batch):
            lp, ent = self._forward_logp(model, mb.to(self.device), with_entropy=True)
            if real:
                outs.append(lp.cpu())
                ents.append(ent.cpu())
        if self.sharded:
            reshard(model)  # no backward follows: do not keep the root's gathered parameters
        model.train(was_training)
        return torch.cat(outs), torch.cat(ents)

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[TrainBatch, bool]]:
        """(micro-batch, is real). Sharded, every rank must run as many forward/backward passes
        as the busiest one (each pass all-gathers parameters): the others add idle passes."""
        size = self.cfg.micro_batch_size
        mine = math.ceil(len(batch) / size)
        total = mine
        if self.sharded:
            count = torch.tensor([mine], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            total = int(count)
        for i in range(mine):
            yield batch.slice(slice(i * size, (i + 1) * size)), True
        for _ in range(total - mine):
            yield _idle_batch(batch, self.pad_id), False

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

    _STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl_old")

    def _normalizers(self, mini: TrainBatch) -> tuple[float, float]:
        """(loss normaliser, total loss tokens) over the whole mini-batch on every rank: the same
        loss everywhere as if the mini-batch were in one place. Sharded, the gradients are summed
        over ranks (FSDP2 divide factor 1), giving the full-batch gradient."""
        counts = torch.tensor([float(mini.loss_mask.sum()), float(len(mini))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(counts, group=self._data_group())
        normalizer = counts[0].item() if self.algo.loss_agg == "token-mean" else counts[1].item()
        return normalizer, max(counts[0].item(), 1.0)

    def _micro_loss(self, mb: TrainBatch, logp: torch.Tensor, ent: torch.Tensor, loss_cfg: PolicyLossConfig,
                    normalizer: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of one micro-batch and its token-weighted statistics (in `_STATS` order)."""
        algo = self.algo
        pg, stats = policy_loss(logp, mb.old_logp, mb.advantages, mb.loss_mask, loss_cfg, mb.rollout_logp, normalizer)
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
        acc = torch.stack([loss.detach(), pg.detach(), kl_sum, (ent.detach() * mb.loss_mask).sum(),
                           stats["clip_frac"].detach() * w, stats["approx_kl_old"].detach() * w]).double()
        return loss, acc

    def _step_stats(self, acc: torch.Tensor, total_tokens: float, grad_norm: float) -> dict[str, float]:
        """Token-weighted statistics summed over the data-parallel ranks."""
        acc = acc.to(device=self.device, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(acc, group=self._data_group())
        loss_sum, pg_sum, kl, ent, clip, akl = acc.tolist()
        return {"loss": loss_sum, "pg_loss": pg_sum, "kl": kl / total_tokens, "entropy": ent / total_tokens,
                "clip_frac": clip / total_tokens, "approx_kl_old": akl / total_tokens, "grad_norm": float(grad_norm)}

    def _optimizer_step(self, mini: TrainBatch, loss_cfg: PolicyLossConfig) -> dict[str, float]:
        normalizer, total_tokens = self._normalizers(mini)
        self._zero_grad()
        acc = torch.zeros(len(self._STATS), dtype=torch.float64)
        for mb, _ in self._micro_batches(mini):
            mb = mb.to(self.device)
            logp, ent = self._forward_logp(self.model, mb, with_entropy=True)
            loss, stats = self._micro_loss(mb, logp, ent, loss_cfg, normalizer)
            loss.backward()
            acc += stats.cpu()
        grad_norm = self._apply_gradients()
        self._zero_grad()  # no gradients live between steps
        return self._step_stats(acc, total_tokens, grad_norm)

    def _data_group(self) -> Any:
        """The group whose ranks hold different samples (None: the whole world)."""
        return None

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _apply_gradients(self) -> float:
        """Clip and step (skipped on a non-finite norm); returns the gradient norm."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip))
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        else:
            self.optimizer.step()
        return float(grad_norm)

    # ------------------------------------------------------------------ weights and state

    def weight_specs(self) -> list[tuple[str, str, torch.Size, torch.dtype]]:
        """(checkpoint name, module name, full shape, dtype) of every weight, tied ones once; no
        collectives. Checkpoint names are what engines load (per-expert MoE names included).
        Computed once: the architecture never changes, and deriving it costs ~0.2 s for a 4B
        model (measured), which every bucket of every sync would pay."""
        assert self.model is not None
        if self._specs is None:
            self._specs = checkpoint_specs(self.model)
        return self._specs

    def export_weights(self, names: list[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor) of every weight (or of `names`, in their order of module
        tensors), in the training dtype, on the trainer's device, detached. Sharded, a collective:
        every rank iterates it to the end with the same `names`. (Not a no_grad generator: that
        enters and leaves no_grad around every item, ~5 us each on every bucket of every sync;
        the gather runs under no_grad and what it yields is detached.)"""
        assert self.model is not None
        if self._module_tensors is None:  # walking the module tree costs ~5 ms on a 4B model, per bucket
            self._module_tensors = dict(module_weights(self.model))
        if self._sources is None:  # per bucket too: ~0.1 ms for a 4B model's ~400 weights
            specs = self.weight_specs()
            self._sources = ({ck: src for ck, src, _, _ in specs}, {src for ck, src, _, _ in specs if ck != src})
        module_tensors = self._module_tensors
        source_of, converted = self._sources
        if names is None:
            sources, wanted = list(module_tensors), None
        else:
            wanted = set(names)
            unknown = sorted(n for n in wanted if n not in source_of)
            if unknown:
                raise KeyError(f"no trainer weight is named {unknown[:5]}")
            sources = list(dict.fromkeys(source_of[n] for n in names))
        # On GPUs one all-gather per chunk of parameters; on the CPU one per parameter (full_tensors).
        budget = GATHER_BYTES if self.device.type == "cuda" else 0
        for chunk in _gather_chunks(sources, module_tensors, budget):
            with torch.no_grad():
                fulls = full_tensors([module_tensors[src] for src in chunk])
            for src in chunk:
                full = fulls.pop(0).detach()  # popped: each is freed once its consumer lets go
                if src not in converted:
                    yield src, full
                    continue
                for name, t in to_checkpoint(self.model, src, full):
                    if wanted is None or name in wanted:
                        yield name, t

    def save_pretrained(self, path: str) -> None:
        """An HF checkpoint directory (config + sharded safetensors + index) written by rank 0,
        loadable by `from_pretrained`. Sharded, a collective."""
        from rltrain.weights.hf_files import write_checkpoint

        write_checkpoint(path, self.model_path, self.export_weights(), write=not dist.is_initialized() or dist.get_rank() == 0)

    # -------------------------------------------------------------- checkpoint state

    def distributed_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """FQN-keyed model and optimizer state (sharded DTensors) for torch.distributed.checkpoint."""
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
        """A host-memory copy (pinned on GPU) of this rank's shard of everything needed to
        re-create the trainer; the reference model is re-read from its checkpoint instead."""
        return self._capture(to_host=True, with_reference=False)

    def restore_snapshot(self, snap: dict[str, Any]) -> None:
        """Re-create a released trainer from `snapshot()`, sharded over the current group."""
        self._rebuild(snap)


GATHER_BYTES = 1 << 30  # whole tensors gathered at once by export_weights: above a sync bucket (512 MiB)


def _gather_chunks(sources: list[str], tensors: dict[str, torch.Tensor], budget: int = GATHER_BYTES) -> Iterator[list[str]]:
    """`sources` in order, in runs of at most `budget` bytes of whole tensors (one tensor at least,
    so budget 0 gives one run per tensor): the same runs on every rank, from the global shapes."""
    run, size = [], 0
    for src in sources:
        t = tensors[src]
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > budget:
            yield run
            run, size = [], 0
        run.append(src)
        size += nbytes
    if run:
        yield run


def _fusable(head: Any, config: Any) -> bool:
    """Whether the model's output is a plain bias-free linear LM head (then the fused kernel
    replaces it); models that post-process logits (soft-capping) keep theirs."""
    return (type(head) is torch.nn.Linear and head.bias is None
            and not getattr(config, "final_logit_softcapping", None))


def _idle_batch(like: TrainBatch, pad_id: int) -> TrainBatch:
    """A one-sample batch that contributes nothing (empty loss mask) for a rank's idle pass."""
    tokens = torch.full((1, 2), pad_id, dtype=torch.long)
    zeros = torch.zeros(1, 2)
    fields = {k: (zeros if isinstance(v, torch.Tensor) else None) for k, v in like.__dict__.items()}
    fields.update(tokens=tokens, attention_mask=torch.ones(1, 2, dtype=torch.long), loss_mask=zeros,
                  advantages=zeros, old_logp=zeros)
    return TrainBatch(**fields)


def _no_init_weights() -> Any:
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a (possibly megatron-wrapped or chained) optimizer."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in _optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def tensors_in(obj: Any, out: list[torch.Tensor]) -> None:
    """Append every tensor in a nested dict/list/tuple to `out`."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_in(v, out)

