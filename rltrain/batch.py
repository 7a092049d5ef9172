"""`TrainBatch`: one rank's samples laid out for the trainer (what rollout builds, what trainers take).

All per-token tensors are [B, L] over the full sequence (prompt + response, right padded):
`tokens`, `attention_mask`, `loss_mask` (1 on response tokens), `advantages`, `old_logp`,
`ref_logp`, `rollout_logp`. `logp[:, t]` is the log-prob of `tokens[:, t]` given the tokens before
it (position 0 has none and is never in the loss mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch


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

    def fields(self) -> dict[str, Any]:
        """Field name -> tensor (or None), in declaration order: what `TrainBatch(**...)` takes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def slice(self, idx: slice | torch.Tensor) -> TrainBatch:
        fields: dict[str, Any] = {k: (v[idx] if v is not None else None) for k, v in self.fields().items()}
        return TrainBatch(**fields)

    def to(self, device: torch.device) -> TrainBatch:
        fields: dict[str, Any] = {k: (v.to(device) if v is not None else None) for k, v in self.fields().items()}
        return TrainBatch(**fields)


def idle_batch(like: TrainBatch, pad_id: int) -> TrainBatch:
    """A one-sample batch that contributes nothing (empty loss mask), for a rank's idle pass."""
    zeros = torch.zeros(1, 2)
    fields: dict[str, Any] = {k: (zeros if v is not None else None) for k, v in like.fields().items()}
    fields.update(
        tokens=torch.full((1, 2), pad_id, dtype=torch.long),
        attention_mask=torch.ones(1, 2, dtype=torch.long),
        loss_mask=zeros,
        advantages=zeros,
        old_logp=zeros,
    )
    return TrainBatch(**fields)


def pad_rows(batch: TrainBatch, rows: int, pad_id: int) -> TrainBatch:
    """`batch` with idle rows (padding tokens, empty loss mask) up to `rows`: pipeline stages
    exchange fixed-shape activations."""
    extra = rows - len(batch)
    if extra <= 0:
        return batch
    fields: dict[str, Any] = {}
    for k, v in batch.fields().items():
        if v is not None:
            fill = pad_id if k == "tokens" else (1 if k == "attention_mask" else 0)
            v = torch.cat([v, torch.full((extra, *v.shape[1:]), fill, dtype=v.dtype)])
        fields[k] = v
    return TrainBatch(**fields)


def pad_width(t: torch.Tensor, width: int) -> torch.Tensor:
    """A [B, L] tensor right-padded with zeros to [B, width]."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.dim() == 2 and t.shape[1] < width else t


def with_probe_row(mb: TrainBatch, tokens: list[int], pad_id: int) -> TrainBatch:
    """`mb`'s tokens and masks with the probe appended as one more row (both right-padded to
    the longer of the two): a row the loss never sees."""
    B, L = mb.tokens.shape
    width = max(L, len(tokens))
    grow = (0, width - L)
    row = torch.full((1, width), pad_id, dtype=mb.tokens.dtype, device=mb.tokens.device)
    row[0, : len(tokens)] = torch.tensor(tokens, dtype=mb.tokens.dtype)
    seen = torch.zeros((1, width), dtype=mb.attention_mask.dtype, device=mb.tokens.device)
    seen[0, : len(tokens)] = 1
    pad = torch.nn.functional.pad
    return TrainBatch(
        torch.cat([pad(mb.tokens, grow, value=pad_id), row]),
        torch.cat([pad(mb.attention_mask, grow), seen]),
        torch.cat([pad(mb.loss_mask, grow), torch.zeros((1, width), dtype=mb.loss_mask.dtype, device=seen.device)]),
    )
