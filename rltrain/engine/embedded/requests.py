"""The embedded engine's /generate request: SGLang's `GenerateReqInput` and `SamplingParams`,
parsed and checked before anything is queued.

Contract: `parse_generate(body, limits)` returns a `Generate` or raises `BadRequest` whose message
names the field, the value seen and what is allowed (SGLang's wording where SGLang has one). No
tensor is touched and nothing is queued, so a bad request can never affect another one.

What is taken, by SGLang's field names (sglang 0.5.23, `managers/io_struct.py` and
`sampling/sampling_params.py`):
- implemented: `input_ids`, `sampling_params` (one object, or one per prompt), `return_logprob`,
  `logprob_start_len`, `rid`; in sampling params `max_new_tokens`, `min_new_tokens`,
  `stop_token_ids`, `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`,
  `presence_penalty`, `repetition_penalty`, `ignore_eos`, `n`, `logit_bias`, `sampling_seed`;
- accepted, with nothing to do here: fields about text this engine never produces
  (`skip_special_tokens`, ...), logging (`log_metrics`, `no_logs`), scheduling and caching hints
  (`priority`, `extra_key`, `cache_salt`, ...), and every other field at its default value;
- any other value of an SGLang field: 400 "not supported by the embedded engine: <field>";
- a field SGLang does not have: 400 naming it (SGLang ignores unknown request fields, and
  refuses unknown sampling fields; a typo here is never silently ignored), except this engine's
  own `logprob_format`: "triples" (SGLang's `output_token_logprobs`, [log-prob, token, null] per
  token; the default) or "values" (`output_token_logprob_values`, the log-probs alone, the tokens
  being `output_ids`: a rollout's answer is parsed several times faster).

The other endpoints' bodies are read field by field with `required` and `weight_version_of`,
which raise `BadRequest` the same way.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, replace
from typing import Any

from rltrain.generation import SamplingParams


class BadRequest(ValueError):
    """A request that cannot be served as sent: answered 400 with this message."""


@dataclass(frozen=True)
class Limits:
    """What the serving engine allows: its vocabulary, context length and batch rows."""

    vocab_size: int
    context_length: int
    max_rows: int  # sequences one request may ask for (prompts x n)


@dataclass(frozen=True)
class Generate:
    """A checked /generate request: one `SamplingParams` per prompt (the same `n` in each)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    return_logprob: bool
    logprob_start_len: int  # -1: no input log-probs (SGLang's default)
    ids: list[str]  # meta_info["id"] of each sample, prompt-major
    single: bool  # the answer is one object, not a list (one prompt, n == 1, not batched)
    logprob_values: bool = False  # logprob_format "values" (module doc)

    @property
    def n(self) -> int:
        return self.params[0].n


# GenerateReqInput's fields (sglang 0.5.23), each with what the embedded engine does with it.
IMPLEMENTED = ("input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid")
EXTENSIONS = ("logprob_format",)  # this engine's own (module doc)
LOGPROB_FORMATS = ("triples", "values")
NO_EFFECT = (  # taken as sent: they change nothing this engine returns
    "log_metrics",
    "no_logs",
    "priority",
    "extra_key",
    "cache_salt",
    "custom_labels",
    "conversation_id",
    "external_trace_header",
    "routing_key",
    "received_time",
    "return_text_in_logprobs",  # no text in log-probs: there is no tokenizer
)
AT_DEFAULT_ONLY = {  # served only at SGLang's default (None, False, 0 or an empty value)
    "text": "this engine does not tokenize text: send input_ids",
    "session_id": "",
    "input_embeds": "",
    "image_data": "",
    "video_data": "",
    "audio_data": "",
    "mm_hashes": "",
    "mm_content_hashes": "",
    "use_audio_in_video": "",
    "video_config": "",
    "watermark": "",
    "top_logprobs_num": "",
    "token_ids_logprob": "",
    "return_sampling_mask": "",
    "sampling_logprobs_mode": "",
    "return_flat_raw_top_logprobs": "",
    "return_flat_raw_output_top_logprobs": "",
    "return_flat_raw_top_logprobs_b64": "",
    "stream": "answers come whole; send stream=false",
    "return_hidden_states": "",
    "return_routed_experts": "",
    "routed_experts_start_len": "",
    "return_indexer_topk": "",
    "modalities": "",
    "session_params": "",
    "lora_path": "",
    "lora_id": "",
    "custom_logit_processor": "",
    "positional_embed_overrides": "",
    "bootstrap_host": "",
    "bootstrap_port": "",
    "bootstrap_room": "",
    "bootstrap_pair_key": "",
    "decode_tp_size": "",
    "routed_dp_rank": "",
    "data_parallel_rank": "",
    "disagg_prefill_dp_rank": "",
    "http_worker_ipc": "",
    "background": "",
    "require_reasoning": "",
    "max_thinking_tokens": "",
    "return_bytes": "",
    "return_entropy": "",
    "return_prompt_token_ids": "",
    "need_wait_for_mm_inputs": "",
    "num_items_assigned": "",
    "encoder_urls": "",
    "max_dynamic_patch": "",
    "min_dynamic_patch": "",
    "image_max_dynamic_patch": "",
    "video_max_dynamic_patch": "",
    "images_config": "",
    "mm_processor_kwargs": "",
    "multi_item_delimiter_indices": "",
    "token_indices_to_pool": "",
    "kv_hints": "",
}

# SamplingParams' fields (sglang 0.5.23).
SAMPLING_IMPLEMENTED = (
    "max_new_tokens",
    "min_new_tokens",
    "stop_token_ids",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "n",
    "logit_bias",
    "sampling_seed",
)
SAMPLING_NO_EFFECT = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")
SAMPLING_AT_DEFAULT_ONLY = {
    "stop": "stop strings need a tokenizer: send stop_token_ids",
    "stop_regex": "stop strings need a tokenizer: send stop_token_ids",
    "json_schema": "",
    "regex": "",
    "ebnf": "",
    "structural_tag": "",
    "custom_params": "",
    "watermark": "",
    "beam_width": "",
}

SAMPLING_EPS = 1e-6  # SGLang's: a temperature below it samples greedily
INT64 = (-(2**63), 2**63 - 1)


def parse_generate(body: dict[str, Any], limits: Limits) -> Generate:
    """A /generate body, checked field by field (see the module docstring); `BadRequest` names
    the first field that is wrong."""
    _known_fields(
        body,
        "",
        IMPLEMENTED + NO_EFFECT + EXTENSIONS,
        AT_DEFAULT_ONLY,
        "in a /generate request (SGLang's GenerateReqInput has no such field)",
    )
    prompts, batched = _prompts(body.get("input_ids"), limits.vocab_size)
    params = _sampling(body.get("sampling_params"), len(prompts), limits.vocab_size)
    stated = _states_max_new_tokens(body.get("sampling_params"), len(prompts))
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest(f"sampling_params: n must be the same for every prompt, got {[p.n for p in params]}")
    rows = len(prompts) * n
    if rows > limits.max_rows:
        raise BadRequest(
            f"the request asks for {rows} sequences ({len(prompts)} prompts x n={n}); this engine decodes at most "
            f"{limits.max_rows} together (--max-batch-size): send fewer per request"
        )
    params = [_fit_context(p, prompt, limits.context_length, s) for p, prompt, s in zip(params, prompts, stated)]
    return_logprob = _bool(body, "return_logprob", False)
    start = body.get("logprob_start_len")
    if start is None:
        start = -1
    if type(start) is not int or start < -1:
        raise BadRequest(f"logprob_start_len={_show(start)}: expected an integer >= -1 (-1: no input log-probs)")
    longest = max(len(p) for p in prompts)
    if start > longest:
        raise BadRequest(f"logprob_start_len={start} is past the end of the prompt ({longest} tokens)")
    fmt = body.get("logprob_format", "triples")
    if fmt not in LOGPROB_FORMATS:
        raise BadRequest(f"logprob_format={_show(fmt)}: expected one of {', '.join(LOGPROB_FORMATS)}")
    single = not batched and n == 1
    ids = _ids(body.get("rid"), len(prompts), n, single)
    return Generate(prompts, params, return_logprob, start, ids, single, fmt == "values")


def _prompts(ids: Any, vocab: int) -> tuple[list[list[int]], bool]:
    """(the prompts, whether the request was a batch)."""
    if ids is None:
        raise BadRequest("input_ids is required (this engine does not tokenize text)")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"input_ids={_show(ids)}: expected a non-empty list of token ids or of such lists")
    batched = isinstance(ids[0], list)
    prompts = ids if batched else [ids]
    for k, prompt in enumerate(prompts):
        where = f"input_ids[{k}]" if batched else "input_ids"
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(f"{where}={_show(prompt)}: expected a non-empty list of token ids")
        bad = [t for t in prompt if type(t) is not int or not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{where}: token ids {_show(bad[:5])} are outside the vocabulary [0, {vocab})")
    return prompts, batched


def _sampling(sp: Any, prompts: int, vocab: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt: a single object applies to every prompt."""
    if sp is None:
        sp = {}
    if isinstance(sp, dict):
        one = _sampling_one(sp, "sampling_params", vocab)
        return [one] * prompts
    if isinstance(sp, list):
        if len(sp) != prompts:
            raise BadRequest(f"sampling_params: a list needs one object per prompt ({prompts}), got {len(sp)}")
        out = []
        for k, item in enumerate(sp):
            if not isinstance(item, dict):
                raise BadRequest(f"sampling_params[{k}]={_show(item)}: expected an object")
            out.append(_sampling_one(item, f"sampling_params[{k}]", vocab))
        return out
    raise BadRequest(f"sampling_params={_show(sp)}: expected an object, or a list of one object per prompt")


def _known_fields(
    d: dict[str, Any], where: str, taken: tuple[str, ...], at_default: dict[str, str], unknown: str
) -> None:
    """Every key of `d` is taken, or an SGLang field at its default value; `BadRequest` names the
    first that is neither (`where`: the object's place in the request, "" for the body)."""
    prefix = f"{where}." if where else ""
    for key, value in d.items():
        if key in taken or (key in at_default and _is_default(value)):
            continue
        if key in at_default:
            why = at_default[key]
            raise BadRequest(
                f"not supported by the embedded engine: {prefix}{key}={_show(value)}" + (f" ({why})" if why else "")
            )
        raise BadRequest(f"unknown field {key!r} {unknown}")


def _sampling_one(d: dict[str, Any], where: str, vocab: int) -> SamplingParams:
    taken = SAMPLING_IMPLEMENTED + SAMPLING_NO_EFFECT
    _known_fields(d, where, taken, SAMPLING_AT_DEFAULT_ONLY, f"in {where}; expected one of {', '.join(taken)}")
    # max_new_tokens: SGLang's default 128 when absent; null: as many as the context leaves.
    max_new = SamplingParams().max_new_tokens
    if "max_new_tokens" in d:
        max_new = _int(d, where, "max_new_tokens", None, low=0)
    p = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=_int(d, where, "min_new_tokens", 0, low=0),
        temperature=_float(d, where, "temperature", 1.0, low=0.0),
        top_p=_float(d, where, "top_p", 1.0),
        top_k=_int(d, where, "top_k", -1),
        min_p=_float(d, where, "min_p", 0.0),
        frequency_penalty=_float(d, where, "frequency_penalty", 0.0),
        presence_penalty=_float(d, where, "presence_penalty", 0.0),
        repetition_penalty=_float(d, where, "repetition_penalty", 1.0),
        stop_token_ids=_token_list(d, where, "stop_token_ids"),
        ignore_eos=_bool(d, "ignore_eos", False, where),
        n=_int(d, where, "n", 1, low=1),
        sampling_seed=_int(d, where, "sampling_seed", None, low=INT64[0], high=INT64[1]),
        logit_bias=_logit_bias(d, where, vocab),
    )
    if p.temperature < SAMPLING_EPS:  # SGLang: 0 <= temperature < 1e-6 is greedy (no 1/temperature overflow)
        p = replace(p, temperature=0.0)
    try:
        p.validate()
    except ValueError as err:
        raise BadRequest(f"{where}: {err}") from None
    return p


def _states_max_new_tokens(sp: Any, prompts: int) -> list[bool]:
    """Per prompt, whether its sampling params state max_new_tokens (checked by `_sampling`)."""
    if isinstance(sp, list):
        return ["max_new_tokens" in d for d in sp]
    return [isinstance(sp, dict) and "max_new_tokens" in sp] * prompts


def _fit_context(p: SamplingParams, prompt: list[int], context: int, stated: bool) -> SamplingParams:
    """SGLang's context checks, in its words: the prompt must leave room, and prompt + a stated
    max_new_tokens must fit. As in SGLang, a null max_new_tokens is what the context leaves,
    and an absent one its default (128) stopped at the context's end."""
    if len(prompt) >= context:
        raise BadRequest(
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({context} tokens)."
        )
    room = context - len(prompt)
    if p.max_new_tokens is None or (not stated and p.max_new_tokens > room):
        return replace(p, max_new_tokens=room, min_new_tokens=min(p.min_new_tokens, room))
    total = len(prompt) + p.max_new_tokens
    if total > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {total} tokens: {len(prompt)} tokens from the input messages and {p.max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )
    return p


def _ids(rid: Any, prompts: int, n: int, single: bool) -> list[str]:
    """Each sample's `meta_info["id"]`, as SGLang names them: `rid` itself for a single answer,
    `rid_<k>` for each of a batch's samples from one string, the list's entries (one per prompt,
    `_<j>` added per sample when n > 1), or fresh uuid4 hex ids."""
    rows = prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(rows)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{k}" for k in range(rows)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != prompts:
            raise BadRequest(f"rid: {len(rid)} ids for a batch of {prompts} prompts (one per prompt)")
        if len(set(rid)) != len(rid):
            raise BadRequest(f"rid: duplicate request ids {sorted({r for r in rid if rid.count(r) > 1})[:5]}")
        return [r if n == 1 else f"{r}_{j}" for r in rid for j in range(n)]
    raise BadRequest(f"rid={_show(rid)}: expected a string or a list of strings (one per prompt)")


# ---------------------------------------------------------------------- field checks


def required(body: dict[str, Any], key: str, kind: type) -> Any:
    """`body[key]`, of type `kind` (an int may come as its decimal string)."""
    if key not in body:
        raise BadRequest(f"{key} is required")
    v = body[key]
    if kind is int and isinstance(v, (int, str)) and str(v).lstrip("-").isdigit():
        return int(v)
    if not isinstance(v, kind):
        raise BadRequest(f"{key}: expected {kind.__name__}, got {type(v).__name__}")
    return v


def weight_version_of(body: dict[str, Any]) -> str | None:
    """The request's weight_version: a string, or absent (the engine's stays)."""
    v = body.get("weight_version")
    if v is not None and not isinstance(v, str):
        raise BadRequest(f"weight_version={v!r}: expected a string")
    return v


def _int(
    d: dict[str, Any], where: str, key: str, default: int | None, low: int | None = None, high: int | None = None
) -> Any:
    v = d.get(key)
    if v is None:
        return default
    if type(v) is not int:
        raise BadRequest(f"{where}.{key}={_show(v)}: expected an integer")
    if (low is not None and v < low) or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{where}.{key}={v}: expected an integer {span}")
    return v


def _float(d: dict[str, Any], where: str, key: str, default: float, low: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if type(v) not in (int, float):
        raise BadRequest(f"{where}.{key}={_show(v)}: expected a number")
    v = float(v)
    if not math.isfinite(v):
        raise BadRequest(f"{where}.{key}={v}: expected a finite number")
    if low is not None and v < low:
        raise BadRequest(f"{where}.{key}={v}: expected a number >= {low}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if type(v) is not bool:
        raise BadRequest(f"{where + '.' if where else ''}{key}={_show(v)}: expected true or false")
    return v


def _token_list(d: dict[str, Any], where: str, key: str) -> list[int] | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or any(type(t) is not int or t < 0 for t in v):
        raise BadRequest(f"{where}.{key}={_show(v)}: expected a list of token ids (integers >= 0)")
    return list(v) or None


def _logit_bias(d: dict[str, Any], where: str, vocab: int) -> dict[int, float] | None:
    v = d.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadRequest(f"{where}.logit_bias={_show(v)}: expected an object of token id -> bias")
    out = {}
    for k, b in v.items():
        if not isinstance(k, str) or not k.strip().lstrip("-").isdigit():
            raise BadRequest(f"{where}.logit_bias: key {_show(k)} is not a token id")
        if not 0 <= int(k) < vocab:  # SGLang's words
            raise BadRequest(f"logit_bias must has keys in [0, {vocab - 1}], got {int(k)}.")
        if type(b) not in (int, float) or not math.isfinite(b):
            raise BadRequest(f"{where}.logit_bias[{k}]={_show(b)}: expected a finite number")
        out[int(k)] = float(b)
    return out or None


def _is_default(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == "" or v == [] or v == {}


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."
