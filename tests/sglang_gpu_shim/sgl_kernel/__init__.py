"""Test-only stand-in for sglang-kernel (SGLang's CUDA op library, far over the lent GPU's
64 MiB carry limit): the ops SGLang's CUDA path calls for a dense Qwen2/Qwen3 model, in torch,
and for every other name a placeholder that raises when called, naming the op. Submodules
(`sgl_kernel.kvcacheio`, ...) are made on import the same way. Never on the package's path:
used on the lent GPU with PYTHONPATH=tests/sglang_gpu_shim (README.md beside it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = "0.4.10"


from _sglang_standins import Missing, install

install()


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return Missing(f"sgl_kernel.{name}")


# ------------------------------------------------------------------ the ops a dense model uses


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if gemma else weight.float()
    return (y * w).to(x.dtype)


def _into(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _into(_rms(input, weight, eps), out)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _into(_rms(input, weight, eps, gemma=True), out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, gemma=True))


def _gated(act, input, out):
    d = input.shape[-1] // 2
    return _into(act(input[..., :d]) * input[..., d:], out)


def silu_and_mul(input, out=None, enable_pdl=None):
    return _gated(F.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):
    return _gated(F.gelu, input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    return _gated(lambda t: F.gelu(t, approximate="tanh"), input, out)


def weak_ref_tensor(tensor):
    return tensor
