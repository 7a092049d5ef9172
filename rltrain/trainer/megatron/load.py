"""This rank's megatron weights from the HF checkpoint, and modules filled from a state.

A state is megatron name -> this rank's tensor. At creation the trainer's model (and its
reference) is filled from the HF checkpoint: every `*.safetensors` file is read whole, converted
to megatron's layout and cut to this rank's part — its tensor-parallel shard, its block of experts
(expert parallel), its pipeline stage's layers (convert.py). After a world rebuild or from a
snapshot it is filled from the trainer's own capture instead. `fill` checks that a state fits the
model exactly (every name, every shape) before it copies anything in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from rltrain.trainer.megatron.convert import Dims, hf_to_mcore_shards, to_stage
from rltrain.trainer.megatron.model import MegatronGroups, weights_of


def hf_state(model_path: str, d: Dims, groups: MegatronGroups) -> dict[str, torch.Tensor]:
    """This rank's part of the HF checkpoint in `model_path`, under its stage's megatron names."""
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    if not hf:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    g, layout = groups, groups.layout
    state = hf_to_mcore_shards(hf, d, g.tp_rank, layout.tp, g.ep_rank, g.ep_size)
    return to_stage(state, d, layout.pp, g.pp_rank)


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
