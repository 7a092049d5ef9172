"""`trainer.backend: megatron` — megatron-core's GPTModel, DDP and optimizer behind the Trainer protocol.

It is a peer of the FSDP2 trainer (trainer/fsdp.py): both implement interfaces.Trainer and share
the RL update (trainer/rl_update.py: micro-batching, the loss, statistics, the learning-rate
schedule), and nothing else. What is its own, and where it lives:
  model      GPTModel (local layer spec) built from the HF config (model.py), filled from this
             rank's part of the HF checkpoint (load.py, converted by convert.py); megatron-core
             DDP over the data-parallel group, gradients summed (losses use global token counts)
  optimizer  megatron-core's optimizer (Adam; fp32 main params for bf16 models, grad clipping),
             optionally distributed (state sharded over data parallel); its LR schedule and the
             moving of its state (optimizer.py)
  data       the ranks of a tensor-parallel group hold different samples in the loop; each step
             they pool them (all ranks of a TP group must run the same sequences), log-probs are
             handed back per rank (pipeline.py: pool)
  groups     World handles (model.py); after a world rebuild the modules, DDP and optimizer are
             built again over the new groups and the state is moved in (offloaded or not: an
             offload copies it into page-locked host buffers kept between offloads, host_mirror.py)
  export     each weight gathered over tensor parallel and converted to HF names (export.py)
  checkpoint torch.distributed.checkpoint of this rank's live tensors under layout-qualified keys
             (restored in place, at the same TP/PP/DP/EP sizes); release-train by checkpoint or snapshot

  MoE        Qwen3-MoE and Mixtral on megatron's MoE layer (TP=PP=1), experts optionally split over
             `trainer.expert_parallel_size` data-parallel ranks; export broadcasts each expert
             from the rank that holds it

  pipeline   `trainer.pipeline_parallel_size`: megatron's 1F1B schedule with the RL loss on the
             last stage (log-probs and statistics broadcast back to every stage; pipeline.py);
             each stage loads its layers; export broadcasts each weight from the stage that holds it

Not yet: context parallel, interleaved (virtual) pipeline stages, experts sharded over TP or
PP, MoE models with dense layers, resharding checkpoints to another layout (megatron's
dist_checkpointing would).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from transformers import AutoConfig

from rltrain.algo.losses import PolicyLossConfig
from rltrain.batch import TrainBatch
from rltrain.config import AlgoConfig, TrainerConfig
from rltrain.interfaces import Needs, ProbeRide, Snapshot, WeightSpecRow, World
from rltrain.runtime.dtypes import resolve_dtype
from rltrain.runtime.ledger import HeldTensors
from rltrain.runtime.memory import free_cuda_caches
from rltrain.trainer import rl_update
from rltrain.trainer.megatron.convert import dims, expert_of
from rltrain.trainer.megatron.export import WeightExport
from rltrain.trainer.megatron.host_mirror import HostMirror, copied
from rltrain.trainer.megatron.load import fill, hf_state
from rltrain.trainer.megatron.model import MegatronGroups, build_gpt, gpt_of, weights_of
from rltrain.trainer.megatron.optimizer import (
    Schedule,
    build_optimizer,
    ensure_optimizer_state,
    load_optimizer_state,
    optimizer_state,
)
from rltrain.trainer.megatron.pipeline import Pipeline, pool
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
        self.scheduler: Schedule | None = None
        self.steps = 0
        self.groups: MegatronGroups | None = None
        self._generation: int | None = None  # the world generation the modules were built on
        self._pgs: Any = None  # megatron ProcessGroupCollection of that generation
        self._parked: dict[str, Any] | None = None  # the captured state while offloaded
        self._host: HostMirror | None = None  # page-locked buffers offloads copy into (GPU)
        self._rebuilds = 0  # re-assemblies after a world rebuild (a full gc every GC_EVERY)
        self._export = WeightExport(self.dims, self.tp, self.ep, self.pp, self.dtype, self.device)

    sharded = True  # its collectives always run over the world's groups

    @property
    def released(self) -> bool:
        return self.model is None and self._parked is None

    @property
    def offloaded(self) -> bool:
        return self._parked is not None

    @property
    def expert_bytes_sent(self) -> int:
        """Bytes of expert weights this rank sent to other EP ranks in exports (all of them so far)."""
        return self._export.expert_bytes_sent

    def _groups(self) -> MegatronGroups:
        if self.groups is None:
            raise RuntimeError("the megatron trainer is not created yet")
        return self.groups

    # ------------------------------------------------------------------ lifecycle

    def create(self, load_weights: bool = True) -> None:
        if self.groups is None:
            self.groups = MegatronGroups(self.world, self.tp, self.ep, self.pp)
        self._seed()
        hf = self._hf_state() if load_weights else None
        self._assemble({"model": hf, "optimizer": None, "reference": hf if self.algo.kl_coef > 0 else None})
        self._parked = None

    def _seed(self) -> None:

        g = self._groups()
        tensor_parallel.model_parallel_cuda_manual_seed(
            self.seed, tp_rank=g.tp_rank, ep_rank=g.ep_rank, etp_rank=g.tp_rank
        )

    def _hf_state(self) -> dict[str, torch.Tensor]:
        return hf_state(self.model_path, self.dims, self._groups())

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
            fill(gpt, state["model"])
        dist_opt = self.cfg.distributed_optimizer
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=dist_opt
        )
        self.model = DistributedDataParallel(gpt.config, ddp_cfg, gpt, pg_collection=pgs)
        self.model.train()
        self.optimizer = build_optimizer(self.cfg, self.dtype, self.model, pgs)
        if state.get("optimizer") is not None:
            load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler = Schedule(
            self.optimizer, self.cfg.lr, lambda step: rl_update.lr_factor(self.cfg, self.total_steps, step)
        )
        if "scheduler" in state:
            self.load_host_state(state)
        self.ref_model = None
        if state.get("reference") is not None:
            ref = self._gpt().eval()
            ref.requires_grad_(False)
            fill(ref, state["reference"])
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

    def stage_offload(self, keep: int | None = None) -> None:
        """Nothing begins early: `offload` captures and drops the whole state at once."""
        _whole_state(keep)

    def offload(self, keep: int | None = None) -> None:
        """Weights, optimizer state (and the reference) to page-locked host memory; the modules
        are dropped (megatron's parallel state is rebuilt with the world: see `_assemble`).
        All of it: a budget (`keep`, loop.offload_trainer=fit) is the fsdp backend's."""
        _whole_state(keep)
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
            "model": weights_of(gpt_of(self.model)),
            "optimizer": optimizer_state(self.optimizer),
            "reference": weights_of(self.ref_model) if with_reference and self.ref_model is not None else None,
        }
        if to_host and self.device.type == "cuda":
            if self._host is None:
                self._host = HostMirror()
            state = self._host.copy_in(state)
        else:
            state = copied(state, "cpu" if to_host else None)
        return {**state, **self.host_state()}

    def _rebuild(self, state: dict[str, Any]) -> None:
        self._seed()
        self._assemble(state)  # torch's optimizer load_state_dict moves the state to its params' device
        if self.algo.kl_coef > 0 and self.ref_model is None:
            self.ref_model = self._gpt().eval()
            self.ref_model.requires_grad_(False)
            fill(self.ref_model, self._hf_state())

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
        return pool(batch, self._groups().mp_group(), size)

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

    @property
    def rides_probe(self) -> bool:
        """A training forward scores the probe as `logprobs` would: at temperature 1 (dropout is
        off in the model megatron builds), and not pipelined (the pipeline's micro-batches are
        its own)."""
        return self.temperature == 1.0 and self.pp == 1

    def train_step(self, batch: TrainBatch, probe: ProbeRide | None = None) -> dict[str, float]:
        """One RL step over the pooled samples of this rank's model replica; `probe` rides its
        first micro-batch (`ProbeRide`)."""
        assert self.scheduler is not None
        assert probe is None or self.rides_probe
        step: rl_update.OptimizerStep = (
            self._pipeline_optimizer_step
            if self.pp > 1
            else (lambda mini, loss_cfg, ride: rl_update.optimizer_step(self, self.model, mini, loss_cfg, ride))
        )
        metrics = rl_update.train_step(self, self._pool(batch)[0], self.seed * 100003 + self.steps, step, probe)
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.steps += 1
        return metrics

    # ------------------------------------------------------------------ pipeline parallel

    def _pipeline(self) -> Pipeline:
        return Pipeline(self._pgs, self._groups().pp_rank, self.pp, self.cfg.micro_batch_size, self.pad_id, self.device)

    @torch.no_grad()
    def _pipeline_logprobs(self, model: Any, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        def score(mb: TrainBatch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            lp, ent = self._logp_from_logits(logits, mb.tokens, with_entropy=True)
            assert ent is not None
            return lp, ent

        return self._pipeline().logprobs(model, batch, score)

    def _pipeline_optimizer_step(
        self, mini: TrainBatch, loss_cfg: PolicyLossConfig, probe: ProbeRide | None = None
    ) -> dict[str, float]:
        assert probe is None, "a pipelined trainer does not ride the probe (rides_probe)"
        normalizer, total_tokens = rl_update.normalizers(self, mini)
        self.zero_grad()
        self.model.train()

        def loss(mb: TrainBatch, logits: torch.Tensor) -> Any:
            logp, ent = self._logp_from_logits(logits, mb.tokens, with_entropy=True)
            assert ent is not None
            value, stats = rl_update.micro_loss(self.algo, mb, logp, ent, loss_cfg, normalizer)
            return value, torch.tensor(1), stats

        pipeline = self._pipeline()
        records = pipeline.run(self.model, mini, False, loss)
        grad_norm = self.apply_gradients()
        self.zero_grad()
        acc = pipeline.last_stage_sum(records, len(rl_update.STATS))  # the statistics live on the last stage
        return rl_update.step_stats(self, acc, total_tokens, grad_norm)

    # ------------------------------------------------------------------ weights

    def weight_specs(self) -> list[WeightSpecRow]:
        """(HF name, megatron name, full shape, dtype) of every weight; no collectives."""
        return self._export.specs()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """Nothing shared: each tensor-parallel shard is gathered as it is exported, and a
        forward reads its shards where they are."""
        return contextlib.nullcontext()

    def export_weights(
        self, names: list[str] | None = None, needs: Needs | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight (or of `names`): a collective over each tensor
        parallel group (every rank iterates to the end with the same names). An expert lives on
        one rank of each EP group: without `needs` it is broadcast to the group; with `needs` it
        goes from that rank only to the ranks that need it (none, where the engine's EP ranks
        are the trainer's), and a rank converts to HF names only what it needs (export.py)."""
        # (A generator: the model and groups are read when the export starts, as they are then.)
        yield from self._export.weights(self.model, self.groups, self._pgs, names, needs)

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
            for n, p in weights_of(gpt_of(self.model)).items()
        }
        ensure_optimizer_state(self.optimizer)  # a fresh optimizer has none yet: give the load its slots
        tensors: list[torch.Tensor] = []
        tensors_in(optimizer_state(self.optimizer, clone=False), tensors)
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


__all__ = ["MegatronTrainer"]


def _whole_state(keep: int | None) -> None:
    if keep:
        raise ValueError(
            "megatron's offload drops its modules and moves the whole state; loop.offload_trainer=fit "
            "(a part kept on the device) is trainer.backend=fsdp's: use loop.offload_trainer=true"
        )
