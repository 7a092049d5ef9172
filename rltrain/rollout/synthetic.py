"""The quickstart's synthetic verifiable task and a tiny model + tokenizer built locally.

Task "addition": prompts "a + b =" for single digits a, b; the answer is a + b. The reward is the
built-in `math` reward (the response's last number must equal the answer). The tokenizer is a
word-level tokenizer over exactly the task's words, so a random policy's chance of a correct
answer is about 1 in 20 and learning is visible in minutes on two CPU cores.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rltrain.runtime.files import make_readable

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def addition_words() -> list[str]:
    return [str(i) for i in range(19)] + ["+", "="]


def addition_records() -> list[dict]:
    return [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # (mkstemp makes it 0600)
    os.replace(tmp, path)
    return path


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # No decoder: the words come back joined by single spaces.
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def build_tiny_model(
    path: Path, words: list[str], hidden: int = 64, layers: int = 2, seed: int = 0, experts: int = 0
) -> Path:
    """A random Qwen2 (or, with `experts`, a Qwen3-MoE routing each token to 2 of them) and its
    tokenizer, written atomically to `path`."""

    tokenizer = build_tokenizer(words)
    heads = max(4, hidden // 64)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=hidden // heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    cfg: transformers.PretrainedConfig
    if experts:
        cfg = transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=hidden * 2,
            num_experts=experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    else:
        cfg = transformers.Qwen2Config(**common)
    torch.manual_seed(seed)
    model = (transformers.Qwen3MoeForCausalLM if experts else transformers.Qwen2ForCausalLM)(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    make_readable(tmp)
    os.replace(tmp, path)
    return path
