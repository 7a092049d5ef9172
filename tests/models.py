"""Tiny random HF checkpoints saved locally (no downloads), for engine and trainer tests, and the
tests' model shapes by name (`ModelShape`, as the benchmarks name theirs in rltrain.bench.models)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from rltrain.bench.models import ModelShape, scaled_qwen2


def tiny(vocab: int = 256, hidden: int = 64, layers: int = 2) -> ModelShape:
    """The engine and trainer tests' model (`make_model`; `make_moe_model`'s attention)."""
    return ModelShape(
        vocab=vocab,
        hidden=hidden,
        intermediate=hidden * 2,
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=hidden // 4,
        max_positions=1024,
    )


# Narrower still, for models built only for their weight names (the routing tests' architectures).
NARROW = ModelShape(vocab=64, hidden=16, intermediate=32, layers=2, heads=2, kv_heads=1, max_positions=64)
# Two heads, transformers' own position limit (a config the paged engine refuses, with a sliding window).
SMALL = ModelShape(vocab=64, hidden=32, intermediate=64, layers=2, heads=2, kv_heads=1)
# The SGLang GPU tests' model: 0.16 B parameters, big enough for SGLang's kernels to be the real ones.
QWEN2_160M = scaled_qwen2(hidden=1024, layers=8, vocab=32000)

ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


def make_model(
    path: Path, seed: int, arch: str = "qwen2", vocab: int = 256, hidden: int = 64, layers: int = 2, peaked: float = 8.0
) -> Path:
    """Save a random model. `peaked` scales the LM head so greedy choices have clear margins:
    argmax then does not flip between engines that differ in float rounding."""
    cfg_cls, model_cls = ARCHS[arch]
    cfg = cfg_cls(**tiny(vocab, hidden, layers).config_kwargs(), eos_token_id=vocab - 1, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    model.save_pretrained(path)
    return path


def random_batch(vocab: int = 8192, rows: int = 8, length: int = 32, seed: int = 0):
    """A train batch of random tokens, every position in the loss, random advantages (the GPU
    tests' trainer steps)."""
    from rltrain.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    return TrainBatch(
        torch.randint(1, vocab, (rows, length), generator=g),
        torch.ones(rows, length, dtype=torch.long),
        torch.ones(rows, length),
        advantages=torch.randn(rows, length, generator=g),
    )


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (the reference)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            g = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                min_new_tokens=max_new_tokens,
            )
        outs.append(g[0, len(p) :].tolist())
    return outs


def engine_greedy(client, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """An engine's greedy continuations (fixed length); fails the test on any failed sample."""
    from rltrain.generation import SamplingParams

    out = client.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    assert all(c.ok for c in out), [c.error for c in out if not c.ok]
    return [c.output_ids for c in out]


def make_moe_model(
    path: Path, seed: int, experts: int = 4, vocab: int = 256, hidden: int = 64, layers: int = 2
) -> Path:
    """A tiny Qwen3-MoE (transformers keeps its experts fused; checkpoints name them per expert)."""
    cfg = transformers.Qwen3MoeConfig(
        **tiny(vocab, hidden, layers).config_kwargs(),
        moe_intermediate_size=hidden,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path
