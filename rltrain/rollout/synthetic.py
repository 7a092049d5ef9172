"""The quickstarts' synthetic verifiable tasks and a tiny model + tokenizer built locally.

Task "addition" (configs/quickstart.yaml): prompts "a + b =" for single digits a, b; the answer is
a + b. The reward is the built-in `math` reward (the response's last number must equal the
answer). The tokenizer is a word-level tokenizer over exactly the task's words, so a random
policy's chance of a correct answer is about 1 in 20 and learning is visible in minutes on two
CPU cores.

Task "lookup" (configs/quickstart-tools.yaml): the prompt is "find" and the answer a digit drawn
per record, which only the `lookup` tool tells (it reads the trajectory's record): the model
cannot solve it without the tool. Its call is one word of the vocabulary, a Hermes
`<tool_call>` JSON object (`LOOKUP_CALL`); the tool's answer comes back through the tokenizer's
chat template as "<tool_response> d </tool_response>". `LookupTask` (a `ToolEnvironment`) scores
the trajectory: 1 for the right digit answered after a lookup that succeeded, 0.1 for a lookup
followed by a wrong answer, 0 for an answer without a lookup (a guess, right 1 time in 10, is not
accepted: only a grounded answer pays). The 0.1 is what makes it learnable from random weights:
an answer right by chance after a lookup is 1 in 18 at first, too rare to find the tool by.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from rltrain.rollout.env import TOOL_CALL, EnvStep, ToolEnvironment
from rltrain.runtime.files import make_readable

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def addition_words() -> list[str]:
    return [str(i) for i in range(19)] + ["+", "="]


def addition_records() -> list[dict]:
    return [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]


LOOKUP_CALL = '<tool_call>{"name":"lookup","arguments":{}}</tool_call>'  # one word: the whole call
# The tiny tokenizer's chat template: the prompt's words, each model turn's, and a tool's answer
# between its markers (no schemas: the tiny model cannot read them).
LOOKUP_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%} <tool_response> {{ m['content'] }} </tool_response>"
    "{%- else -%}{{ '' if loop.first else ' ' }}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)


def lookup_words() -> list[str]:
    return [str(i) for i in range(10)] + ["find", LOOKUP_CALL, "<tool_response>", "</tool_response>"]


def lookup_records(count: int = 100, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": "find", "answer": str(rng.randrange(10)), "id": i} for i in range(count)]


def lookup(record: dict) -> str:
    """The value this task asks for: the only way to know it."""
    return str(record["answer"])


class LookupTask(ToolEnvironment):
    """The lookup task's trajectory (module doc): the tools' environment, scored here."""

    looked_up = False

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        if TOOL_CALL.search(text):
            out = super().step(text, token_ids)
            assert isinstance(out.observation, list)
            answers = [m for m in out.observation if isinstance(m, dict)]
            self.looked_up |= any(not str(m["content"]).startswith("error:") for m in answers)
            return EnvStep(out.observation, reward=0.0)
        right = text.strip() == str(self.record["answer"])
        return EnvStep(None, reward=(1.0 if right else 0.1) if self.looked_up else 0.0)


TASKS = {  # name -> (vocabulary, records, chat template)
    "addition": (addition_words, addition_records, None),
    "lookup": (lookup_words, lookup_records, LOOKUP_TEMPLATE),
}


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
    path: Path,
    words: list[str],
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    experts: int = 0,
    chat_template: str | None = None,
    qwen3: bool = False,
) -> Path:
    """A random Qwen2 (`qwen3`: a Qwen3; with `experts`, a Qwen3-MoE routing each token to 2 of
    them) and its tokenizer (with `chat_template`), written atomically to `path`. (transformers 5
    loads a "qwen2" checkpoint's tokenizer as its own byte-level BPE, whatever tokenizer.json
    says: words of letters then tokenise to nothing. A "qwen3" one's is read as written.)"""

    tokenizer = build_tokenizer(words)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
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
    elif qwen3:
        cfg = transformers.Qwen3Config(**common)
    else:
        cfg = transformers.Qwen2Config(**common)
    torch.manual_seed(seed)
    kind = transformers.Qwen3MoeForCausalLM if experts else transformers.Qwen3ForCausalLM if qwen3 else None
    model = (kind or transformers.Qwen2ForCausalLM)(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    make_readable(tmp)
    os.replace(tmp, path)
    return path
