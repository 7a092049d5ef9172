"""Test-only: SGLang's deterministic inference on a CPU, imported by sitecustomize.py into SGLang's
own processes when RLTRAIN_TEST_SGLANG_CPU_DETERMINISTIC=1 (tests/test_seeds.py).

SGLang 0.5.23 runs --enable-deterministic-inference on accelerators only. Three things stand in
the way on a CPU; each is replaced here, and nothing else:

- its deterministic attention backends are GPU ones: torch_native (one process, deterministic on
  a CPU) is registered through SGLang's own plugin hook, add_deterministic_attention_backend_choices;
- its batch-invariant mode needs CUDA or XPU: skipped (batch invariance is not what is tested);
- its seeded draw hashes (seed, position, token) with sgl-kernel's CPU op, and the CPU build of
  sgl-kernel is not installed: the same MurmurHash3 (sglang/kernels/ops/sampling/murmur_hash.py's
  Triton kernel) in torch ops.

What the tests look at stays SGLang's own: the seed each row is sampled with
(`SamplingBatchInfo.from_schedule_batch`: 42 for a row without one) and its seeded draw
(`multinomial_with_seed`).
"""

import torch
from sglang.srt.arg_groups.choices import add_deterministic_attention_backend_choices
from sglang.srt.layers import sampler
from sglang.srt.model_executor import model_runner

_MASK = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _MASK
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _MASK
    h = h ^ k
    h = _rotl32(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK
    return h ^ (h >> 16)


def murmur_hash32(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[n, m] uint32 hashes of (seed[i], positions[i], col_indices[j]), as SGLang's kernel."""
    s = seed.to(torch.int64)
    # int64: a product of two 32-bit values wraps modulo 2**64, which keeps its low 32 bits.
    low, high = (s & _MASK).view(-1, 1), ((s >> 32) & _MASK).view(-1, 1)
    h = _mix(torch.zeros_like(low), low)
    h = _mix(h, high)
    h = _mix(h, (positions.to(torch.int64) & _MASK).view(-1, 1))
    h = _mix(h.expand(-1, col_indices.numel()), (col_indices.to(torch.int64) & _MASK).view(1, -1))
    return _fmix32(h ^ 16).to(torch.uint32)


add_deterministic_attention_backend_choices(["torch_native"])
model_runner.ModelRunner.maybe_enable_batch_invariant_mode = lambda self: None
sampler.murmur_hash32 = murmur_hash32
