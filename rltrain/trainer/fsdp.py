"""`trainer.backend: fsdp` — a transformers causal LM, AdamW, FSDP2 data parallel.

Data parallelism. Under torch.distributed the model is sharded with FSDP2 (`fully_shard`) over
the world's *current* default group, gloo on CPU and NCCL on GPU; every rank trains on its own
samples (the RL update is trainer/rl_update.py). FSDP binds a module to its group, and the world
destroys that group between steps: `onload` re-binds the modules to the rebuilt group, or
re-shards fresh ones from the local shards where it cannot (`sharding.py`).

Offload keeps the modules and parks their storages in one page-locked host buffer
(`host_park.HostPark`), all of them or, with a budget (`keep`), the optimizer state first; the
optimizer state's copies run beside the sync and the next forward (`stage_offload`). Release
drops everything, and the trainer is re-created from a checkpoint (`create(load_weights=False)` +
the checkpoint) or from a host snapshot (`restore_snapshot`).

The model is the one transformers builds, with the changes of `causal_lm.py` (the log-prob head,
compiled blocks); its export gathers whole tensors in chunks and converts them to checkpoint
names (weights/names.py). It is built on the meta device and sharded before it is allocated, and
each rank reads only its own shards of the checkpoint (weights/hf_sharded.py): no rank ever holds
the whole model, on the device or in host memory.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from rltrain.algo.losses import PolicyLossConfig
from rltrain.batch import TrainBatch
from rltrain.config import AlgoConfig, TrainerConfig
from rltrain.interfaces import Needs, ProbeRide, Snapshot, WeightSpecRow
from rltrain.runtime import internals
from rltrain.runtime.dtypes import resolve_dtype
from rltrain.runtime.ledger import HeldTensors
from rltrain.runtime.memory import free_cuda_caches
from rltrain.trainer import rl_update
from rltrain.trainer.causal_lm import LogprobHead, compile_blocks, outside_graphs
from rltrain.trainer.host_park import HostPark, leaving_order
from rltrain.trainer.rl_update import LogProbs
from rltrain.trainer.sharding import (
    capture,
    current_group,
    free_storage,
    full_tensor,
    full_tensors,
    gather_chunks,
    load,
    one_unit,
    rebind,
    reshard,
    shard,
)
from rltrain.trainer.state import GC_EVERY, capture_host_state, held, restore_host_state, return_memory, timed
from rltrain.weights.hf_files import write_checkpoint
from rltrain.weights.hf_sharded import compute_buffers, load_hf_checkpoint
from rltrain.weights.names import checkpoint_specs, module_weights, to_checkpoint

log = logging.getLogger("rltrain.trainer")

GATHER_BYTES = 1 << 30  # whole tensors gathered at once by export_weights: above a sync bucket (512 MiB)
# On the CPU a gather's staging buffer is fresh pages, dear per byte, and a gloo call is dear per
# call: chunks this small keep the pages few and still gather a small model in one call.
GATHER_BYTES_CPU = 8 << 20


class FSDPTrainer:
    """The torch-native trainer (interfaces.Trainer). Under torch.distributed the model (and the
    reference model) is sharded with FSDP2 over the world's current default group; without it,
    a plain module."""

    # False: after a world rebuild, re-shard fresh modules from the local shards instead of
    # re-binding the kept ones (the fallback that a refused rebind takes; the tests run it so).
    rebinds = True
    # True: offload parks the state on the CPU too, in plain host memory (the tests of what moves
    # and of the order of the overlapped copies); on a CPU device offload is otherwise a no-op.
    parks_on_cpu = False

    def __init__(
        self,
        cfg: TrainerConfig,
        algo: AlgoConfig,
        model_path: str,
        device: torch.device,
        seed: int = 0,
        total_steps: int = 1,
        temperature: float = 1.0,
        pad_id: int = 0,
    ):
        self.cfg, self.algo = cfg, algo
        self.total_steps = total_steps
        # Log-probs are taken at the sampling temperature, as the engine reports them.
        self.temperature = temperature
        self.timings: dict[str, float] = {}  # seconds of the parts of the last offload / onload
        self.model_path = model_path
        self.device = device
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.seed = seed
        self.pad_id = pad_id
        self.model: PreTrainedModel | None = None
        self.ref_model: PreTrainedModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.steps = 0
        self._group: dist.ProcessGroup | None = None  # the process group the modules are sharded over
        self._park: HostPark | None = None  # the host copy of the storages while offloaded in place
        self._reshards = 0  # re-shards of fresh modules (a full gc every GC_EVERY)
        self._rebind_refused = False  # rebind said no once: said in the log once
        self._hf_config = AutoConfig.from_pretrained(model_path)
        self._specs: list[WeightSpecRow] | None = None
        # From `_specs`: checkpoint name -> module tensor, and the module tensors stored converted.
        self._sources: tuple[dict[str, str], set[str]] | None = None
        self._module_tensors: dict[str, torch.Tensor] | None = None  # of `self.model`; cleared with it
        self._gathered: dict[str, torch.Tensor] | None = None  # inside `gathered()`: the full tensors

    @property
    def sharded(self) -> bool:
        """Whether the ranks run collectives together (a forward all-gathers): not inside
        `gathered()`, where every rank holds every weight and scores on its own."""
        return dist.is_initialized() and self._gathered is None

    @property
    def released(self) -> bool:
        return self.model is None

    @property
    def offloaded(self) -> bool:
        return bool(self._park is not None and self._park.parked)

    # ------------------------------------------------------------------ lifecycle

    def create(self, load_weights: bool = True) -> None:
        """Build model, reference model and optimizer. `load_weights=False`: architecture only,
        for a re-creation that restores its state from a checkpoint next."""
        self._module_tensors = None
        self.model = self._build("checkpoint" if load_weights else "empty")
        self.ref_model = self._build_reference()
        self._new_optimizer()
        self._group = current_group()
        self._park = None

    @property
    def attention(self) -> str:
        """transformers' attn_implementation: `trainer.attention`, where auto means its default,
        except for packed micro-batches on a GPU: flex attention, which skips the blocks across
        sequences (SDPA computes the whole row's masked attention: slower than padding on long
        packed rows, see BENCHMARKS.md)."""
        if self.cfg.attention == "auto" and self.cfg.max_tokens_per_micro_batch and self.device.type == "cuda":
            return "flex_attention"
        return self.cfg.attention

    def _build(self, init: str) -> PreTrainedModel:
        """init: "checkpoint" (weights from model_path, each rank reading only its own shards:
        weights/hf_sharded.py), "empty" (allocated, no random init; buffers computed), "meta"
        (allocated, nothing computed; filled by `sharding.load`). Built on the meta device and
        sharded before anything is allocated: no rank ever holds the whole model."""
        attention = {"attn_implementation": self.attention} if self.attention != "auto" else {}
        if self.cfg.compile and self.attention == "flex_attention":
            attention["attn_implementation"] = outside_graphs("flex_attention")
        # No init: the state is read or restored next. fork_rng: whatever init transformers still
        # runs must not move the global RNG of a run.
        with (
            torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []),
            internals.no_init_weights(),
            torch.device("meta"),
        ):
            model = AutoModelForCausalLM.from_config(self._hf_config, dtype=self.dtype, **attention)
        # no_init_weights skips tying, and `to_empty` makes a plain module's parameters anew, one
        # per module: tied before sharding (FSDP2 keeps one parameter for both modules) and after.
        model.tie_weights()
        head = model.get_output_embeddings()
        if LogprobHead.fits(head, model.config):
            model.set_output_embeddings(LogprobHead(head))
        if self.cfg.compile:
            compile_blocks(model)
        if self.sharded:
            shard(model, self.device)
        model.to_empty(device=self.device)
        model.tie_weights()
        if init == "checkpoint":
            load_hf_checkpoint(model, self.model_path)
        elif init == "empty":
            compute_buffers(model)
        return model

    def _build_reference(self) -> PreTrainedModel | None:
        if self.algo.kl_coef <= 0:
            return None
        # The reference is always the initial checkpoint, also after a re-creation.
        ref = self._build("checkpoint").eval()
        ref.requires_grad_(False)
        return ref

    def _new_optimizer(self) -> None:
        model = self._live_model()
        model.train()
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=self.cfg.lr,
            betas=(self.cfg.beta1, self.cfg.beta2),
            eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay,
            # On the CPU the fused kernel: the foreach path dispatches op by op over FSDP2's
            # DTensors (measured slower on a quickstart step). GPUs keep foreach.
            fused=True if self.device.type == "cpu" else None,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: rl_update.lr_factor(self.cfg, self.total_steps, step)
        )

    def _live_model(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("the trainer is released: create() or restore_snapshot() it first")
        return self.model

    def release(self) -> None:
        """Drop model, reference, optimizer (with grads and state) and allocator caches entirely.
        Re-create with `create(load_weights=False)` + a checkpoint, or `restore_snapshot`."""
        if self._park is not None:
            self._park.drain()
        self._free()
        self._drop()
        self._park = None
        return_memory(self.device)

    def _drop(self) -> None:
        self.model = self.ref_model = self.optimizer = self.scheduler = None
        self._module_tensors = None

    def _free(self) -> None:
        """Empty the modules' storage (see sharding.free_storage); call only right before `_drop`."""
        for module in (self.model, self.ref_model):
            if module is not None:
                free_storage(module)

    # ------------------------------------------------------------------ memory ledger

    def held_tensors(self) -> HeldTensors:
        """Every tensor this trainer holds, by kind, wherever it is; the offload buffer (which
        holds the weights and optimizer state while offloaded) is spare host memory."""
        spare = [self._park.buffer] if self._park is not None and self._park.buffer is not None else []
        return held((self.model, self.ref_model), self.optimizer, spare=spare)

    # ------------------------------------------------------------------ offload

    def _parks(self) -> bool:
        return (self.device.type == "cuda" or self.parks_on_cpu) and not self.released

    def _groups(self) -> list[list[torch.Tensor]]:
        return leaving_order(self.model, self.ref_model, self.optimizer)

    def stage_offload(self, keep: int | None = None) -> None:
        """Begin the offload right after the optimizer step: choose what moves (the optimizer
        state, the reference's weights, the policy's) so that at most `keep` bytes stay (None:
        nothing), and start the optimizer state's copy out, beside the checkpoint and the sync
        (back behind the weights at the onload); `offload` finishes it."""
        if self._parks() and not self.offloaded:
            self._to_park().stage(self._groups(), None if self._keep_refused else keep, ahead=1)

    def _to_park(self) -> HostPark:
        """The park, its late copies settled, the modules resharded: what is there is what moves.
        The root keeps its gathered parameters after a forward without backward. Resharding is
        local (a no-op on a plain module), so it is not decided from `dist.is_initialized()`,
        which the world's background teardown (runtime/world.py) may be flipping right now."""
        for module in (self.model, self.ref_model):
            if module is not None:
                reshard(module)
        if self._park is None:
            self._park = HostPark(self.device.type)
        self._park.settle()
        return self._park

    def offload(self, keep: int | None = None) -> None:
        """Params and optimizer state (and the reference) to pinned host memory, and every GPU
        byte returned; `keep`: at most that many bytes of them stay (the optimizer state leaves
        first). What `stage_offload` began is finished instead. Gradients are freed after each
        optimizer step, so there are none to move. A no-op on a CPU device. The modules are kept,
        their storages emptied in place (`host_park.HostPark`); `onload` refills them and, after
        a world rebuild, re-binds them to the new group."""
        if not self._parks() or self.offloaded:
            return
        keep = None if self._keep_refused else keep
        with timed(self.timings, "offload: choose what moves", self.device):
            park = self._to_park()
            if not park.staged:  # (fit: `stage_offload` chose after the optimizer step)
                park.stage(self._groups(), keep)
        with timed(self.timings, "offload: copy to host", self.device):
            park.park()
        self.timings["offload: copies on the device"] = park.device_s
        with timed(self.timings, "offload: return memory to the device", self.device):
            free_cuda_caches()
        if self.device.type == "cuda" and park.kept:
            park.all_if_stranded(self._groups(), self.device)  # (what stayed strands freed memory: all moves)

    @property
    def _keep_refused(self) -> bool:
        """Kept parts stranded freed memory twice (`HostPark.refuses_keep`): every offload moves all."""
        return self._park is not None and self._park.refuses_keep

    def _settle(self) -> None:
        """The optimizer state that came back behind the weights is there for what runs next."""
        if self._park is not None:
            self._park.settle()

    def trim(self) -> None:
        """Hand the allocator's cached blocks (the last step's activations) back to the device,
        keeping the state. The loop calls it after the train step when the trainer is put away
        after the step anyway: the engine takes its weights back next, and on a full GPU it would
        not fit beside the trainer's cache."""
        if self.device.type == "cuda":
            free_cuda_caches()

    def _stale(self) -> bool:
        """Whether the modules were built on groups the world has destroyed since."""
        return self.sharded and self.model is not None and self._group is not current_group()

    def onload(self) -> None:
        """Back on the device, sharded over the current default group. A sharded trainer whose
        group was destroyed since (a world rebuild) is re-bound to the new group (offloaded or
        not), or, where FSDP2 cannot be re-bound, re-sharded from its local shards."""
        if self._park is not None and self._park.parked:
            overlap = self._park.ahead > 0  # the optimizer state comes back beside the forward (`_settle`)
            with timed(self.timings, "onload: copy to device", self.device, stream_only=overlap):
                self._park.unpark(overlap)
            self.timings["onload: allocate"] = self._park.allocate_s
        # What is timed from here on waits for the caller's stream only while those copies run.
        beside = self._park is not None and self._park.copying
        if not self._stale():
            return
        group = current_group()
        assert group is not None  # (stale: sharded, so under torch.distributed)
        if self.rebinds:
            with timed(self.timings, "onload: re-bind to the new group", self.device, stream_only=beside):
                why = self._rebind(group)
            if why is None:
                self._group = group
                return
            if not self._rebind_refused:
                log.warning("trainer: re-sharding fresh modules after each world rebuild (slower): %s", why)
                self._rebind_refused = True
        self._reshard_fresh()

    def _rebind(self, group: dist.ProcessGroup) -> str | None:
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
        self._reshards += 1
        if self._reshards % GC_EVERY == 0:
            gc.collect()

    def _capture(self, to_host: bool, with_reference: bool) -> Snapshot:
        self._settle()
        pin = to_host and self.device.type == "cuda"
        state: Snapshot = {"model": capture(self._live_model(), self.optimizer, to_host, pin), **self.host_state()}
        if with_reference and self.ref_model is not None:
            state["reference"] = capture(self.ref_model, None, to_host, pin)
        return state

    def _rebuild(self, state: Snapshot) -> None:
        """Fresh modules sharded over the current group, filled from a capture."""
        self._drop()
        with timed(self.timings, "onload: build and shard modules", self.device):
            self.model = self._build("meta")
            self._new_optimizer()
        with timed(self.timings, "onload: copy to device", self.device):
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

    # ------------------------------------------------------------------ the RL update (rl_update.Backend)

    def forward_logp(self, model: Any, mb: TrainBatch, with_entropy: bool) -> LogProbs:
        """[B, L] log-probs (and entropies) of `mb`'s tokens. Padding-free
        (`max_tokens_per_micro_batch`): the sequences run as one packed row, so neither the
        padding nor attention across sequences is computed, and the result is laid out as the
        padded path's."""
        valid = None
        tokens, inputs = mb.tokens, {"attention_mask": mb.attention_mask}
        if self.cfg.max_tokens_per_micro_batch:
            tokens, position_ids, valid = rl_update.packed(mb)
            inputs = {"position_ids": position_ids}
        head = model.get_output_embeddings()
        if not isinstance(head, LogprobHead):
            out = model(input_ids=tokens, use_cache=False, **inputs)
            logp, ent = rl_update.logp_from_logits(out.logits, tokens, self.temperature, with_entropy)
        else:
            targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))  # the last position's is a dummy
            with head.scoring(targets, self.temperature):
                out = model(input_ids=tokens, use_cache=False, **inputs)
            logp, ent = (torch.nn.functional.pad(x[:, :-1], (1, 0)) for x in out.logits.unbind(-1))
        if valid is not None:
            logp, ent = rl_update.unpacked(logp, valid), None if ent is None else rl_update.unpacked(ent, valid)
        return logp, ent if with_entropy else None

    def data_group(self) -> dist.ProcessGroup | None:
        return None  # every rank holds different samples

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def apply_gradients(self) -> float:
        assert self.optimizer is not None
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self._live_model().parameters(), self.cfg.grad_clip))
        if not torch.isfinite(grad_norm):
            log.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
        else:
            self._settle()
            self.optimizer.step()
        return float(grad_norm)

    def logprobs(
        self, batch: TrainBatch, reference: bool = False, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [B, L] (and entropy) of the policy, or of the reference model, at
        the sampling temperature (or `temperature`). Sharded: a collective (every rank calls it,
        with however many samples it has)."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs need algo.kl_coef > 0" if reference else "trainer not created")
        was_training = model.training
        model.eval()
        out = rl_update.logprobs(self, model, batch, temperature)
        if self.sharded:
            reshard(model)  # no backward follows: do not keep the root's gathered parameters
        model.train(was_training)
        return out

    @property
    def rides_probe(self) -> bool:
        """A training forward scores the probe as `logprobs` would: at temperature 1, no dropout."""
        return self.temperature == 1.0 and not rl_update.dropout_in(self._hf_config)

    def train_step(self, batch: TrainBatch, probe: ProbeRide | None = None) -> dict[str, float]:
        """One RL step: `ppo_epochs` passes over `mini_batches` mini-batches, one optimizer step
        each; `probe` rides the first (`ProbeRide`)."""
        model = self._live_model()
        assert self.scheduler is not None
        assert probe is None or self.rides_probe
        rl_update.make_optimizer_state(self.optimizer)  # (before the first step's activations exist)

        def step(mini: TrainBatch, loss_cfg: PolicyLossConfig, ride: ProbeRide | None) -> dict[str, float]:
            return rl_update.optimizer_step(self, model, mini, loss_cfg, ride)

        metrics = rl_update.train_step(self, batch, self.seed * 100003 + self.steps, step, probe)
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        self.scheduler.step()
        self.steps += 1
        return metrics

    # ------------------------------------------------------------------ weights and state

    def weight_specs(self) -> list[WeightSpecRow]:
        """(checkpoint name, module name, full shape, dtype) of every weight, tied ones once; no
        collectives. Checkpoint names are what engines load (per-expert MoE names included).
        Computed once: the architecture never changes, and every bucket of every sync asks."""
        if self._specs is None:
            self._specs = checkpoint_specs(self._live_model())
        return self._specs

    def export_weights(
        self, names: list[str] | None = None, needs: Needs | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, full tensor) of every weight (or of `names`, in their order of module
        tensors), in the training dtype, on the trainer's device, detached. Sharded, a collective
        (inside `gathered()`, not): every rank iterates it to the end with the same `names`. With
        `needs`, a rank yields only the names it needs: FSDP2 shards every tensor over every rank,
        so each still joins every all-gather, but what no one on this rank needs is never
        converted to checkpoint names (a fused expert tensor's other experts are not split out).
        (Not a no_grad generator: that enters and leaves no_grad around every item, on every
        bucket of every sync; the gather runs under no_grad and what it yields is detached.)"""
        model = self._live_model()
        if self._sources is None:
            specs = self.weight_specs()
            self._sources = ({ck: src for ck, src, _, _ in specs}, {src for ck, src, _, _ in specs if ck != src})
        source_of, converted = self._sources
        rank = dist.get_rank() if dist.is_initialized() else 0
        mine = None if needs is None else (lambda name: needs(rank, name))
        wanted = None if names is None else set(names)
        if wanted is not None:
            unknown = sorted(n for n in wanted if n not in source_of)
            if unknown:
                raise KeyError(f"no trainer weight is named {unknown[:5]}")
        for src, full in self._full_tensors(model, names, source_of):
            if src not in converted:
                if mine is None or mine(src):
                    yield src, full
                continue
            for name, t in to_checkpoint(model, src, full, keep=mine):
                if wanted is None or name in wanted:
                    yield name, t

    def _full_tensors(
        self, model: torch.nn.Module, names: list[str] | None, source_of: dict[str, str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(module name, full tensor, detached) of the module tensors `names` come from (all
        without `names`), in order: from `gathered()`'s weights, or one all-gather per chunk of
        them (smaller chunks on the CPU). Sharded and not gathered, a collective."""
        gathered = self._gathered
        if gathered is None and self._module_tensors is None:  # walking the module tree is dear per bucket
            self._module_tensors = dict(module_weights(model))
        tensors = gathered if gathered is not None else self._module_tensors
        assert tensors is not None
        sources = list(tensors) if names is None else list(dict.fromkeys(source_of[n] for n in names))
        if gathered is not None:  # whole already: no collective
            for src in sources:
                yield src, tensors[src].detach()
            return
        budget = GATHER_BYTES if self.device.type == "cuda" else GATHER_BYTES_CPU
        for chunk in gather_chunks(sources, tensors, budget):
            with torch.no_grad():
                fulls = full_tensors([tensors[src] for src in chunk])
            for src in chunk:
                yield src, fulls.pop(0).detach()  # popped: each is freed once its consumer lets go

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Where the model is one FSDP unit (the CPU's, `sharding.shard`), its weights gathered
        once for what runs inside: a sync exports every weight and then scores its probe, one
        all-gather where each took its own. Resharded on leaving. Elsewhere (per-block units on
        GPUs: gathering them all at once would hold the whole model; not sharded: nothing to
        gather) it changes nothing. A collective on entry."""
        model = self._live_model()
        if not self.sharded or not one_unit(self.device):
            yield
            return
        assert isinstance(model, FSDPModule), "a sharded trainer's model is an FSDP2 module"
        model.unshard()  # FSDP2 puts the full parameters on the modules until `reshard`
        try:
            self._gathered = dict(module_weights(model))
            yield
        finally:
            self._gathered = None
            reshard(model)

    def save_pretrained(self, path: str) -> None:
        """An HF checkpoint directory (config + sharded safetensors + index) written by rank 0,
        loadable by `from_pretrained`. Sharded, a collective."""
        write_checkpoint(
            path, self.model_path, self.export_weights(), write=not dist.is_initialized() or dist.get_rank() == 0
        )

    # -------------------------------------------------------------- checkpoint state

    def distributed_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """FQN-keyed model and optimizer state (sharded DTensors) for torch.distributed.checkpoint."""
        assert self.optimizer is not None
        self._settle()
        return get_state_dict(self._live_model(), self.optimizer)

    def load_distributed_state_dict(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        assert self.optimizer is not None
        self._settle()
        set_state_dict(self._live_model(), self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def host_state(self) -> dict[str, Any]:
        return capture_host_state(self.scheduler, self.steps)

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.steps = restore_host_state(self.scheduler, state)

    def snapshot(self) -> Snapshot:
        """A host-memory copy (pinned on GPU) of this rank's shard of everything needed to
        re-create the trainer; the reference model is re-read from its checkpoint instead."""
        return self._capture(to_host=True, with_reference=False)

    def restore_snapshot(self, snap: Snapshot) -> None:
        """Re-create a released trainer from `snapshot()`, sharded over the current group."""
        self._rebuild(snap)
