"""This rank's megatron weights from the HF checkpoint, and modules filled from a state.

A state is megatron name -> this rank's tensor. At creation the trainer's model (and its
reference) is filled from the HF checkpoint, of which each rank reads only what it holds: its
pipeline stage's layers, its block of experts (expert parallel), and of each weight the rows or
columns of its tensor-parallel shard (convert.py's `mcore_state`, over weights/hf_sharded.py's
`SafetensorsSource`, the FSDP trainer's reader too). The
checkpoint's names and shapes are checked against the model's config first, from the files'
headers, before any tensor is read. After a world rebuild or from a snapshot the model is filled
from the trainer's own capture instead. `fill` checks that a state fits the model exactly (every
name, every shape) before it copies anything in.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.trainer.megatron.convert import Dims, RankPart, mcore_state
from rltrain.trainer.megatron.model import MegatronGroups, weights_of
from rltrain.weights.hf_sharded import SafetensorsSource


def hf_state(model_path: str, d: Dims, groups: MegatronGroups) -> dict[str, torch.Tensor]:
    """This rank's part of the HF checkpoint in `model_path`, under its stage's megatron names."""
    g, layout = groups, groups.layout
    part = RankPart(g.tp_rank, layout.tp, g.ep_rank, g.ep_size, g.pp_rank, layout.pp)
    with SafetensorsSource(model_path) as src:
        return mcore_state(src, d, part)


@torch.no_grad()
def fill(gpt: Any, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the GPTModel's parameters; it must name each of them, at its shape."""
    params = weights_of(gpt)
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(f"megatron state does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(src.shape)} does not fit the model's {tuple(p.shape)}")
        p.copy_(src)
