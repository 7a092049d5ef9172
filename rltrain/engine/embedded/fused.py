"""Projections of one input computed by one GEMM: an attention's q, k and v, an MLP's gate and up.

    fused = FusedProjections(model, device)  # after loading; the weights keep their names and values
    fused.release()                          # with the weights (residency.py, without the memory saver)
    fused.allocate()                         # before restoring them (residency.py's resume)

At a decode step's batch (hundreds of rows) each of these GEMMs is short, and one GEMM of the
three takes little more than one of them (see BENCHMARKS.md). transformers' modules call the
projections one by one; here each group's weights are rows of one tensor (each parameter is a
view of its rows, so updates, backups and checksums by name see what they always saw) and the
group's first projection called with an input computes every member's output from it at once;
the others, called with the same input, take theirs. Called with another input while its
output of the last one waits, a member computes its own alone; a member called again after
taking its output starts afresh (any call order, any model, a forward that failed). The shared
state is plain attributes, which torch.compile traces (the mutations cancel out within a block's
forward).
"""

from __future__ import annotations

from typing import Any

import torch

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group:
    """One parent module's projections of one input, their weights rows of `weight`."""

    def __init__(self, linears: list[torch.nn.Linear], device: torch.device):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.x: torch.Tensor | None = None  # the input of the outputs in `outs`
        self.outs: list[torch.Tensor | None] = [None] * len(linears)
        weight, bias = self.empty(device)
        for dst, src in zip(weight.split(self.sizes), (m.weight for m in linears)):
            dst.copy_(src.detach())
        if bias is not None:
            for dst, src in zip(bias.split(self.sizes), (m.bias for m in linears)):
                dst.copy_(src.detach())
        self.link(weight, bias)
        for i, m in enumerate(linears):
            m.forward = self._forward_of(i)  # type: ignore[method-assign]

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The group's weight and bias on `device`, uninitialised."""
        m = self.linears[0]
        shape = (sum(self.sizes), m.in_features)
        weight = torch.empty(shape, dtype=m.weight.dtype, device=device)
        bias = None if m.bias is None else torch.empty(shape[0], dtype=m.bias.dtype, device=device)
        return weight, bias

    def link(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Make every member's parameters views of `weight` (and `bias`) rows."""
        self.weight, self.bias = weight, bias
        start = 0
        for m, n in zip(self.linears, self.sizes):
            m.weight.data = weight[start : start + n]
            if bias is not None:
                m.bias.data = bias[start : start + n]
            start += n

    def _forward_of(self, i: int) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if self.x is not x and self.x is not None and self.outs[i] is not None:
                # another input while the group's outputs of the last one wait: this one alone
                m = self.linears[i]
                return torch.nn.functional.linear(x, m.weight, m.bias)
            if self.x is not x or self.outs[i] is None:  # (a member taken again: a new forward)
                if self.weight is None:
                    raise RuntimeError("fused projection called while the weights are released")
                self.x = x
                self.outs = list(torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
            out = self.outs[i]
            self.outs[i] = None
            if all(o is None for o in self.outs):
                self.x = None  # (no tensor outlives the forward that made it)
            assert out is not None
            return out

        return forward


class FusedProjections:
    """Every group of `GROUPS` found under one parent module (nn.Linear members, one input width,
    one dtype, all with bias or none), fused (module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        """The groups' weights are made on `device` (the members' may be anywhere, the host
        after loading: nothing on the device is allocated and freed again)."""
        self.groups: list[_Group] = []
        for parent in model.modules():
            for names in GROUPS:
                found = [getattr(parent, n, None) for n in names]
                linears = [m for m in found if type(m) is torch.nn.Linear]
                if len(linears) != len(names):
                    continue
                first = linears[0]
                if any(
                    (m.in_features, m.weight.dtype, m.weight.device, m.bias is None)
                    != (first.in_features, first.weight.dtype, first.weight.device, first.bias is None)
                    for m in linears
                ):
                    continue
                self.groups.append(_Group(linears, device))

    @property
    def params(self) -> set[int]:
        """ids of the parameters that are views of a group's weight (allocated by `allocate`)."""
        return {id(p) for g in self.groups for m in g.linears for p in m.parameters()}

    def release(self) -> None:
        """Drop the groups' weights (their members' parameters were emptied by the caller)."""
        for g in self.groups:
            g.weight = g.bias = None
            g.x, g.outs = None, [None] * len(g.outs)

    def allocate(self) -> None:
        """Fresh (uninitialised) weights for every group, members' parameters viewing them."""
        for g in self.groups:
            g.link(*g.empty(g.linears[0].weight.device))
