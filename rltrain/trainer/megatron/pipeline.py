"""A model replica's batch: pooled from its ranks, and run through megatron's 1F1B pipeline schedule.

A replica is one copy of the model over its tensor- and pipeline-parallel ranks; they must all
run the same sequences. In the loop each rank holds its own samples, so each step the replica's
ranks pool theirs (`pool`, the same order on every rank) and a rank keeps the log-probs of its
own. With pipeline parallel (`trainer.pipeline_parallel_size` > 1) a pass runs through megatron's
1F1B schedule (`Pipeline.run`) over fixed-shape micro-batches, the loss or the scoring on the last
stage; what it records there is broadcast back to every stage (`logprobs`, `last_stage_sum`), so
every rank returns the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

from rltrain.batch import TrainBatch, pad_rows, pad_width
from rltrain.trainer.megatron.model import gpt_of


def pool(batch: TrainBatch, group: dist.ProcessGroup | None, size: int) -> tuple[TrainBatch, slice]:
    """Every sample of the `size` ranks of `group` (one model replica; the same order on each)
    and where this rank's own samples are in it. A collective over `group`."""
    parts: list[Any] = [None] * size
    dist.all_gather_object(parts, batch.to(torch.device("cpu")), group=group)
    start = sum(len(p) for p in parts[: dist.get_rank(group)])
    width = max(p.tokens.shape[1] for p in parts)
    fields: dict[str, Any] = {
        k: (torch.cat([pad_width(getattr(p, k), width) for p in parts]) if v is not None else None)
        for k, v in parts[0].fields().items()
    }
    return TrainBatch(**fields), slice(start, start + len(batch))


@dataclass
class Pipeline:
    """megatron's 1F1B schedule over this rank's pipeline group (of the groups `pgs`, megatron's
    ProcessGroupCollection); `stage` is this rank's of `stages`."""

    pgs: Any
    stage: int
    stages: int
    micro_batch_size: int
    pad_id: int
    device: torch.device

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def run(
        self, model: Any, batch: TrainBatch, forward_only: bool, loss_fn: Callable[[TrainBatch, torch.Tensor], Any]
    ) -> list[Any]:
        """The schedule over fixed-shape micro-batches of `batch` (the replica's pooled batch:
        the same on every stage). `loss_fn(mb, logits)` runs on the last stage and returns
        (loss, token count, record); the records come back there, in order."""

        size = self.micro_batch_size
        n, L = batch.tokens.shape
        chunks = [pad_rows(batch.slice(slice(i, i + size)), size, self.pad_id) for i in range(0, n, size)]
        if not chunks:
            return []
        positions = torch.arange(L, device=self.device).expand(size, L)

        def step(data: Any, m: Any) -> Any:
            mb = next(data).to(self.device)
            return m(mb.tokens, positions, attention_mask=None), functools.partial(loss_fn, mb)

        p2p = P2PCommunicator(pp_group=self.pgs.pp, config=gpt_of(model).config)
        return forward_backward_pipelining_without_interleaving(
            forward_step_func=step,
            data_iterator=iter(chunks),
            model=model,
            num_microbatches=len(chunks),
            seq_length=L,
            micro_batch_size=size,
            forward_only=forward_only,
            p2p_communicator=p2p,
            pg_collection=self.pgs,
        )

    def logprobs(
        self,
        model: Any,
        batch: TrainBatch,
        score: Callable[[TrainBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, L] log-probs and entropies of `batch`, `score(mb, logits)` of each micro-batch on
        the last stage, on the host, on every stage."""

        def record(mb: TrainBatch, logits: torch.Tensor) -> Any:
            lp, ent = score(mb, logits)
            return torch.zeros((), device=self.device), torch.tensor(1), torch.stack([lp, ent])

        records = self.run(model, batch, True, record)
        n, L = batch.tokens.shape
        out = torch.empty(2, n, L, device=self.device)
        if self.last and n:
            out.copy_(torch.cat(records, dim=1)[:, :n])
        dist.broadcast(out, group=self.pgs.pp, group_src=self.stages - 1)  # every stage returns them
        return out[0].cpu(), out[1].cpu()

    def last_stage_sum(self, records: list[Any], width: int) -> torch.Tensor:
        """The sum of the last stage's `width`-long records (float64), on every stage."""
        acc = torch.zeros(width, dtype=torch.float64, device=self.device)
        if self.last and records:
            acc += torch.stack(records).sum(0).to(self.device)
        dist.broadcast(acc, group=self.pgs.pp, group_src=self.stages - 1)  # the records live on the last stage
        return acc
