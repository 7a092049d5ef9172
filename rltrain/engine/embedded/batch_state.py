"""The running batch's device state (batching.py): each row's next input token, its position, its
page table and its count of sampled tokens, with the rows' sampling plan and logit shaper, in a
dict the decode step reads. Made from the rows, cut to the rows that go on, or extended by rows
that join with their first tokens still on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.engine.embedded.launched import Seq
from rltrain.engine.embedded.sampling import LogitShaper, SamplingPlan, device_tensor


def build(seqs: list[Seq], plan: SamplingPlan, vocab: int, max_pages: int, device: torch.device) -> dict[str, Any]:
    """Device tensors of the rows' next step: last token, its position, page tables, steps;
    their sampling plan (`plan`, made for these rows) and logit shaper."""
    table = torch.stack([s.table(max_pages) for s in seqs])
    rows = [s.row for s in seqs]
    return {
        "tokens": torch.tensor([r.out[-1] for r in rows], device=device),
        "pos": torch.tensor([len(r.prompt) + len(r.out) - 1 for r in rows], device=device),
        "table": table.to(device),
        "steps": torch.tensor([len(r.out) for r in rows], device=device),
        "plan": plan,
        "shaper": LogitShaper([r.params for r in rows], [r.stops for r in rows], vocab, device, [r.out for r in rows]),
    }


def subset(state: dict[str, Any], keep: list[int], plan: SamplingPlan, device: torch.device) -> None:
    """`state` cut to the rows `keep` (indices into the batch before; `plan`: theirs), with no
    host sync (the step in flight may still be running)."""
    index = device_tensor(keep, torch.long, device)
    for key in ("tokens", "pos", "table", "steps"):
        state[key] = state[key][index]
    state["plan"] = plan
    state["shaper"] = state["shaper"].subset(index, keep)


def append(
    state: dict[str, Any],
    seqs: list[Seq],
    joining: dict[str, Any],
    plan: SamplingPlan,
    max_pages: int,
    device: torch.device,
) -> None:
    """`state` (empty where no row ran) with the rows that join appended (`seqs`: the batch's
    rows, theirs last; `plan`: all of theirs): their first tokens (`joining`: on the device, not
    read yet) are the next step's inputs, as a decode step's are; the rows before them keep theirs
    as queued. No host sync: the step in flight may still be running."""
    n = joining["tokens"].shape[0]
    new = seqs[len(seqs) - n :]
    table = torch.stack([s.table(max_pages) for s in new])
    tail = {
        "tokens": joining["tokens"].long(),
        "pos": device_tensor([len(s.row.prompt) for s in new], torch.long, device),
        "table": table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table,
        "steps": torch.ones(n, dtype=torch.long, device=device),
    }
    if state:
        for key, value in tail.items():
            state[key] = torch.cat([state[key], value])
        state["shaper"] = LogitShaper.joined(state["shaper"], joining["shaper"])
    else:
        state.update(tail, shaper=joining["shaper"])
    state["plan"] = plan
