"""Tiny random HF checkpoints saved locally (no downloads), for engine and trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

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
    cfg = cfg_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)
    model.save_pretrained(path)
    return path


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
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=1024,
        tie_word_embeddings=False,
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
