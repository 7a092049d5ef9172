"""Which routed experts the embedded engine holds, and which each of its TP ranks holds: the
receiving end of a routed sync.

    layout = ExpertLayout(config, ep_size, ep_rank, tp_size)
    layout.owns(name)            # this engine takes updates of `name`
    layout.rank_owns(k, name)    # TP rank k holds `name`

Two layouts:
- one engine of a group (`ep_rank`, tp_size 1): as EP rank r of ep_size it takes updates only for
  its contiguous block of experts and checksums what it owns;
- SGLang's layout (tp_size > 1): one engine over tp_size TP ranks, experts split over ep_size of
  them (TP rank k is EP rank (k // (tp_size / ep_size)) % ep_size). An update carries one payload
  per TP rank; each may hold only its own EP rank's experts, and every rank's copy of a dense
  weight must be the same (receiver.py). The ranks live in one process on one device (it has no
  tensor-parallel forward): they receive, hold and checksum per rank what SGLang's TP ranks
  would, and together serve the whole model.
The engine has no expert-parallel forward: in the first layout its weights of other experts stay
as loaded (it is used so to receive and verify routed syncs).
"""

from __future__ import annotations

from typing import Any

from rltrain.weights.names import classify, num_experts


class ExpertLayout:
    """The engine's EP and TP sizes, checked against the model's experts (module doc)."""

    def __init__(self, config: Any, ep_size: int = 1, ep_rank: int = 0, tp_size: int = 1):
        experts = num_experts(config)
        if tp_size > 1:
            if ep_rank or tp_size % ep_size or (ep_size > 1 and (experts == 0 or experts % ep_size)):
                raise ValueError(
                    f"tp_size={tp_size}, ep_size={ep_size}, ep_rank={ep_rank}: EP inside the engine needs "
                    f"ep_size dividing tp_size and the model's {experts} experts, and no --ep-rank"
                )
        elif ep_size > 1 and (experts == 0 or experts % ep_size or not 0 <= ep_rank < ep_size):
            raise ValueError(f"ep_size={ep_size}, ep_rank={ep_rank}: the model has {experts} experts")
        self.ep_size, self.ep_rank, self.tp_size = ep_size, ep_rank, tp_size
        self.experts_per_rank = experts // ep_size if ep_size > 1 else 0
        # The EP rank of each TP rank (SGLang's MoE groups; one TP rank: this engine's EP rank).
        self.rank_ep = [(k // (tp_size // ep_size)) % ep_size for k in range(tp_size)] if tp_size > 1 else [ep_rank]

    def owns(self, name: str) -> bool:
        """Whether this engine holds `name` as one EP rank of a group of engines (always, in any
        other layout: an engine over several TP ranks holds every rank's experts)."""
        if self.ep_size <= 1 or self.tp_size > 1:
            return True
        expert = classify(name).expert
        return expert is None or expert // self.experts_per_rank == self.ep_rank

    def rank_owns(self, tp_rank: int, name: str) -> bool:
        """Whether TP rank `tp_rank` of this engine holds `name`: its EP rank's experts, and every
        weight that is not a routed expert."""
        if self.ep_size <= 1:
            return True
        expert = classify(name).expert
        return expert is None or expert // self.experts_per_rank == self.rank_ep[tp_rank]
