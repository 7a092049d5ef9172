"""A generation request and its result: SGLang's native /generate protocol, as rltrain speaks it.

Below the engine and the rollout, which both use it (the engine's client and server build and
parse these; the rollout turns completions into samples).

Both servers rltrain drives speak this: real SGLang (`python -m sglang.launch_server`) and the
embedded engine (`python -m rltrain.engine.embedded`). Token ids in, token ids out
(`skip_tokenizer_init`): tokenisation stays in the trainer process, so both sides agree on ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    """The subset of SGLang's sampling parameters rltrain uses (same names, same defaults, the
    same range checks in SGLang's words). `max_new_tokens` None: as many as the context leaves."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def to_json(self) -> dict[str, Any]:
        """SGLang's sampling_params (None left out, logit_bias keyed by strings as JSON keys are):
        built once per request of every multi-turn trajectory, so field by field, copying the
        list, instead of `asdict`'s deep copy of every field (~12 of the client's ~95 us of CPU
        per request on a 2-core dev machine)."""
        d: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "logit_bias":
                v = {str(k): b for k, b in v.items()}
            elif isinstance(v, list):
                v = list(v)
            d[f.name] = v
        return d

    @property
    def penalized(self) -> bool:
        """Whether the penalties or the logit bias change this request's logits."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def validate(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {self.repetition_penalty}.")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], got {self.min_new_tokens}."
            )
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")


@dataclass
class Completion:
    """One sampled continuation. `ok` is False when the request failed: never a usable sample."""

    prompt_index: int
    sample_index: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""  # "stop", "length", "abort" or "" when failed
    matched_stop: int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served from the engine's prefix cache (SGLang's radix cache)
    weight_version: str | None = None
    error: str | None = None
    # A multi-turn trajectory (rollout/multiturn.py): 1 on the tokens the model sampled, 0 on the
    # environment's (None: every token is sampled, as in a single-turn completion).
    loss_mask: list[int] | None = None
    # A sample cut by a weight update and continued on the new weights (loop.in_flight_update=
    # continue): the version that sampled each output token (None: all of them `weight_version`,
    # which is then the oldest of these).
    token_versions: list[str | None] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")


def generate_body(
    input_ids: list[list[int]],
    params: SamplingParams,
    return_logprob: bool = True,
    first: int = 0,
    logprob_values: bool = False,
) -> dict[str, Any]:
    """A batched /generate request body with one row per sample: prompt i's `params.n` samples
    are n rows of n=1, each with its own sampling seed (`sample_seed`) when `params` has one.
    SGLang copies a request's sampling params to each of its n samples, and its seeded sampler
    depends on (seed, position) only, so one seed for n samples makes them all the same; n > 1
    in a batch also takes its slow path. `first`: the first prompt's place in the whole call.
    `logprob_values`: the log-probs as a list of values (the embedded engine's `logprob_format`)."""
    rows, per_row = [], []
    one = {**params.to_json(), "n": 1}
    for i, prompt in enumerate(input_ids):
        for j in range(params.n):
            rows.append(prompt)
            seed = sample_seed(params, first + i, j)
            per_row.append(one if seed is None else {**one, "sampling_seed": seed})
    body = {"input_ids": rows, "sampling_params": per_row, "return_logprob": return_logprob, "stream": False}
    if return_logprob and logprob_values:
        body["logprob_format"] = "values"
    return body


def sample_seed(params: SamplingParams, prompt: int, sample: int) -> int | None:
    """The sampling seed of sample `sample` of prompt `prompt` (None: unseeded): one stream each."""
    if params.sampling_seed is None:
        return None
    return params.sampling_seed + prompt * params.n + sample


def parse_generate_response(data: Any, num_prompts: int, n: int, first_prompt: int = 0) -> list[Completion]:
    """One entry per sample, prompt-major (prompt i, sample j at i * n + j), as SGLang returns
    a request of n samples per prompt and `generate_body`'s one row per sample alike."""
    items = data if isinstance(data, list) else [data]
    if len(items) != num_prompts * n:
        raise ProtocolError(f"/generate returned {len(items)} results for {num_prompts} prompts x n={n}")
    out = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or "meta_info" not in item:
            raise ProtocolError(f"/generate result {k} has no meta_info: {str(item)[:200]}")
        meta = item["meta_info"]
        fr = meta.get("finish_reason") or {}
        kind = fr.get("type", "") if isinstance(fr, dict) else str(fr)
        values = meta.get("output_token_logprob_values")  # (the embedded engine's logprob_format "values")
        if isinstance(values, list):
            lp = logprob_values(values)
        else:
            lp = [logprob(e[0]) for e in meta.get("output_token_logprobs") or []]
        ids = list(item.get("output_ids") or [])
        c = Completion(
            prompt_index=first_prompt + k // n,
            sample_index=k % n,
            output_ids=ids,
            logprobs=lp,
            finish_reason=kind,
            matched_stop=fr.get("matched") if isinstance(fr, dict) and isinstance(fr.get("matched"), int) else None,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=meta.get("weight_version"),
        )
        if kind == "abort":
            c.error = f"aborted by the engine: {fr.get('message', '')}".strip()
        elif kind not in ("stop", "length"):
            c.error = f"unexpected finish reason {fr!r}"
        elif lp and len(lp) != len(ids):
            c.error = f"{len(lp)} logprobs for {len(ids)} output tokens"
        out.append(c)
    return out


def logprob_values(values: list[Any]) -> list[float]:
    """The log-probs of a list of values (null: NaN), as floats."""
    return [logprob(v) for v in values] if None in values else values


def logprob(x: Any) -> float:
    """A log-prob from an answer: null is NaN (SGLang's orjson, and this engine's, write NaN as null)."""
    return float("nan") if x is None else float(x)


class ProtocolError(RuntimeError):
    """The server answered something that does not follow the protocol."""
