"""What a trainer holds, for the memory ledger, for offload and for checkpoints, and how long its
parts take.

Both backends report their tensors the same way (`held`: weights, gradients, optimizer state
and spare host buffers, each storage counted once by the ledger), time the parts of an
offload or onload into the same `timings` dict (the benchmarks print it), and checkpoint the
same small host state beside their tensors (`capture_host_state`: the LR schedule and the step count).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

from rltrain.runtime.ledger import HeldTensors
from rltrain.runtime.memory import free_cuda_caches, trim_host_heap

# Re-assemblies of a trainer's modules between full garbage collections: dropped modules hold the
# destroyed group through their mesh or DDP buffers in reference cycles, and a Gloo group keeps
# its sockets and threads until it is freed. A full collection frees them (a young-generation
# one does not) but is dear with transformers loaded, so one every GC_EVERY bounds the growth.
GC_EVERY = 8


def tensors_in(obj: object, out: list[torch.Tensor]) -> None:
    """Append every tensor in a nested dict/list/tuple to `out`."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_in(v, out)


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a (possibly megatron-wrapped or chained) optimizer."""
    if optimizer is None:
        return []
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def held(
    modules: Iterable[torch.nn.Module | None],
    optimizer: object,
    parked_weights: object = None,
    parked_optimizer: object = None,
    spare: list[torch.Tensor] | None = None,
) -> HeldTensors:
    """Every tensor of `modules` (parameters and buffers; gradients, megatron's main_grad too) and
    of `optimizer` (its state; megatron's fp32 main parameters too), plus state parked in host
    memory and spare host buffers, by kind."""
    weights: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    optim: list[torch.Tensor] = []
    for module in modules:
        if module is not None:
            # (nn.Module's own methods: megatron's DDP has a `buffers` list of its own)
            params = list(torch.nn.Module.parameters(module))
            weights += [*params, *torch.nn.Module.buffers(module)]
            for p in params:
                grads += [g for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    for opt in torch_optimizers(optimizer):
        optim += [p for group in opt.param_groups for p in group["params"]]
        tensors_in(list(opt.state.values()), optim)
    tensors_in(parked_weights, weights)
    tensors_in(parked_optimizer, optim)
    return {"weights": weights, "grads": grads, "optimizer": optim, "spare": list(spare or [])}


@contextlib.contextmanager
def timed(timings: dict[str, float], what: str, device: torch.device, stream_only: bool = False) -> Iterator[None]:
    """Seconds of a part of offload/onload, device work included, into `timings[what]`.
    `stream_only`: the work the current stream waits for, before and after, not what a side
    stream goes on with (a device-wide wait would make copies meant to run beside the forward
    part of the onload)."""
    if device.type == "cuda":
        if stream_only:
            torch.cuda.current_stream(device).synchronize()
        else:
            torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        if stream_only:
            torch.cuda.current_stream(device).synchronize()
        else:
            torch.cuda.synchronize(device)
    timings[what] = time.perf_counter() - t0


def return_memory(device: torch.device) -> None:
    """After a trainer dropped its modules: collect what sits in reference cycles, then hand the
    freed memory back (the allocator's cache to the driver on a GPU, the heap to the OS on CPU)."""
    gc.collect()
    if device.type == "cuda":
        free_cuda_caches()
    else:
        trim_host_heap()


class LRSchedule(Protocol):
    """A trainer's learning-rate schedule, as checkpoints see it (torch's LambdaLR, megatron's own)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def capture_host_state(scheduler: LRSchedule | None, steps: int) -> dict[str, Any]:
    """The small state of a trainer that is not tensors of the model: its schedule and step count."""
    assert scheduler is not None, "the host state of a released trainer (no schedule)"
    return {"scheduler": scheduler.state_dict(), "steps": steps}


def restore_host_state(scheduler: LRSchedule | None, state: dict[str, Any]) -> int:
    """Restore `capture_host_state`'s schedule into `scheduler`; returns its step count."""
    assert scheduler is not None, "host state into a released trainer (no schedule)"
    scheduler.load_state_dict(state["scheduler"])
    return int(state["steps"])
