"""The transformers causal LM as the FSDP trainer trains it: what `FSDPTrainer._build` changes in it.

  LogprobHead     the bias-free linear LM head replaced by one that can return (log-prob, entropy)
                  of given next tokens through the fused kernel (kernels/), in chunks of tokens,
                  instead of the logits of the whole micro-batch
  compile_blocks  `trainer.compile`: torch.compile of every transformer block's forward
  outside_graphs  an attention implementation kept out of the compiled graphs (flex attention)

Each keeps the model's names and weights as they are: checkpoints, the export and FSDP2's
sharding see the model transformers built.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PretrainedConfig
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rltrain.kernels import linear_logprobs_entropy


class LogprobHead(torch.nn.Linear):
    """The model's bias-free linear LM head, which can return (log-prob, entropy) of given next
    tokens instead of logits: `with head.scoring(targets, temperature): model(...)` makes the
    model's `logits` output those two, stacked on the last dimension, computed by the fused
    kernel in chunks of tokens (no logits of the whole micro-batch). It holds the original
    head's weight parameter (tied embeddings stay tied, names stay `lm_head.weight`), and under
    FSDP2 its weight is the gathered one inside the model's forward, as for the plain head."""

    def __init__(self, head: torch.nn.Linear):
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.register_parameter("bias", None)
        self._targets: torch.Tensor | None = None
        self._temperature = 1.0

    @classmethod
    def fits(cls, head: torch.nn.Module | None, config: PretrainedConfig) -> bool:
        """A plain bias-free linear head; models that post-process logits (soft-capping) keep theirs."""
        return (
            type(head) is torch.nn.Linear and head.bias is None and not getattr(config, "final_logit_softcapping", None)
        )

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor, temperature: float) -> Iterator[None]:
        self._targets, self._temperature = targets, temperature
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return super().forward(hidden)
        return torch.stack(linear_logprobs_entropy(hidden, self.weight, self._targets, self._temperature), dim=-1)


def outside_graphs(attention: str) -> str:
    """The name under which transformers runs `attention` outside compiled graphs: its function
    under `torch.compiler.disable`, registered with transformers' attention and mask interfaces
    (its documented way to add an attention implementation). Flex attention then runs as
    transformers compiles it on its own, between the compiled halves of each block: traced into
    a block compiled with dynamic shapes, inductor (torch 2.11) fails to lower it
    ("unsupported operand type(s) for &: 'floor' and 'Add'", seen on the H200)."""
    name = f"rltrain_uncompiled_{attention}"  # (transformers checks flex_attention by substring: kept)
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, torch.compiler.disable(ALL_ATTENTION_FUNCTIONS[attention]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[attention])
    return name


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile the forward of every transformer block (HF `_no_split_modules`), not the
    whole model: the blocks are where the fusable elementwise work is, they are alike (one graph
    serves all, weights are its inputs), and the calls around them (FSDP2's hooks, the packed
    mask, the log-prob head) stay eager. Dynamic shapes: a packed micro-batch of any length
    reuses the graph. Returns the number of blocks compiled."""
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    count = 0
    for module in model.modules():
        if type(module).__name__ in blocks:
            module.forward = torch.compile(module.forward, dynamic=True)
            count += 1
    if not count:
        raise ValueError(f"trainer.compile: {type(model).__name__} names no transformer blocks (_no_split_modules)")
    return count
