"""Weight updates under a rollout still in flight (`loop.in_flight_update`, with loop.max_staleness).

    gate = UpdateGate(timeout_s)                                  # (a wait on it is bounded)
    client = InFlightClient(engine_client, gate, "continue")       # what the rollout ahead uses
    gate.close(); pause the engines (mode abort); update their weights; continue them; gate.open()

Closing the gate marks an update: the engines' pause (SGLang's /pause_generation with mode abort;
the embedded engine's alike) ends every row in flight with finish reason abort, its tokens so
far in the answer. The client takes such a row as cut by the update (an abort while no update was
marked stays a failed generation, as ever), holds it, and any new request, until the gate opens
(the engines then serve the new weights), and then:

- continue (partial rollout): sends the row's running ids (the prompt and what it sampled) with
  the tokens it has left (and what is left of min_new_tokens), on its own sampling seed (the
  sample's own where it was cut before its first token), and joins the two parts: the output ids and
  the engine's log-probs of both, and the version that sampled each token (`token_versions`;
  the sample's `weight_version` becomes its oldest token's, which the staleness bound judges);
- requeue: samples the row again from its prompt, with the seed it had.

The penalties (frequency, presence, repetition) of a continuation count the tokens it samples
itself: the cut part is its prompt there, as SGLang counts a request's prompt.

A continued row cut again by the next update goes on the same way. This is retract's semantics
(the context is prefilled again on the new weights) done by the client, which alone knows where
each part starts: SGLang's in_place pause keeps keys and values the old weights computed and
reports no per-token version. The engines' radix cache needs no flush for it (a weight update
flushes it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from rltrain.generation import Completion, SamplingParams, sample_seed
from rltrain.interfaces import RolloutClient


class UpdateGate:
    """Open while the engines serve; closed by the loop around a weight update (`updates` counts
    the updates begun, so a client can tell whether an abort came from one)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.updates = 0
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self.updates += 1
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait_open(self) -> None:
        if not self._open.wait(self.timeout_s):
            raise TimeoutError(
                f"the rollout ahead waited {self.timeout_s:.0f}s for a weight update to end (world.timeout_s)"
            )


@dataclasses.dataclass
class InFlightStats:
    cut: int = 0  # rows a weight update ended in flight
    continued: int = 0  # of them, continued from their tokens on the new weights
    requeued: int = 0  # of them, sampled again from their prompts


class InFlightClient:
    """The rollout ahead's engine client across weight updates (module doc)."""

    def __init__(self, inner: RolloutClient, gate: UpdateGate, mode: Literal["continue", "requeue"]):
        self.inner, self.gate, self.mode = inner, gate, mode
        self.stats = InFlightStats()
        self._lock = threading.Lock()

    def generate(
        self,
        input_ids: list[list[int]],
        params: SamplingParams,
        return_logprob: bool = True,
        positions: list[int] | None = None,
    ) -> list[Completion]:
        positions = list(range(len(input_ids))) if positions is None else list(positions)
        prompts = dict(zip(positions, input_ids))
        # The updates begun before the request is sent (read before the gate is waited on: an
        # update marked after that may cut it, one marked before has ended when it is sent).
        marked = self.gate.updates
        self.gate.wait_open()
        out = self.inner.generate(input_ids, params, return_logprob, positions)
        while cut := [k for k, c in enumerate(out) if c.finish_reason == "abort" and self.gate.updates != marked]:
            marked = self.gate.updates
            self.gate.wait_open()
            with self._lock:
                self.stats.cut += len(cut)
                if self.mode == "continue":
                    self.stats.continued += len(cut)
                else:
                    self.stats.requeued += len(cut)
            rows = [self._row(out[k], prompts[out[k].prompt_index], params) for k in cut]
            with ThreadPoolExecutor(min(len(rows), 64), thread_name_prefix="rltrain-in-flight") as pool:
                again = list(
                    pool.map(lambda row: self.inner.generate([row[0]], row[1], return_logprob, [row[2]])[0], rows)
                )
            for k, c in zip(cut, again):
                out[k] = _joined(out[k], c) if self.mode == "continue" else _requeued(out[k], c)
        return out

    def _row(self, c: Completion, prompt: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams, int]:
        """The request that goes on with cut row `c`: (its ids, its params of n = 1, its position)."""
        pos, first = c.prompt_index, sample_seed(params, c.prompt_index, c.sample_index)
        done = 0 if self.mode == "requeue" else len(c.output_ids)
        ids = prompt + c.output_ids[:done]
        left = None if params.max_new_tokens is None else params.max_new_tokens - done
        # Continued: its own stream from here, from the cut sample's seed and how far it got.
        seed = first if first is None or not done else _seed(f"{first}/{done}")
        # (the client adds a row's position to the seed it is given: taken off here)
        own = None if seed is None else seed - pos
        return (
            ids,
            dataclasses.replace(
                params, n=1, max_new_tokens=left, min_new_tokens=max(params.min_new_tokens - done, 0), sampling_seed=own
            ),
            pos,
        )


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _joined(cut: Completion, more: Completion) -> Completion:
    """`cut`'s tokens, then `more`'s: each token with the version that sampled it."""
    before = cut.token_versions or [cut.weight_version] * len(cut.output_ids)
    versions = before + [more.weight_version] * len(more.output_ids)
    return dataclasses.replace(
        more,
        prompt_index=cut.prompt_index,
        sample_index=cut.sample_index,
        output_ids=cut.output_ids + more.output_ids,
        logprobs=cut.logprobs + more.logprobs
        if len(cut.logprobs) == len(cut.output_ids) and len(more.logprobs) == len(more.output_ids)
        else [],
        prompt_tokens=cut.prompt_tokens,
        cached_tokens=cut.cached_tokens,
        weight_version=versions[0] if versions else more.weight_version,
        token_versions=versions,
    )


def _requeued(cut: Completion, fresh: Completion) -> Completion:
    return dataclasses.replace(fresh, prompt_index=cut.prompt_index, sample_index=cut.sample_index)
