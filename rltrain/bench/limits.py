"""Limits the benchmarks measure their figures against, computed from the model and measured here.

The decode limit of a rollout: each decode step of a batch reads the weights once (all but the
input embedding, of which it reads a row per sequence) and the KV cache of every sequence's
context so far; at the device's measured read bandwidth that is the fastest a step can be, and
batch / step time the most response tokens per second any engine can generate on that workload.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def device_read_gbps(device: torch.device, nbytes: int = 8 << 30) -> float:
    """GB/s of device memory traffic in a device-to-device copy (its reads plus its writes: twice
    the bytes `bench.sync.raw_copy_gbps` counts): the rate at which a decode step can stream its
    weights and KV cache."""
    from rltrain.bench.sync import raw_copy_gbps

    rate = 2 * raw_copy_gbps(nbytes, device)
    torch.cuda.empty_cache()
    return rate


@dataclass(frozen=True)
class DecodeLimit:
    weight_bytes: int  # read per decode step
    kv_bytes_per_token: int  # of context, per sequence
    batch: int
    mean_context: float  # tokens, over the decode
    read_gbps: float

    @property
    def step_bytes(self) -> float:
        return self.weight_bytes + self.batch * self.mean_context * self.kv_bytes_per_token

    @property
    def step_s(self) -> float:
        return self.step_bytes / (self.read_gbps * 1e9)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    def describe(self) -> str:
        return (
            f"decode limit {self.tokens_per_s:,.0f} tok/s: {self.step_bytes / 1e9:.2f} GB read per step "
            f"(weights {self.weight_bytes / 1e9:.2f} + KV of {self.batch} x {self.mean_context:.0f} tokens) "
            f"at {self.read_gbps:,.0f} GB/s"
        )


def decode_limit(model: Path, batch: int, mean_context: float, read_gbps: float, dtype_bytes: int = 2) -> DecodeLimit:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in m.parameters())
    if not getattr(cfg, "tie_word_embeddings", False):
        params -= m.get_input_embeddings().weight.numel()  # a row per sequence, not the table
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes
    return DecodeLimit(params * dtype_bytes, kv, batch, mean_context, read_gbps)
