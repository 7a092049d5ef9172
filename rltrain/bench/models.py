"""The benchmarks' models: random weights, built locally (no downloads).

`build(path, shape, device)`: a Qwen3 of one of `SHAPES` (bf16 unless asked); `build_model(path, hidden,
layers, vocab, dtype)`: a small Qwen2 of any width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (256, 768, 2, 4, 2, 1024),
    "0.6b": (1024, 3072, 28, 16, 8, 151936),
    "1.7b": (2048, 6144, 28, 16, 8, 151936),
}


def qwen3_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Any:
    """A Qwen3 config of this shape (head dim 128 from width 1024 up, else 64; untied head)."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128 if hidden >= 1024 else 64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
    )


def build(path: Path, shape: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Path:
    import transformers

    with device:  # random init on the GPU: seconds instead of a minute on the host
        model = transformers.Qwen3ForCausalLM(qwen3_config(*SHAPES[shape])).to(dtype)
    model.save_pretrained(path)
    return path


def build_model(path: Path, hidden: int, layers: int, vocab: int, dtype: torch.dtype) -> Path:
    import transformers

    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(path)
    return path
