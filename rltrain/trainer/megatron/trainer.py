"""`trainer.backend: megatron` — megatron-core's GPTModel, DDP and optimizer behind the Trainer protocol.

It is a peer of the FSDP2 trainer (trainer/fsdp.py): both implement interfaces.Trainer and share
the RL update (trainer/rl_update.py: micro-batching, the loss, statistics, the learning-rate
schedule), and nothing else. What is its own:
  model      GPTModel (local layer spec) built from the HF config, weights converted from the HF
             checkpoint and sharded over tensor parallel (convert.py); megatron-core DDP over
             the data-parallel group, gradients summed (losses use global token counts)
  optimizer  megatron-core's optimizer (Adam; fp32 main params for bf16 models, grad clipping),
             optionally distributed (state sharded over data parallel)
  data       the ranks of a tensor-parallel group hold different samples in the loop; each step
             they pool them (all ranks of a TP group must run the same sequences), log-probs are
             handed back per rank
  groups     World handles (model.py); after a world rebuild the modules, DDP and optimizer are
             built again over the new groups and the state is moved in (offloaded or not)
  export     each weight gathered over tensor parallel and converted to HF names (convert.py)
  checkpoint torch.distributed.checkpoint of this rank's live tensors under layout-qualified keys
             (restored in place, at the same TP/PP/DP/EP sizes); release-train by checkpoint or snapshot

  MoE        Qwen3-MoE and Mixtral on megatron's MoE layer (TP=PP=1), experts optionally split over
             `trainer.expert_parallel_size` data-parallel ranks; export broadcasts each expert
             from the rank that holds it

  pipeline   `trainer.pipeline_parallel_size`: megatron's 1F1B schedule with the RL loss on the
             last stage (log-probs and statistics broadcast back to every stage); each stage
             loads its layers; export broadcasts each weight from the stage that holds it

Not yet: context parallel, interleaved (virtual) pipeline stages, experts sharded over TP or
PP, MoE models with dense layers, resharding checkpoints to another layout (megatron's
dist_checkpointing would).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
from safetensors.torch import load_file
from transformers import AutoConfig

from rltrain.algo.losses import PolicyLossConfig
from rltrain.batch import TrainBatch, pad_rows, pad_width
from rltrain.config import AlgoConfig, TrainerConfig
from rltrain.interfaces import Needs, Snapshot, WeightSpecRow, World
from rltrain.runtime.dtypes import resolve_dtype
from rltrain.runtime.ledger import HeldTensors
from rltrain.runtime.memory import free_cuda_caches
from rltrain.runtime.pinned import PinnedArena
from rltrain.trainer import rl_update
from rltrain.trainer.megatron.convert import (
    dims,
    expert_of,
    from_mcore,
    full_shape,
    hf_to_mcore_shards,
    is_tp_sharded,
    local_expert_name,
    mcore_names,
    stage_name,
    stage_of,
    to_stage,
    tp_unshard,
)
from rltrain.trainer.megatron.model import MegatronGroups, build_gpt
from rltrain.trainer.rl_update import LogProbs
from rltrain.trainer.state import (
    GC_EVERY,
    capture_host_state,
    held,
    restore_host_state,
    return_memory,
    tensors_in,
    timed,
)
from rltrain.weights.hf_files import write_checkpoint

log = logging.getLogger("rltrain.trainer")


class _Schedule:
    """LR schedule over a megatron optimizer (not a torch optimizer, so no LambdaLR)."""

    def __init__(self, optimizer: Any, base_lr: float, factor: Callable[[int], float]):
        self.optimizer, self.base_lr, self.factor, self.step_count = optimizer, base_lr, factor, 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self.factor(self.step_count)

    def get_last_lr(self) -> list[float]:
        return [self.base_lr * self.factor(self.step_count)]

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


class MegatronTrainer:
    """The megatron-core trainer (interfaces.Trainer); the shared RL update is rl_update.py."""

    def __init__(
        self,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        model_path: str,
        device: torch.device,
        world: World,
        seed: int = 0,
        total_steps: int = 1,
        temperature: float = 1.0,
        pad_id: int = 0,
    ):
        if not dist.is_initialized():
            raise RuntimeError("trainer.backend=megatron needs torch.distributed (run under torchrun)")
        self.cfg, self.algo = cfg, algo
        self.total_steps = total_steps
        self.temperature = temperature  # log-probs are taken at the sampling temperature
        self.timings: dict[str, float] = {}  # seconds of the parts of the last offload / onload
        self.model_path = model_path
        self.device = device
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.seed = seed
        self.pad_id = pad_id
        self.world = world
        self.tp = cfg.tensor_parallel_size
        self.ep = cfg.expert_parallel_size
        self.pp = cfg.pipeline_parallel_size
        self._hf_config = AutoConfig.from_pretrained(model_path)
        self.dims = dims(self._hf_config, self.tp, self.pp)
        if self.ep > 1 and (not self.dims.experts or self.dims.experts % self.ep):
            raise ValueError(
                f"trainer.expert_parallel_size={self.ep} needs a MoE model whose expert count it "
                f"divides (this model has {self.dims.experts} experts)"
            )
        self.model: Any = None  # megatron DDP over the GPTModel
        self.ref_model: Any = None
        self.optimizer: Any = None
        self.scheduler: _Schedule | None = None
        self.steps = 0
        self.groups: MegatronGroups | None = None
        self._generation: int | None = None  # the world generation the modules were built on
        self._pgs: Any = None  # megatron ProcessGroupCollection of that generation
        self._parked: dict[str, Any] | None = None  # the captured state while offloaded
        self._host: _HostMirror | None = None  # page-locked buffers offloads copy into (GPU)
        self._rebuilds = 0  # re-assemblies after a world rebuild (a full gc every GC_EVERY)
        self._specs: list[WeightSpecRow] | None = None
        self._hf_of: dict[str, list[str]] = {}  # megatron name -> its HF names (from the specs)
        # Bytes of expert weights this rank sent to other EP ranks in exports (all of them so far).
        self.expert_bytes_sent = 0

    sharded = True  # its collectives always run over the world's groups

    @property
    def released(self) -> bool:
        return self.model is None and self._parked is None

    @property
    def offloaded(self) -> bool:
        return self._parked is not None

    def _groups(self) -> MegatronGroups:
        if self.groups is None:
            raise RuntimeError("the megatron trainer is not created yet")
        return self.groups

    # ------------------------------------------------------------------ lifecycle

    def create(self, load_weights: bool = True) -> None:
        if self.groups is None:
            self.groups = MegatronGroups(self.world, self.tp, self.ep, self.pp)
        self._seed()
        hf = self._hf_shards() if load_weights else None
        self._assemble({"model": hf, "optimizer": None, "reference": hf if self.algo.kl_coef > 0 else None})
        self._parked = None

    def _seed(self) -> None:

        g = self._groups()
        tensor_parallel.model_parallel_cuda_manual_seed(
            self.seed, tp_rank=g.tp_rank, ep_rank=g.ep_rank, etp_rank=g.tp_rank
        )

    def _hf_shards(self) -> dict[str, torch.Tensor]:
        hf: dict[str, torch.Tensor] = {}
        for f in sorted(Path(self.model_path).glob("*.safetensors")):
            hf.update(load_file(str(f)))
        if not hf:
            raise FileNotFoundError(f"no *.safetensors in {self.model_path}")
        g = self._groups()
        state = hf_to_mcore_shards(hf, self.dims, g.tp_rank, self.tp, g.ep_rank, self.ep)
        return to_stage(state, self.dims, self.pp, g.pp_rank)

    def _gpt(self) -> Any:
        return build_gpt(
            self._hf_config, self._pgs, self.tp, self.dtype, self.device, self.ep, self.pp, self._groups().pp_rank
        )

    def _assemble(self, state: dict[str, Any]) -> None:
        """Modules, DDP and optimizer over the world's current groups, filled from `state`
        (megatron name -> this rank's tensor; None leaves the model uninitialised)."""

        self._drop()
        pgs = self._pgs = self._groups().collection()
        gpt = self._gpt()
        if state["model"] is not None:
            _fill(gpt, state["model"])
        dist_opt = self.cfg.distributed_optimizer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
        )
        self.model = DistributedDataParallel(gpt.config, ddp_cfg, gpt, pg_collection=pgs)
        self.model.train()
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=self.cfg.lr,
            weight_decay=self.cfg.weight_decay,
            adam_beta1=self.cfg.beta1,
            adam_beta2=self.cfg.beta2,
            adam_eps=self.cfg.eps,
            clip_grad=self.cfg.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=dist_opt,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model], pg_collection=pgs, use_gloo_process_groups=False)
        if state.get("optimizer") is not None:
            _load_optimizer(self.optimizer, state["optimizer"])
        self.scheduler = _Schedule(
            self.optimizer, self.cfg.lr, lambda step: rl_update.lr_factor(self.cfg, self.total_steps, step)
        )
        if "scheduler" in state:
            self.load_host_state(state)
        self.ref_model = None
        if state.get("reference") is not None:
            ref = self._gpt().eval()
            ref.requires_grad_(False)
            _fill(ref, state["reference"])
            self.ref_model = ref
        self._generation = self.world.generation

    def _drop(self) -> None:
        self.model = self.ref_model = self.optimizer = self.scheduler = None

    def release(self) -> None:
        """Drop model, reference, optimizer and allocator caches entirely (and the host mirror).
        Re-create with `create(load_weights=False)` + a checkpoint, or `restore_snapshot`."""
        self._drop()
        self._parked = None
        self._host = None
        return_memory(self.device)

    def offload(self) -> None:
        """Weights, optimizer state (and the reference) to page-locked host memory; the modules
        are dropped (megatron's parallel state is rebuilt with the world: see `_assemble`)."""
        if self.device.type == "cpu" or self.offloaded or self.released:
            return
        with timed(self.timings, "offload: copy to host", self.device):
            self._parked = self._capture(to_host=True, with_reference=True)
        with timed(self.timings, "offload: free modules", self.device):
            self._drop()
        with timed(self.timings, "offload: return memory to the device", self.device):
            self._reclaim()

    def trim(self) -> None:
        """Hand the allocator's cached blocks (the last step's activations) back to the device."""
        if self.device.type == "cuda":
            free_cuda_caches()

    def onload(self) -> None:
        """Back on the device over the world's current groups: an offloaded trainer is rebuilt
        from its capture; one whose groups were destroyed since (a world rebuild) is re-assembled
        over the new ones with its state moved in."""
        if self._parked is not None:
            parked, self._parked = self._parked, None
            self._rebuild(parked)
        if self.model is not None and self._generation != self.world.generation:
            self._rebuild(self._capture(to_host=False, with_reference=True))
            self._rebuilds += 1
            if self._rebuilds % GC_EVERY == 0:  # the dropped modules sit in reference cycles
                gc.collect()

    def _capture(self, to_host: bool, with_reference: bool) -> dict[str, Any]:
        """Weights, optimizer state (and the reference) of this rank: cloned on the device, or
        copied to host memory — on GPU into page-locked buffers kept from the previous offload
        (pinning afresh per offload costs seconds)."""
        state: dict[str, Any] = {
            "model": _weights(_unwrap(self.model)),
            "optimizer": _optimizer_state(self.optimizer),
            "reference": _weights(self.ref_model) if with_reference and self.ref_model is not None else None,
        }
        if to_host and self.device.type == "cuda":
            if self._host is None:
                self._host = _HostMirror()
            state = self._host.copy_in(state)
        else:
            state = _to(state, "cpu" if to_host else None)
        return {**state, **self.host_state()}

    def _rebuild(self, state: dict[str, Any]) -> None:
        self._seed()
        self._assemble(state)  # torch's optimizer load_state_dict moves the state to its params' device
        if self.algo.kl_coef > 0 and self.ref_model is None:
            self.ref_model = self._gpt().eval()
            self.ref_model.requires_grad_(False)
            _fill(self.ref_model, self._hf_shards())

    def _reclaim(self) -> None:
        # megatron's DDP keeps its parameter and gradient buffers in reference cycles: without a
        # collection pass they stay allocated.
        gc.collect()
        free_cuda_caches()

    def snapshot(self) -> Snapshot:
        """A host-memory copy of this rank's state, the reference re-read from its checkpoint instead."""
        return self._capture(to_host=True, with_reference=False)

    def restore_snapshot(self, snap: Snapshot) -> None:
        """Re-create a released trainer from `snapshot()`, over the world's current groups."""
        self._rebuild(snap)

    def held_tensors(self) -> HeldTensors:
        """Every tensor this trainer holds, by kind, wherever it is (also while offloaded); the
        host mirror's buffers are spare host memory."""
        parked = self._parked or {}
        return held(
            (self.model, self.ref_model),
            self.optimizer,
            parked_weights=[parked.get("model"), parked.get("reference")],
            parked_optimizer=parked.get("optimizer"),
            spare=list(self._host.buffers) if self._host is not None else [],
        )

    # ------------------------------------------------------------------ the RL update (rl_update.Backend)

    def data_group(self) -> dist.ProcessGroup | None:
        return self._pgs.dp

    def forward_logp(self, model: Any, mb: TrainBatch, with_entropy: bool) -> LogProbs:
        B, L = mb.tokens.shape
        positions = torch.arange(L, device=mb.tokens.device).expand(B, L)
        logits = model(mb.tokens, positions, attention_mask=None)  # causal; the batch is right-padded
        return self._logp_from_logits(logits, mb.tokens, with_entropy)

    def _logp_from_logits(self, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool) -> LogProbs:
        """The output layer's logits are this TP rank's vocabulary shard (parallel_output): the
        kernels combine the shards' softmax statistics over the TP group; the padding columns
        (vocabulary padded to a multiple of TP) are left out."""
        shard = logits.shape[-1]
        start = self._groups().tp_rank * shard
        return rl_update.logp_from_logits(
            logits,
            tokens,
            self.temperature,
            with_entropy,
            group=self._pgs.tp if self.tp > 1 else None,
            vocab_start=start,
            valid=max(0, min(shard, self.dims.vocab - start)),
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def apply_gradients(self) -> float:

        # Sums gradients over data parallel, and over tensor parallel those of replicated weights
        # that see only this rank's heads (q/k layernorm). Losses already carry global token counts.
        finalize_model_grads([self.model], None, pg_collection=self._pgs)
        ok, grad_norm, _ = self.optimizer.step()  # clips to trainer.grad_clip
        if not ok:
            log.warning("non-finite gradients: optimizer step skipped")
        return float(grad_norm) if grad_norm is not None else float("nan")

    def _pool(self, batch: TrainBatch) -> tuple[TrainBatch, slice]:
        """Every sample of this rank's model replica — its tensor- and pipeline-parallel ranks —
        (same order on each) and where this rank's own samples are in it."""
        size = self.tp * self.pp
        if size == 1:
            return batch, slice(0, len(batch))
        group = self._groups().mp_group()
        parts: list[Any] = [None] * size
        dist.all_gather_object(parts, batch.to(torch.device("cpu")), group=group)
        start = sum(len(p) for p in parts[: dist.get_rank(group)])
        width = max(p.tokens.shape[1] for p in parts)
        fields: dict[str, Any] = {
            k: (torch.cat([pad_width(getattr(p, k), width) for p in parts]) if v is not None else None)
            for k, v in parts[0].fields().items()
        }
        return TrainBatch(**fields), slice(start, start + len(batch))

    def logprobs(
        self, batch: TrainBatch, reference: bool = False, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pooled, mine = self._pool(batch)
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0" if reference else "trainer not created")
        was_training = model.training
        model.eval()
        if self.pp == 1:
            lp, ent = rl_update.logprobs(self, model, pooled, temperature)
        else:
            sampling, self.temperature = self.temperature, self.temperature if temperature is None else temperature
            try:
                lp, ent = self._pipeline_logprobs(model, pooled)
            finally:
                self.temperature = sampling
        model.train(was_training)
        L = batch.tokens.shape[1]
        return lp[mine, :L], ent[mine, :L]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step over the pooled samples of this rank's model replica."""
        assert self.scheduler is not None
        step = (
            self._pipeline_optimizer_step
            if self.pp > 1
            else (lambda mini, loss_cfg: rl_update.optimizer_step(self, self.model, mini, loss_cfg))
        )
        metrics = rl_update.train_step(self, self._pool(batch)[0], self.seed * 100003 + self.steps, step)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.steps += 1
        return metrics

    # ------------------------------------------------------------------ pipeline parallel

    def _pipeline(self, model: Any, batch: TrainBatch, forward_only: bool, loss_fn: Any) -> list[Any]:
        """megatron's 1F1B schedule over fixed-shape micro-batches of `batch` (the replica's pooled
        batch: the same on every stage). `loss_fn(mb, logits)` runs on the last stage and returns
        (loss, token count, record); the records come back there, in order."""

        size = self.cfg.micro_batch_size
        n, L = batch.tokens.shape
        chunks = [pad_rows(batch.slice(slice(i, i + size)), size, self.pad_id) for i in range(0, n, size)]
        if not chunks:
            return []
        positions = torch.arange(L, device=self.device).expand(size, L)

        def step(data: Any, m: Any) -> Any:
            mb = next(data).to(self.device)
            return m(mb.tokens, positions, attention_mask=None), functools.partial(loss_fn, mb)

        p2p = P2PCommunicator(pp_group=self._pgs.pp, config=_unwrap(model).config)
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=step,
            data_iterator=iter(chunks),
            model=model,
            num_microbatches=len(chunks),
            seq_length=L,
            micro_batch_size=size,
            forward_only=forward_only,
            p2p_communicator=p2p,
            pg_collection=self._pgs,
        )

    @torch.no_grad()
    def _pipeline_logprobs(self, model: Any, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        def record(mb: TrainBatch, logits: torch.Tensor) -> Any:
            lp, ent = self._logp_from_logits(logits, mb.tokens, with_entropy=True)
            assert ent is not None
            return torch.zeros((), device=self.device), torch.tensor(1), torch.stack([lp, ent])

        records = self._pipeline(model, batch, True, record)
        n, L = batch.tokens.shape
        out = torch.empty(2, n, L, device=self.device)
        if self._groups().pp_rank == self.pp - 1 and n:
            out.copy_(torch.cat(records, dim=1)[:, :n])
        dist.broadcast(out, group=self._pgs.pp, group_src=self.pp - 1)  # every stage returns them
        return out[0].cpu(), out[1].cpu()

    def _pipeline_optimizer_step(self, mini: TrainBatch, loss_cfg: PolicyLossConfig) -> dict[str, float]:
        normalizer, total_tokens = rl_update.normalizers(self, mini)
        self.zero_grad()
        self.model.train()

        def loss(mb: TrainBatch, logits: torch.Tensor) -> Any:
            logp, ent = self._logp_from_logits(logits, mb.tokens, with_entropy=True)
            assert ent is not None
            value, stats = rl_update.micro_loss(self.algo, mb, logp, ent, loss_cfg, normalizer)
            return value, torch.tensor(1), stats

        records = self._pipeline(self.model, mini, False, loss)
        grad_norm = self.apply_gradients()
        self.zero_grad()
        acc = torch.zeros(len(rl_update.STATS), dtype=torch.float64, device=self.device)
        if self._groups().pp_rank == self.pp - 1 and records:
            acc += torch.stack(records).sum(0).to(self.device)
        dist.broadcast(acc, group=self._pgs.pp, group_src=self.pp - 1)  # the statistics live on the last stage
        return rl_update.step_stats(self, acc, total_tokens, grad_norm)

    # ------------------------------------------------------------------ weights

    def weight_specs(self) -> list[WeightSpecRow]:
        """(HF name, megatron name, full shape, dtype) of every weight; no collectives."""
        if self._specs is None:
            specs = []
            for name in mcore_names(self.dims):
                full = full_shape(name, self.dims)
                meta = torch.empty(full, dtype=self.dtype, device="meta")
                for hf_name, t in from_mcore(name, meta, self.dims):
                    specs.append((hf_name, name, t.shape, self.dtype))
            self._specs = specs
        return self._specs

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Nothing shared: each tensor-parallel shard is gathered as it is exported, and a
        forward reads its shards where they are."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def export_weights(
        self, names: list[str] | None = None, needs: Needs | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight (or of `names`): a collective over each tensor
        parallel group (every rank iterates to the end with the same names). An expert lives on
        one rank of each EP group: without `needs` it is broadcast to the group; with `needs` it
        goes from that rank only to the ranks that need it (none, where the engine's EP ranks
        are the trainer's), and a rank converts to HF names only what it needs."""
        specs = self.weight_specs()
        wanted = None if names is None else set(names)
        if wanted is not None:
            unknown = sorted(wanted - {s[0] for s in specs})
            if unknown:
                raise KeyError(f"no trainer weight is named {unknown[:5]}")
        source_of = {ck: src for ck, src, _, _ in specs}
        sources = list(dict.fromkeys(source_of[n] for n in (names if names is not None else source_of)))
        local = _weights(_unwrap(self.model))
        per_rank = self.dims.experts // self.ep if self.dims.experts else 0
        if self.pp > 1:
            yield from self._export_stages(sources, local, wanted)
            return
        g = self._groups()
        rank = dist.get_rank()
        keep = None if needs is None else (lambda name: needs(rank, name))
        for src in sources:
            e = expert_of(src)
            routed = e is not None and self.ep > 1
            if keep is not None and not routed and self.tp == 1 and not any(map(keep, self._hf_names(src, wanted))):
                continue  # held whole here (no collective) and not needed here: not converted either
            if e is not None and routed:  # one rank of the EP group holds it
                owner = e // per_rank
                mine = local[local_expert_name(src, e % per_rank)] if owner == g.ep_rank else None
                full = (
                    self._broadcast_full(src, mine, self._pgs.ep, owner)
                    if needs is None
                    else self._send_expert(src, mine, owner, wanted, needs)
                )
                if full is not None:
                    yield from self._pieces(src, full, wanted, keep)
            else:
                yield from self._pieces(src, self._tp_full(src, local[src]), wanted, keep)

    def _hf_names(self, src: str, wanted: set[str] | None) -> list[str]:
        if not self._hf_of:
            for hf_name, mc_name, _, _ in self.weight_specs():
                self._hf_of.setdefault(mc_name, []).append(hf_name)
        return [n for n in self._hf_of[src] if wanted is None or n in wanted]

    def _send_expert(
        self, src: str, mine: torch.Tensor | None, owner: int, wanted: set[str] | None, needs: Needs
    ) -> torch.Tensor | None:
        """Expert weight `src` from its EP rank `owner` to each other EP rank of the group that
        needs it (point to point, every rank in the same order); the tensor on the owner and on
        those ranks, None elsewhere."""
        group = self._pgs.ep
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        hf = self._hf_names(src, wanted)
        to = [i for i, r in enumerate(members) if i != owner and any(needs(r, n) for n in hf)]
        me = self._groups().ep_rank
        if me == owner:
            assert mine is not None
            full = mine.contiguous()
            for i in to:
                dist.send(full, group=group, group_dst=i)
            self.expert_bytes_sent += full.numel() * full.element_size() * len(to)
            return full
        if me not in to:
            return None
        full = torch.empty(full_shape(src, self.dims), dtype=self.dtype, device=self.device)
        dist.recv(full, group=group, group_src=owner)
        return full

    def _export_stages(
        self, sources: list[str], local: dict[str, torch.Tensor], wanted: set[str] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pipeline parallel: the stage that holds a weight gathers it over its TP group and
        broadcasts it to the other stages."""
        pp_rank = self._groups().pp_rank
        for src in sources:
            owner = stage_of(src, self.dims, self.pp)
            mine = self._tp_full(src, local[stage_name(src, self.dims, self.pp)]) if owner == pp_rank else None
            yield from self._pieces(src, self._broadcast_full(src, mine, self._pgs.pp, owner), wanted)

    def _tp_full(self, src: str, part: torch.Tensor) -> torch.Tensor:
        """The whole tensor of this rank's part: gathered over its TP group if TP-sharded."""
        if self.tp == 1 or not is_tp_sharded(src):
            return part.detach()
        parts = [torch.empty_like(part) for _ in range(self.tp)]
        dist.all_gather(parts, part.contiguous(), group=self._groups().tp_group())
        return tp_unshard(src, parts)

    def _broadcast_full(
        self, src: str, mine: torch.Tensor | None, group: dist.ProcessGroup | None, owner: int
    ) -> torch.Tensor:
        """`mine` on the owner (its index in `group`), received by everyone else in the group."""
        full = (
            mine.contiguous()
            if mine is not None
            else torch.empty(full_shape(src, self.dims), dtype=self.dtype, device=self.device)
        )
        dist.broadcast(full, group=group, group_src=owner)
        if mine is not None and group is self._pgs.ep:
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.expert_bytes_sent += full.numel() * full.element_size() * (size - 1)
        return full

    def _pieces(
        self, src: str, full: torch.Tensor, wanted: set[str] | None, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, t in from_mcore(src, full, self.dims):
            if (wanted is None or hf_name in wanted) and (keep is None or keep(hf_name)):
                yield hf_name, t

    def save_pretrained(self, path: str) -> None:
        write_checkpoint(path, self.model_path, self.export_weights(), write=dist.get_rank() == 0)

    # ------------------------------------------------------------------ checkpoints

    def distributed_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's tensors for torch.distributed.checkpoint, by layout-qualified keys: weights
        per TP rank (identical DP replicas are written once), optimizer state per TP rank and,
        with the distributed optimizer, per DP rank. The tensors are the live ones, so a load
        fills the trainer in place. A checkpoint restores at the same TP and DP sizes only (the
        keys name them; another layout fails the load listing the keys it lacks)."""
        g = self._groups()
        layout = f"pp{g.pp_rank}of{self.pp}/tp{g.tp_rank}of{self.tp}"
        experts = f"{layout}/ep{g.ep_rank}of{self.ep}"  # expert weights differ per EP rank
        model = {
            f"{experts if expert_of(n) is not None else layout}/{n}": p
            for n, p in _weights(_unwrap(self.model)).items()
        }
        _ensure_optimizer_state(self.optimizer)  # a fresh optimizer has none yet: give the load its slots
        tensors: list[torch.Tensor] = []
        tensors_in(_optimizer_state(self.optimizer, clone=False), tensors)
        tag = experts if self.ep > 1 else layout
        if self.cfg.distributed_optimizer:
            tag = f"{tag}/dp{g.dp_rank}of{g.layout.dp}"
        return model, {f"{tag}/optimizer/{i}": t for i, t in enumerate(tensors)}

    def load_distributed_state_dict(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        pass  # loaded in place (see distributed_state_dict)

    def host_state(self) -> dict[str, Any]:
        return capture_host_state(self.scheduler, self.steps)

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.steps = restore_host_state(self.scheduler, state)


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)


def _weights(gpt: Any) -> dict[str, torch.Tensor]:
    """Megatron name -> this rank's parameter (module order)."""
    return {n: p for n, p in gpt.named_parameters()}


@torch.no_grad()
def _fill(gpt: Any, state: dict[str, torch.Tensor]) -> None:
    params = _weights(gpt)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"megatron state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit the model's {tuple(p.shape)}")
        p.copy_(src)


def _inner(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside a (possibly chained) one."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_state(optimizer: Any, clone: bool = True) -> list[dict[str, Any]]:
    """This rank's optimizer state, loadable into a fresh optimizer over the same model layout.
    A distributed optimizer's `state_dict()` leaves out the parameter state (it is sharded);
    here the shard's Adam state and fp32 main parameters are taken as they are (`clone=False`:
    the live tensors)."""

    out = []
    for opt in _inner(optimizer):
        if isinstance(opt, DistributedOptimizer):
            main = [
                p.detach().clone() if clone else p.detach()
                for groups in (opt.shard_fp32_groups, opt.shard_fp32_from_float16_groups)
                for g in groups
                for p in g
            ]
            out.append({"inner": opt.optimizer.state_dict(), "main": main})
        else:
            out.append({"wrapper": opt.state_dict()})
    return out


@torch.no_grad()
def _ensure_optimizer_state(optimizer: Any) -> None:
    """Adam's per-parameter state (step, moments) as zeros where none exists yet: the layout a
    trained optimizer has, so a checkpoint of one can be loaded into a fresh one in place."""
    for opt in _inner(optimizer):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if not torch_opt.state[p]:
                    torch_opt.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )


@torch.no_grad()
def _load_optimizer(optimizer: Any, state: list[dict[str, Any]]) -> None:
    opts = _inner(optimizer)
    if len(opts) != len(state):
        raise ValueError(f"optimizer state for {len(state)} optimizers, this one has {len(opts)}")
    for opt, st in zip(opts, state):
        if "wrapper" in st:
            opt.load_state_dict(st["wrapper"])
            continue
        opt.optimizer.load_state_dict(st["inner"])
        mains = [p for groups in (opt.shard_fp32_groups, opt.shard_fp32_from_float16_groups) for g in groups for p in g]
        if len(mains) != len(st["main"]):
            raise ValueError("distributed optimizer shards do not match the captured state")
        for p, saved in zip(mains, st["main"]):
            p.copy_(saved)


class _HostMirror:
    """Page-locked host copies of a nested state, reused while its tensors keep their shapes."""

    def __init__(self) -> None:
        self._arena = PinnedArena()
        self.buffers: list[torch.Tensor] = []

    def copy_in(self, state: Any) -> Any:
        tensors: list[torch.Tensor] = []
        tensors_in(state, tensors)
        fits = len(tensors) == len(self.buffers) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(self.buffers, tensors)
        )
        if not fits:
            self.buffers = []
            self.buffers = self._arena.like(tensors)
        for b, t in zip(self.buffers, tensors):
            b.copy_(t.detach(), non_blocking=True)
        torch.cuda.synchronize()
        it = iter(self.buffers)
        return _map(state, lambda _: next(it))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _to(obj: Any, device: torch.device | str | None) -> Any:
    """A copy of a (nested) optimizer state dict with its tensors on `device` (None: cloned in place)."""
    return _map(obj, lambda t: t.detach().clone() if device is None else t.detach().to(device, copy=True))


__all__ = ["MegatronTrainer"]
