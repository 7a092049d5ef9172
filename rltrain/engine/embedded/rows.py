"""What the embedded engine's schedulers pass around: a queued request, one sample of it (a row),
and the SGLang result dict a finished row becomes."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rltrain.generation import SamplingParams


@dataclass
class GenRequest:
    """Prompts with one `SamplingParams` each (the same n): sample j of prompt i is seeded with
    `params[i].sampling_seed + j` when seeded. `ids`: each sample's meta_info id, prompt-major."""

    input_ids: list[list[int]]
    params: list[SamplingParams]
    return_logprob: bool
    ids: list[str] | None = None
    logprob_values: bool = False  # the log-probs alone (requests.py: logprob_format "values")
    future: Future = field(default_factory=Future)
    received: float = field(default_factory=time.time)

    def rows(self, eos_ids: set[int]) -> list[Row]:
        """One row per sample, prompt-major (the order of the answer)."""
        return [
            Row(self, prompt, i, j, None if p.sampling_seed is None else p.sampling_seed + j, p, eos_ids)
            for i, (prompt, p) in enumerate(zip(self.input_ids, self.params))
            for j in range(p.n)
        ]


@dataclass
class Row:
    """One sample being generated: its prompt, its own seed (None: the engine's shared generator),
    the tokens and log-probs so far, and why it finished (None while it runs)."""

    req: GenRequest
    prompt: list[int]
    prompt_index: int
    sample_index: int
    seed: int | None
    params: SamplingParams
    eos_ids: set[int]
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    cached: int = 0  # prompt tokens whose keys the prefix cache served (SGLang's cached_tokens)

    def __post_init__(self) -> None:
        self.max_new = self.params.max_new_tokens or 0
        self.stops = set(self.params.stop_token_ids or []) | (set() if self.params.ignore_eos else self.eos_ids)
        if self.max_new == 0:
            self.finish = {"type": "length", "length": 0}

    def append(self, token: int, logprob: float) -> bool:
        """Take one sampled token; True when the row has finished with it."""
        self.out.append(token)
        self.logprobs.append(logprob)
        if token in self.stops:
            self.finish = {"type": "stop", "matched": token}
        elif len(self.out) >= self.max_new:
            self.finish = {"type": "length", "length": len(self.out)}
        return self.finish is not None

    def result(self, weight_version: str, now: float) -> dict[str, Any]:
        """SGLang's result dict, with all of its meta_info keys (the contract test compares the key
        sets): this engine has no retractions, no reasoning parser, one DP rank."""
        k = self.prompt_index * self.params.n + self.sample_index
        meta: dict[str, Any] = {
            "id": self.req.ids[k] if self.req.ids is not None else uuid.uuid4().hex,
            "finish_reason": self.finish,
            "prompt_tokens": len(self.prompt),
            "weight_version": weight_version,
            "num_retractions": 0,
        }
        if self.req.return_logprob:
            meta["input_token_logprobs"] = []  # (filled by the server when logprob_start_len >= 0)
            if self.req.logprob_values:
                meta["output_token_logprob_values"] = self.logprobs
            else:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(self.logprobs, self.out)]
            meta["output_token_logprobs_length"] = len(self.logprobs)
        meta.update(
            reasoning_tokens=0,
            completion_tokens=len(self.out),
            cached_tokens=self.cached,
            weight_versions=[{"version": weight_version, "start": 0, "end": len(self.out)}],
            cached_tokens_details=None,
            dp_rank=None,
            e2e_latency=now - self.req.received,
            response_sent_to_client_ts=now,
        )
        return {"output_ids": self.out, "meta_info": meta}
