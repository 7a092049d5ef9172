"""megatron-core's optimizer as the trainer runs it: built over the model's DDP, its learning rate
scheduled, and its state taken out and put back.

The optimizer is Adam with fp32 main parameters for bf16 models and gradient clipping, optionally
distributed (its state sharded over data parallel). It is built again with the modules after
every world rebuild, so its state moves between optimizers: `optimizer_state` takes this rank's
state out (for a distributed optimizer also the shard's fp32 main parameters, which its
`state_dict()` leaves out), `load_optimizer_state` puts it into a fresh optimizer over the same
model layout, and `ensure_optimizer_state` gives a fresh optimizer the slots a checkpoint is
loaded into in place. A (chained) megatron optimizer holds one or more of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from rltrain.config import TrainerConfig


def build_optimizer(cfg: TrainerConfig, dtype: torch.dtype, model: Any, pgs: Any) -> Any:
    """megatron's optimizer over `model` (its DDP), per `trainer.*`, on the groups `pgs`."""
    opt_cfg = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        clip_grad=cfg.grad_clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.distributed_optimizer,
    )
    return get_megatron_optimizer(opt_cfg, [model], pg_collection=pgs, use_gloo_process_groups=False)


class Schedule:
    """LR schedule over a megatron optimizer (not a torch optimizer, so no LambdaLR)."""

    def __init__(self, optimizer: Any, base_lr: float, factor: Callable[[int], float]):
        self.optimizer, self.base_lr, self.factor, self.step_count = optimizer, base_lr, factor, 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * self.factor(self.step_count)

    def get_last_lr(self) -> list[float]:
        return [self.base_lr * self.factor(self.step_count)]

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


def _inner(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside a (possibly chained) one."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_state(optimizer: Any, clone: bool = True) -> list[dict[str, Any]]:
    """This rank's optimizer state, loadable into a fresh optimizer over the same model layout.
    A distributed optimizer's `state_dict()` leaves out the parameter state (it is sharded);
    here the shard's Adam state and fp32 main parameters are taken as they are (`clone=False`:
    the live tensors)."""

    out = []
    for opt in _inner(optimizer):
        if isinstance(opt, DistributedOptimizer):
            main = [
                p.detach().clone() if clone else p.detach()
                for groups in (opt.shard_fp32_groups, opt.shard_fp32_from_float16_groups)
                for g in groups
                for p in g
            ]
            out.append({"inner": opt.optimizer.state_dict(), "main": main})
        else:
            out.append({"wrapper": opt.state_dict()})
    return out


@torch.no_grad()
def ensure_optimizer_state(optimizer: Any) -> None:
    """Adam's per-parameter state (step, moments) as zeros where none exists yet: the layout a
    trained optimizer has, so a checkpoint of one can be loaded into a fresh one in place."""
    for opt in _inner(optimizer):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                if not torch_opt.state[p]:
                    torch_opt.state[p].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                    )


@torch.no_grad()
def load_optimizer_state(optimizer: Any, state: list[dict[str, Any]]) -> None:
    """`optimizer_state`'s capture into `optimizer` (torch's load moves it to its parameters' device)."""
    opts = _inner(optimizer)
    if len(opts) != len(state):
        raise ValueError(f"optimizer state for {len(state)} optimizers, this one has {len(opts)}")
    for opt, st in zip(opts, state):
        if "wrapper" in st:
            opt.load_state_dict(st["wrapper"])
            continue
        opt.optimizer.load_state_dict(st["inner"])
        mains = [p for groups in (opt.shard_fp32_groups, opt.shard_fp32_from_float16_groups) for g in groups for p in g]
        if len(mains) != len(st["main"]):
            raise ValueError("distributed optimizer shards do not match the captured state")
        for p, saved in zip(mains, st["main"]):
            p.copy_(saved)
