"""The plain path's runner: a batch generated with transformers' own KV cache, one batch at a time.

    runner = PlainRunner(model, device, generator, token_hash)
    results = runner.run(batch, weight_version, running, abort)   # per request, its samples

The path of the CPU default, `decode="hf"`, and a model the paged path cannot run (paged.py). The
scheduler hands it everything queued (scheduler.py); it left-pads the distinct prompts, prefills
each once and decodes step by step with transformers' cache, then answers every request of the
batch. Per-token log-probs are those of the distribution the token was sampled from (sampling.py).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rltrain.engine.embedded.rows import GenRequest, Row
from rltrain.engine.embedded.sampling import LogitShaper, SamplingPlan, sample


class PlainRunner:
    """Batched sampling with transformers' own cache (module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        generator: torch.Generator,
        token_hash: Callable[[int], torch.Tensor | None],
        eos_ids: set[int],
    ):
        self.model = model
        self.device = device
        self.generator = generator
        self.token_hash = token_hash
        self.eos_ids = eos_ids
        # transformers 5.2x renamed `past_key_values` to `cache` (in and out); accept both.
        forward = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward else "past_key_values"
        # The prefill computes logits for the last position only, where the model can.
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    @torch.no_grad()
    def run(
        self,
        reqs: list[GenRequest],
        weight_version: Callable[[], str],
        running: threading.Event,
        abort: threading.Event,
    ) -> list[list[dict[str, Any]]]:
        """Per request, its samples as SGLang result dicts, prompt-major, of the weight version
        current at the end. While `running` is clear the batch waits, or with `abort` set its rows
        end now (finish reason abort)."""
        every = [row for req in reqs for row in req.rows(self.eos_ids)]
        rows = [r for r in every if r.finish is None]  # max_new_tokens=0 (a prefill-only score): done
        if rows:
            self._decode(rows, running, abort)
        results: list[list[dict[str, Any]]] = [[] for _ in reqs]
        index = {id(req): k for k, req in enumerate(reqs)}
        now = time.time()
        for r in every:
            results[index[id(r.req)]].append(r.result(weight_version(), now))
        return results

    def _decode(self, rows: list[Row], running: threading.Event, abort: threading.Event) -> None:
        """Prefill the rows' prompts and sample until every row has finished."""
        B = len(rows)
        # Each distinct prompt is prefilled once: the n samples of a prompt (rows of their own,
        # with their own seeds) then start from its logits and its KV cache, copied per row.
        unique: dict[tuple[int, ...], int] = {}
        of_row = [unique.setdefault(tuple(r.prompt), len(unique)) for r in rows]
        L = max(len(p) for p in unique)
        ids = torch.zeros(len(unique), L, dtype=torch.long)
        mask = torch.zeros(len(unique), L, dtype=torch.long)
        for u, prompt in enumerate(unique):
            ids[u, L - len(prompt) :] = torch.tensor(prompt)
            mask[u, L - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)

        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **self._last_logits_only)
        past, logits = getattr(out, self._cache_kw), out.logits[:, -1, :].float()
        if len(unique) < B:  # one row per sample again (transformers' public cache reorder, as beam search uses)
            rows_of = torch.tensor(of_row, device=self.device)
            logits, mask, pos = logits[rows_of], mask[rows_of], pos[rows_of]
            if any(r.max_new > 1 for r in rows):
                past.reorder_cache(rows_of)
        params = [r.params for r in rows]
        plan = SamplingPlan(
            params, [r.seed for r in rows], logits.shape[-1], self.device, self.token_hash(logits.shape[-1])
        )
        shaper = LogitShaper(params, [r.stops for r in rows], logits.shape[-1], self.device)
        step = 0
        while any(r.finish is None for r in rows):
            if not running.is_set():
                if abort.is_set():
                    for r in rows:
                        if r.finish is None:
                            r.finish = {"type": "abort", "message": "generation paused with mode=abort"}
                    break
                running.wait()
            tokens, logps = sample(shaper.shape(logits, step), plan, step, self.generator)
            shaper.count(tokens)
            tok_list, lp_list = tokens.tolist(), logps.tolist()
            for b, r in enumerate(rows):
                if r.finish is not None:
                    continue
                r.append(tok_list[b], lp_list[b])
            step += 1
            if all(r.finish is not None for r in rows):
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                **{self._cache_kw: past},
            )
            past, logits = getattr(out, self._cache_kw), out.logits[:, -1, :].float()
        del past, out
