"""megatron-core GPT models built from HF configs, over process groups from rltrain's World.

Process groups. Megatron's modules keep the groups they were built with. rltrain destroys and
rebuilds every group between phases, so the groups are made once through `World.new_group`
(handles that the World re-creates on every rebuild) and handed to megatron-core as a
`ProcessGroupCollection` (megatron-core's own way to pass groups in, instead of its global
`parallel_state`). After a rebuild the trainer builds its modules again from the handles' new
groups and moves its state into them, as the FSDP2 trainer does (trainer/sharding.py).

Rank layout: tensor parallel fastest, then data parallel, then pipeline — rank = pp_rank * tp * dp
+ dp_rank * tp + tp_rank, Megatron's default order (context parallel has size 1; expert parallel
splits the data-parallel ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_config import TransformerConfig

from rltrain.interfaces import Group, World
from rltrain.trainer.megatron.convert import (
    ConversionError,
    dims,
    is_tp_sharded,
    tp_partition_dim,
    transformer_config_kwargs,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class RankLayout:
    """rank = pp_rank * (tp * dp) + dp_rank * tp + tp_rank (Megatron's default order)."""

    tp: int
    dp: int
    pp: int = 1

    @classmethod
    def of(cls, world_size: int, tp: int, pp: int = 1) -> RankLayout:
        if tp < 1 or pp < 1 or world_size % (tp * pp):
            raise ValueError(
                f"trainer.tensor_parallel_size={tp} x trainer.pipeline_parallel_size={pp} must divide "
                f"the world size {world_size}"
            )
        return cls(tp, world_size // (tp * pp), pp)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.tp * self.dp + dp * self.tp + tp

    def tp_ranks(self, dp_rank: int, pp_rank: int = 0) -> list[int]:
        return [self.rank(pp_rank, dp_rank, t) for t in range(self.tp)]

    def dp_ranks(self, tp_rank: int, pp_rank: int = 0) -> list[int]:
        return [self.rank(pp_rank, d, tp_rank) for d in range(self.dp)]

    def pp_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank(p, dp_rank, tp_rank) for p in range(self.pp)]

    def mp_ranks(self, dp_rank: int) -> list[int]:
        """One model replica: its tensor- and pipeline-parallel ranks (they see the same samples)."""
        return sorted(self.rank(p, dp_rank, t) for p in range(self.pp) for t in range(self.tp))


class MegatronGroups:
    """This rank's tensor-, data-, pipeline- and expert-parallel groups as World handles
    (collective to create).

    Only groups that need a communicator of their own get one: a group of every rank is the
    world's default group, and groups of one rank (context parallel here, and TP/PP/EP when
    their size is 1) are gloo groups: every NCCL communicator is slow to tear down at each world
    destroy, and the engine waits for that before it takes its memory back."""

    def __init__(self, world: World, tp: int, ep: int = 1, pp: int = 1):
        L = self.layout = RankLayout.of(world.world_size, tp, pp)
        self.world = world
        rank = world.rank
        self.tp_rank, self.dp_rank, self.pp_rank = rank % tp, (rank // tp) % L.dp, rank // (tp * L.dp)
        if ep > 1 and (tp != 1 or pp != 1 or L.dp % ep):
            raise ValueError(
                f"trainer.expert_parallel_size={ep} needs tensor and pipeline parallel size 1 and must "
                f"divide the data-parallel size {L.dp}"
            )
        self.ep_size, self.ep_rank = ep, self.dp_rank % ep
        own = self._mine(world, [[r] for r in range(world.world_size)], "megatron self", backend="gloo")
        assert own is not None  # (a group for every rank)
        self.own = own
        stages = range(pp)
        self.tp = self._parallel(
            world, [L.tp_ranks(d, p) for p in stages for d in range(L.dp)], "megatron tp", single_ok=True
        )
        # DDP reduces gradients over DP with coalesced collectives, which gloo lacks: a DP group
        # of one rank is still a group of the world's backend.
        self.dp = self._parallel(
            world, [L.dp_ranks(t, p) for p in stages for t in range(tp)], "megatron dp", single_ok=False
        )
        self.pp = self._parallel(
            world, [L.pp_ranks(d, t) for d in range(L.dp) for t in range(tp)], "megatron pp", single_ok=True
        )
        self.mp = (
            self.tp
            if pp == 1
            else self._parallel(world, [L.mp_ranks(d) for d in range(L.dp)], "megatron mp", single_ok=True)
        )
        # The first and last stage of each pipeline share the embedding (tied heads); with PP=2
        # that is the pipeline group itself.
        self.embd = (
            self.own
            if pp == 1
            else self.pp
            if pp == 2
            else self._parallel(
                world,
                [[g[0], g[-1]] for g in (L.pp_ranks(d, t) for d in range(L.dp) for t in range(tp))],
                "megatron embd",
                single_ok=True,
            )
        )
        self.stage = self._parallel(
            world,
            [[L.rank(p, d, t) for d in range(L.dp) for t in range(tp)] for p in stages],
            "megatron stage",
            single_ok=False,
        )
        # Expert parallel (TP=PP=1): blocks of `ep` consecutive data-parallel ranks share the
        # experts out; the ranks at the same place in each block hold the same experts (expert DP).
        blocks = L.dp // ep
        self.ep = (
            self.own
            if ep == 1
            else self._parallel(
                world, [[b * ep + i for i in range(ep)] for b in range(blocks)], "megatron ep", single_ok=True
            )
        )
        self.expt_dp = (
            self.dp
            if ep == 1
            else self._parallel(
                world, [[b * ep + i for b in range(blocks)] for i in range(ep)], "megatron expert dp", single_ok=False
            )
        )

    def _parallel(self, world: World, groups: list[list[int]], name: str, single_ok: bool) -> Group | None:
        if len(groups[0]) == world.world_size:
            return None  # the default group
        if len(groups[0]) == 1 and single_ok:
            return self.own
        return self._mine(world, groups, name)

    def _mine(self, world: World, groups: list[list[int]], name: str, backend: str | None = None) -> Group | None:
        """Every rank creates every group; this rank's (None: in none of them, as the middle stages
        for the embedding group)."""
        mine = None
        for i, ranks in enumerate(groups):
            h = world.new_group(ranks, backend=backend, description=f"{name} {i}")  # every rank creates every group
            if world.rank in ranks:
                mine = h
        return mine

    @staticmethod
    def _pg(handle: Group | None) -> dist.ProcessGroup | None:

        return dist.group.WORLD if handle is None else handle.pg

    def collection(self) -> ProcessGroupCollection:
        """A ProcessGroupCollection of the groups as they are now (after the latest rebuild)."""

        tp, dp, own = self._pg(self.tp), self._pg(self.dp), self.own.pg
        pp, mp, embd, stage = self._pg(self.pp), self._pg(self.mp), self._pg(self.embd), self._pg(self.stage)
        ep, expt_dp = self._pg(self.ep), self._pg(self.expt_dp)
        tp_ep = tp if self.ep_size == 1 else ep  # expert parallel runs with TP=PP=1
        return ProcessGroupCollection(
            tp=tp,
            pp=pp,
            mp=mp,
            embd=embd,
            pos_embd=own,
            cp=own,
            tp_cp=tp,
            ep=ep,
            expt_tp=tp,
            tp_ep=tp_ep,
            tp_ep_pp=mp if self.ep_size == 1 else ep,
            tp_dp_cp=stage,
            dp=dp,
            dp_cp=dp,
            expt_dp=expt_dp,
            intra_dp_cp=dp,
            intra_expt_dp=expt_dp,
            # one distributed-optimizer instance: no inter-instance group, the intra one is DP
            inter_dist_opt=None,
            intra_dist_opt=dp,
        )

    def tp_group(self) -> dist.ProcessGroup | None:
        return self._pg(self.tp)

    def pp_group(self) -> dist.ProcessGroup | None:
        return self._pg(self.pp)

    def mp_group(self) -> dist.ProcessGroup | None:
        return self._pg(self.mp)


def rotary_base(hf_config: PretrainedConfig) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ConversionError(f"RoPE scaling {kind!r} is not supported by the megatron backend yet")
    return float(getattr(hf_config, "rope_theta", None) or params.get("rope_theta", 10000.0))


def build_gpt(
    hf_config: PretrainedConfig,
    pgs: ProcessGroupCollection,
    tp: int,
    dtype: torch.dtype,
    device: torch.device,
    ep: int = 1,
    pp: int = 1,
    pp_rank: int = 0,
) -> GPTModel:
    """An uninitialised GPTModel (weights are loaded after) with the local layer spec."""

    d = dims(hf_config, tp)
    if d.experts:
        _moe_without_transformer_engine()
    arch = transformer_config_kwargs(hf_config)
    config = TransformerConfig(
        **arch,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype if pp > 1 else None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Losses are normalised by global token counts (as the FSDP2 trainer does): gradients
        # are summed over data-parallel ranks, not averaged.
        calculate_per_token_loss=True,
    )
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # the local attention's scratch buffer
        parallel_state._set_global_memory_buffer()
    spec = get_gpt_layer_local_spec(
        num_experts=d.experts or None, moe_grouped_gemm=False, qk_layernorm=d.qk_norm, normalization="RMSNorm"
    )
    with torch.device(device):
        model = GPTModel(
            config,
            spec,
            vocab_size=d.padded_vocab,
            max_sequence_length=hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=rotary_base(hf_config),
            share_embeddings_and_output_weights=d.tied,
            parallel_output=True,
            pg_collection=pgs,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp - 1,
        )
    _mark_tensor_parallel(model)
    return model


def gpt_of(model: Any) -> Any:
    """The GPTModel inside megatron's DDP wrapper (a bare GPTModel, as the reference is, itself)."""
    return getattr(model, "module", model)


def weights_of(gpt: Any) -> dict[str, torch.Tensor]:
    """Megatron name -> this rank's parameter (module order)."""
    return {n: p for n, p in gpt.named_parameters()}


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16.1 binds `moe_utils.te_general_gemm` only when Transformer Engine
    imports, but its router tests `te_general_gemm is not None` unconditionally: without TE every
    MoE forward raises NameError. The name is defined as None, which is what that test means by
    'no TE' — nothing else in megatron is touched."""

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _mark_tensor_parallel(model: GPTModel) -> None:
    """Tag the TP-sharded weights as megatron's initialisers would. Without initialisation
    (perform_initialization=False: the weights are loaded next) megatron-core leaves them untagged,
    and its gradient norm then counts the shards of TP rank 0 only (found by the TP=2 test)."""

    for name, p in model.named_parameters():
        if is_tp_sharded(name) and not getattr(p, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(p, attr):
                    delattr(p, attr)
            set_tensor_model_parallel_attributes(p, True, tp_partition_dim(name), 1)
