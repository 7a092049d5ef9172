"""The megatron trainer's weights as full tensors under HF names: the export a weight sync and
`save_pretrained` read.

Each rank holds pieces of a weight; the export makes it whole where it is needed and converts it
to its HF names (convert.py's `from_mcore`, which splits fused QKV and gate/up):

  tensor parallel    a TP-sharded weight is all-gathered over its TP group and unsharded
  pipeline parallel  the stage that holds a weight gathers it over its TP group and broadcasts
                     it to the other stages
  expert parallel    an expert lives on one rank of each EP group: it is broadcast to the group,
                     or, given `needs` (which HF names each global rank needs), sent point to
                     point from that rank only to the ranks that need it (none, where the
                     engine's EP ranks are the trainer's); a rank converts to HF names only what
                     it needs

The export is a collective: every rank iterates it to the end with the same names, and every
rank runs the collectives in the same order (that of the megatron weights the names come from).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rltrain.interfaces import Needs, WeightSpecRow
from rltrain.trainer.megatron.convert import (
    Dims,
    expert_of,
    from_mcore,
    full_shape,
    is_tp_sharded,
    local_expert_name,
    mcore_names,
    stage_name,
    stage_of,
    tp_unshard,
)
from rltrain.trainer.megatron.model import MegatronGroups, gpt_of, weights_of


class WeightExport:
    """The export of one trainer's weights (its layout: `dims`, TP, EP and PP sizes, dtype and
    device); the process groups are the ones of the model being exported, given per export."""

    def __init__(self, d: Dims, tp: int, ep: int, pp: int, dtype: torch.dtype, device: torch.device):
        self.dims, self.tp, self.ep, self.pp = d, tp, ep, pp
        self.dtype, self.device = dtype, device
        self._specs: list[WeightSpecRow] | None = None
        self._hf_of: dict[str, list[str]] = {}  # megatron name -> its HF names (from the specs)
        # Bytes of expert weights this rank sent to other EP ranks in exports (all of them so far).
        self.expert_bytes_sent = 0

    def specs(self) -> list[WeightSpecRow]:
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

    @torch.no_grad()
    def weights(
        self,
        model: Any,
        groups: MegatronGroups | None,
        pgs: Any,
        names: list[str] | None = None,
        needs: Needs | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every weight of `model` (megatron's DDP over this rank's
        GPTModel), or of `names`, over `groups` / `pgs` (megatron's ProcessGroupCollection of
        the same groups). `needs`: see the module docstring."""
        specs = self.specs()
        wanted = None if names is None else set(names)
        if wanted is not None:
            unknown = sorted(wanted - {s[0] for s in specs})
            if unknown:
                raise KeyError(f"no trainer weight is named {unknown[:5]}")
        source_of = {ck: src for ck, src, _, _ in specs}
        sources = list(dict.fromkeys(source_of[n] for n in (names if names is not None else source_of)))
        local = weights_of(gpt_of(model))
        assert groups is not None  # (the model was built over them)
        per_rank = self.dims.experts // self.ep if self.dims.experts else 0
        if self.pp > 1:
            yield from self._stages(sources, local, wanted, groups, pgs)
            return
        rank = dist.get_rank()
        keep = None if needs is None else (lambda name: needs(rank, name))
        for src in sources:
            e = expert_of(src)
            routed = e is not None and self.ep > 1
            if keep is not None and not routed and self.tp == 1 and not any(map(keep, self._hf_names(src, wanted))):
                continue  # held whole here (no collective) and not needed here: not converted either
            if e is not None and routed:  # one rank of the EP group holds it
                owner = e // per_rank
                mine = local[local_expert_name(src, e % per_rank)] if owner == groups.ep_rank else None
                full = (
                    self._broadcast_full(src, mine, pgs.ep, owner, pgs)
                    if needs is None
                    else self._send_expert(src, mine, owner, wanted, needs, groups, pgs)
                )
                if full is not None:
                    yield from self._pieces(src, full, wanted, keep)
            else:
                yield from self._pieces(src, self._tp_full(src, local[src], groups), wanted, keep)

    def _hf_names(self, src: str, wanted: set[str] | None) -> list[str]:
        if not self._hf_of:
            for hf_name, mc_name, _, _ in self.specs():
                self._hf_of.setdefault(mc_name, []).append(hf_name)
        return [n for n in self._hf_of[src] if wanted is None or n in wanted]

    def _send_expert(
        self,
        src: str,
        mine: torch.Tensor | None,
        owner: int,
        wanted: set[str] | None,
        needs: Needs,
        groups: MegatronGroups,
        pgs: Any,
    ) -> torch.Tensor | None:
        """Expert weight `src` from its EP rank `owner` to each other EP rank of the group that
        needs it (point to point, every rank in the same order); the tensor on the owner and on
        those ranks, None elsewhere."""
        group = pgs.ep
        members = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        hf = self._hf_names(src, wanted)
        to = [i for i, r in enumerate(members) if i != owner and any(needs(r, n) for n in hf)]
        me = groups.ep_rank
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

    def _stages(
        self,
        sources: list[str],
        local: dict[str, torch.Tensor],
        wanted: set[str] | None,
        groups: MegatronGroups,
        pgs: Any,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pipeline parallel: the stage that holds a weight gathers it over its TP group and
        broadcasts it to the other stages."""
        pp_rank = groups.pp_rank
        for src in sources:
            owner = stage_of(src, self.dims, self.pp)
            mine = self._tp_full(src, local[stage_name(src, self.dims, self.pp)], groups) if owner == pp_rank else None
            yield from self._pieces(src, self._broadcast_full(src, mine, pgs.pp, owner, pgs), wanted)

    def _tp_full(self, src: str, part: torch.Tensor, groups: MegatronGroups) -> torch.Tensor:
        """The whole tensor of this rank's part: gathered over its TP group if TP-sharded."""
        if self.tp == 1 or not is_tp_sharded(src):
            return part.detach()
        parts = [torch.empty_like(part) for _ in range(self.tp)]
        dist.all_gather(parts, part.contiguous(), group=groups.tp_group())
        return tp_unshard(src, parts)

    def _broadcast_full(
        self, src: str, mine: torch.Tensor | None, group: dist.ProcessGroup | None, owner: int, pgs: Any
    ) -> torch.Tensor:
        """`mine` on the owner (its index in `group`), received by everyone else in the group."""
        full = (
            mine.contiguous()
            if mine is not None
            else torch.empty(full_shape(src, self.dims), dtype=self.dtype, device=self.device)
        )
        dist.broadcast(full, group=group, group_src=owner)
        if mine is not None and group is pgs.ep:
            size = dist.get_world_size(group) if group is not None else dist.get_world_size()
            self.expert_bytes_sent += full.numel() * full.element_size() * (size - 1)
        return full

    def _pieces(
        self, src: str, full: torch.Tensor, wanted: set[str] | None, keep: Callable[[str], bool] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, t in from_mcore(src, full, self.dims):
            if (wanted is None or hf_name in wanted) and (keep is None or keep(hf_name)):
                yield hf_name, t
