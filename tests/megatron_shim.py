"""Test-only shim: megatron-core on CPU (gloo), for machines without a GPU.

megatron-core assumes CUDA: it places tensors with `device=torch.cuda.current_device()`,
calls `.cuda()`, and seeds and forks the CUDA RNG. This shim, kept in tests/ and never imported
by the package, (1) maps every `cuda` placement to `cpu` with a TorchFunctionMode and (2) points
the torch.cuda RNG and device queries at their CPU equivalents. It stands in for a GPU we do not
have here; the megatron backend itself runs unpatched on GPUs.

Use `with megatron_on_cpu(): ...` around building and running megatron models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # megatron asserts 'torch.cuda.FloatTensor'
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)):
            args = (args[0], _cpu(args[1])) + tuple(args[2:])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, *a: Any, **k: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *a: Any, **k: Any) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, *a: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *a: Any) -> _Event:
        return _Event()

    def wait_event(self, *a: Any) -> None:
        pass


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    patches = [
        # A device, not an index: megatron passes it as `device=` also inside autograd backward
        # functions, where the TorchFunctionMode below does not reach.
        mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")),
        mock.patch("torch.cuda.device_count", lambda: 1),
        # torch.manual_seed calls torch.cuda.manual_seed_all: that one must stay a no-op.
        mock.patch("torch.cuda.manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        mock.patch("torch.cuda.manual_seed_all", lambda seed: None),
        mock.patch("torch.cuda.get_rng_state", lambda device=None: torch.get_rng_state()),
        mock.patch("torch.cuda.set_rng_state", lambda state, device=None: torch.set_rng_state(state)),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
        mock.patch("torch.cuda.current_stream", lambda device=None: _Stream()),
        mock.patch("torch.cuda.Stream", _Stream),
        mock.patch("torch.cuda.Event", _Event),
        mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()),
        mock.patch("torch.cuda.memory_allocated", lambda device=None: 0),
        mock.patch("torch.cuda.max_memory_allocated", lambda device=None: 0),
        mock.patch(
            "megatron.core.tensor_parallel.random._get_cuda_rng_state",
            lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
        ),
        # The MoE all-to-all dispatcher moves its split sizes to host numpy arrays only when they
        # are CUDA tensors; here they are CPU tensors already, which all_to_all_single refuses.
        mock.patch("megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu", _to_host),
        mock.patch(
            "megatron.core.tensor_parallel.random._set_cuda_rng_state",
            lambda state, device=-1, graph_safe=False: torch.set_rng_state(state),
        ),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(_CudaToCpu())
        yield
