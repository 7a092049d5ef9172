"""What is sampled and how it is scored: the prompts (data), held-out evaluation (eval), sampling
and multi-turn rollouts (rollout), rewards (reward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltrain.config.errors import ConfigError

# apply_chat_template's own arguments: set by rltrain, never by data.chat_template_kwargs
_TEMPLATE_OWN = (
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "chat_template",
    "documents",
)


@dataclass
class DataConfig:
    """Prompts: a jsonl/parquet file, a `datasets.save_to_disk` directory, or synthetic:addition or
    synthetic:lookup (written into the run directory)."""

    path: str = ""
    prompts_per_step: int = 32  # global batch of prompts per step, split across ranks
    max_prompt_tokens: int = 1024
    chat_template: bool = False
    # Passed to the chat template wherever rltrain renders one (prompts, multi-turn observations),
    # e.g. {enable_thinking: false} for Qwen3 (verl's apply_chat_template_kwargs).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # rltrain's field name -> the dataset's column, e.g. {prompt: question, answer: solution}
    fields: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if not self.path:
            raise ConfigError(
                "data.path is required: a .jsonl or .parquet file, a datasets save_to_disk directory, "
                "or synthetic:addition"
            )
        if self.path.startswith("synthetic:") and self.path not in ("synthetic:addition", "synthetic:lookup"):
            raise ConfigError(f"data.path={self.path!r}: the synthetic tasks are: synthetic:addition, synthetic:lookup")
        if self.prompts_per_step < 1:
            raise ConfigError(f"data.prompts_per_step={self.prompts_per_step}: expected >= 1")
        bad = {k: v for k, v in self.fields.items() if not isinstance(k, str) or not isinstance(v, str) or not v}
        if bad:
            raise ConfigError(
                f"data.fields {bad}: expected rltrain's field names mapped to the dataset's column names, e.g. "
                "{prompt: question, answer: solution}"
            )
        own = sorted(k for k in self.chat_template_kwargs if k in _TEMPLATE_OWN or not str(k).isidentifier())
        if own:
            raise ConfigError(
                f"data.chat_template_kwargs: {own} cannot be set here (rltrain passes the messages, tools and "
                "generation prompt itself; keys are the template's own variables, e.g. enable_thinking)"
            )


@dataclass
class EvalConfig:
    """Evaluation during training on held-out prompts (rollout/evaluation.py): off while `path`
    is empty. Sampled greedily by default; pass@k for k = 1, 2, 4, ... up to n."""

    path: str = ""  # the formats of data.path (its data.fields too), or synthetic:addition
    every: int = 0  # evaluate after every this many steps (0: never after a step)
    before_train: bool = False  # and the weights the run starts from
    n: int = 1  # samples per prompt
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 0  # 0: rollout.max_new_tokens
    max_prompts: int = 0  # the first this many of the file's prompts (0: all)

    def check(self) -> None:
        if self.every < 0 or self.n < 1 or self.max_prompts < 0 or self.max_new_tokens < 0:
            raise ConfigError(
                f"eval: every={self.every}, n={self.n}, max_prompts={self.max_prompts}, max_new_tokens="
                f"{self.max_new_tokens}: expected every, max_prompts, max_new_tokens >= 0 and n >= 1"
            )
        if self.path and not (self.every or self.before_train):
            raise ConfigError(
                f"eval.path={self.path!r} is set but never used: set eval.every (steps) or eval.before_train=true"
            )
        if not self.path and (self.every or self.before_train):
            raise ConfigError("eval.every / eval.before_train need eval.path: the held-out prompts to evaluate on")
        if self.path.startswith("synthetic:") and self.path != "synthetic:addition":
            raise ConfigError(f"eval.path={self.path!r}: the synthetic evaluation set is synthetic:addition")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"eval: temperature={self.temperature}, top_p={self.top_p}: expected >= 0 and (0, 1]")


@dataclass
class RolloutConfig:
    """Sampling on the engine."""

    n: int = 8  # samples per prompt (one group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Token ids that end a response besides the model's EOS (SGLang's stop_token_ids); the
    # stop token is part of the response, as EOS is.
    stop_token_ids: list[int] = field(default_factory=list)
    # Each step's requests carry sampling seeds derived from (run.seed, step, rank): a resumed
    # run samples what the uninterrupted run sampled (exactly so with engine.deterministic).
    # false: every sample still has its own seed, drawn from the rank's own generator (an
    # unseeded row would get SGLang's fixed seed 42 under engine.deterministic); a resumed run
    # then samples otherwise.
    seeded: bool = True
    # Multi-turn rollouts (rollout/env.py, rollout/multiturn.py): an environment per trajectory,
    # module:Class made with the data record; or `tools` (module:function each) for the built-in
    # tool environment (Qwen/Hermes <tool_call> JSON). Neither: one prompt, one response.
    env: str | None = None
    tools: list[str] = field(default_factory=list)
    max_turns: int = 8  # model turns per trajectory
    # Tokens after the first prompt (sampled and observations); 0: max_new_tokens x max_turns.
    max_trajectory_tokens: int = 0
    tool_timeout_s: float = 10.0  # a tool call that takes longer gives the model an error text
    # A turn cut at max_new_tokens ends its trajectory (finish reason length), or (true) goes to
    # the environment like any other turn.
    continue_after_length: bool = False

    @property
    def multi_turn(self) -> bool:
        return bool(self.env or self.tools)

    def check(self) -> None:
        if self.max_turns < 1 or self.max_trajectory_tokens < 0 or not self.tool_timeout_s > 0:
            raise ConfigError(
                f"rollout.max_turns={self.max_turns} (>= 1), rollout.max_trajectory_tokens="
                f"{self.max_trajectory_tokens} (>= 0) and rollout.tool_timeout_s={self.tool_timeout_s} (> 0)"
            )
        if self.n < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"rollout.n={self.n}, rollout.max_new_tokens={self.max_new_tokens}: both must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature}: RL needs sampling, expected > 0")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise ConfigError(f"rollout.stop_token_ids: {bad[:5]} are not token ids (expected >= 0)")


@dataclass
class RewardConfig:
    # math, exact_match, format, or module:function (called as fn(response_text, record) -> float)
    function: str = "math"
    format_regex: str | None = None
    timeout_s: float = 10.0
    workers: int = 4
    pass_threshold: float = 1.0  # a sample "passes" when its reward is at least this
