"""The embedded engine's sampling: one token per row from its logits, as SGLang samples.

    plan = SamplingPlan(params, seeds, vocab, device)      # once per batch composition
    shaper = LogitShaper(params, stops, vocab, device)
    tokens, logps = sample(shaper.shape(logits, steps), plan, steps, generator)

Per row: SGLang's logit processing (penalties, min_new_tokens, logit_bias: `LogitShaper`), then
temperature, then top-k / top-p / min-p, then the draw. Greedy rows (temperature 0) take the
argmax; seeded rows the Gumbel-max of their filtered logits with noise that is a function of
(seed, the row's own step, token) alone (`seeded_uniform`), so a sample depends neither on its
batch nor on when it joined one; the rest draw from the engine's shared generator (on CUDA: the
same Gumbel-max, its noise keyed by a fresh seed from the generator per row and step; elsewhere
`torch.multinomial`), so repeated runs of one engine seed repeat. The returned
log-prob is that of the distribution the token was drawn from (log_softmax of logits /
temperature; the raw logits for greedy), as SGLang returns it. Every operation is batched over
rows: no host sync, no per-row kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rltrain.generation import SamplingParams


def device_tensor(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`; on CUDA copied from pinned memory without a host sync,
    so a step in flight keeps running while the next one is prepared."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class SamplingPlan:
    """What sampling needs that stays the same at every decode step of one set of rows: the
    temperatures, which rows filter (and their k, p, min-p), which are seeded (their seeds and the
    token half of the noise hash), which use the shared generator."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        seeds: Sequence[int | None],
        vocab: int,
        device: torch.device,
        token_hash: torch.Tensor | None = None,
    ):
        self.temps = device_tensor([p.temperature for p in params], torch.float32, device)
        self.unit_temps = all(p.temperature in (0, 1) for p in params)  # nothing to divide by
        greedy = [p.temperature == 0 for p in params]
        self.greedy = any(greedy)
        filtered = [
            b for b, p in enumerate(params) if not greedy[b] and (0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0)
        ]
        self.filtered = device_tensor(filtered, torch.long, device) if filtered else None
        if filtered:
            f = [params[b] for b in filtered]
            self.top_k = device_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in f], torch.long, device)
            self.top_p = device_tensor([p.top_p for p in f], torch.float32, device)
            self.min_p = device_tensor([p.min_p for p in f], torch.float32, device)
        seeded = [b for b, s in enumerate(seeds) if s is not None and not greedy[b]]
        shared = [b for b, s in enumerate(seeds) if s is None and not greedy[b]]
        self.seeded = device_tensor(seeded, torch.long, device) if seeded else None
        self.seeds = device_tensor([seeds[b] for b in seeded], torch.long, device) if seeded else None
        self.token_hash = (token_hash if token_hash is not None else token_hash_of(vocab, device)) if seeded else None
        self.shared = device_tensor(shared, torch.long, device) if shared else None
        # the fused pass (CUDA; rows that filter nothing): seeded rows keep their seeds, the rows
        # of the shared generator (`shared`) get a fresh one from it at every step
        self.fused = device.type == "cuda" and not filtered
        if self.fused:
            self.safe_temps = None if self.unit_temps else torch.where(self.temps == 0, 1.0, self.temps)
            drawn = [not g for g in greedy]
            self.all_seeds = device_tensor(
                [s if s is not None and d else 0 for s, d in zip(seeds, drawn)], torch.long, device
            )
            self.drawn = device_tensor(drawn, torch.int8, device)


def sample(
    logits: torch.Tensor, plan: SamplingPlan, steps: torch.Tensor | int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob) per row of `logits` [rows, vocab] (float). `steps`: each row's
    token index (a [rows] tensor, or one int for all), the step half of seeded noise. Work that
    changes nothing is skipped (division by temperature 1, gathers of every row); on CUDA the
    seeded draw is one fused pass and the log-prob is read through logsumexp, not a whole
    log-softmax written out; rows that filter nothing (greedy, seeded, or drawing from the shared
    generator by a seed it gives) take one pass in all (`kernels/triton_sampling.sample_tokens`),
    reading `logits` in their own dtype."""
    if plan.fused:
        from rltrain.kernels.triton_sampling import sample_tokens  # noqa: PLC0415 - CUDA only

        if isinstance(steps, int):
            steps = torch.full((logits.shape[0],), steps, dtype=torch.int64, device=logits.device)
        seeds = plan.all_seeds
        if plan.shared is not None:
            fresh = torch.randint(-(2**62), 2**62, plan.shared.shape, generator=generator, device=seeds.device)
            seeds = seeds.index_put((plan.shared,), fresh)
        return sample_tokens(logits, plan.safe_temps, seeds, steps, plan.drawn)
    logits = logits.float()
    scaled = logits
    if not plan.unit_temps:
        temps = plan.temps
        scaled = logits / torch.where(temps == 0, torch.ones_like(temps), temps)[:, None]
    filtered = scaled
    if plan.filtered is not None:
        filtered = scaled.clone()
        filtered[plan.filtered] = _filter(scaled[plan.filtered], plan)
    # the greedy rows' answer (the others are overwritten)
    tokens = torch.argmax(logits, dim=-1) if plan.greedy else torch.empty_like(logits[:, 0], dtype=torch.long)
    if plan.seeded is not None:
        assert plan.seeds is not None  # (set with `seeded`)
        every = plan.seeded.numel() == logits.shape[0]  # (then no gather, no scatter)
        rows = filtered if every else filtered[plan.seeded]
        row_steps = steps if isinstance(steps, int) or every else steps[plan.seeded]
        if logits.is_cuda:  # the same draw, fused (kernels/triton_sampling.py)
            from rltrain.kernels.triton_sampling import seeded_argmax  # noqa: PLC0415 - CUDA only

            drawn = seeded_argmax(rows, _row_hash(plan.seeds, row_steps))
        else:
            u = seeded_uniform(plan.seeds, row_steps, logits.shape[-1], plan.token_hash)
            drawn = torch.argmax(rows - torch.log(-torch.log(u)).float(), dim=-1)
        if every:
            tokens = drawn
        else:
            tokens[plan.seeded] = drawn
    if plan.shared is not None:
        probs = torch.softmax(filtered[plan.shared], dim=-1)
        tokens[plan.shared] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    if logits.is_cuda:
        return tokens, scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
    return tokens, torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _filter(x: torch.Tensor, plan: SamplingPlan) -> torch.Tensor:
    """top-k, then top-p over what top-k kept (the token that crosses p is kept), then min-p over
    what is left: -inf for what each row drops. Rows that ask for none keep every token."""
    neg = float("-inf")
    srt, order = torch.sort(x, dim=-1, descending=True)
    kth = srt.gather(1, (plan.top_k - 1)[:, None])
    x = torch.where(x < kth, neg, x)
    srt = torch.where(srt < kth, neg, srt)
    probs = torch.softmax(srt, dim=-1)
    drop = (probs.cumsum(-1) - probs > plan.top_p[:, None]) & (plan.top_p < 1.0)[:, None]
    x = torch.where(torch.zeros_like(drop).scatter(1, order, drop), neg, x)
    probs = torch.softmax(x, dim=-1)
    return torch.where(probs < plan.min_p[:, None] * probs.max(-1, keepdim=True).values, neg, x)


class LogitShaper:
    """SGLang's logit processing before temperature, per row, for the rows that ask: frequency and
    presence penalties (subtracted per occurrence / once, over the tokens generated so far),
    the repetition penalty (a seen token's logit divided by it if positive, multiplied if
    negative), min_new_tokens (the row's stop tokens at -inf until it has that many), then
    logit_bias (added). Rows that ask for none of it cost nothing; counts are kept only when a
    penalty needs them. `generated`: each row's tokens so far (a row that joins late, or a
    batch whose rows changed, starts from them)."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        stops: Sequence[set[int]],
        vocab: int,
        device: torch.device,
        generated: Sequence[list[int]] | None = None,
    ):
        self.counts = None
        if any(x.frequency_penalty or x.presence_penalty or x.repetition_penalty != 1 for x in params):
            self.counts = torch.zeros(len(params), vocab, device=device)
            for b, toks in enumerate(generated or []):
                if toks:
                    t = device_tensor(toks, torch.long, device)
                    self.counts[b].scatter_add_(0, t, torch.ones_like(t, dtype=self.counts.dtype))
        col = lambda values: device_tensor(values, torch.float32, device)[:, None]  # noqa: E731
        self.frequency = col([p.frequency_penalty for p in params])
        self.presence = col([p.presence_penalty for p in params])
        self.repetition = col([p.repetition_penalty for p in params])
        self.bias = None
        if any(p.logit_bias for p in params):
            self.bias = torch.zeros(len(params), vocab, device=device)
            for b, p in enumerate(params):
                for token, value in (p.logit_bias or {}).items():
                    self.bias[b, token] = value
        # (row, its stop tokens, its min_new_tokens) for rows that must not stop yet
        hold = [(b, sorted(t for t in stops[b] if t < vocab), p.min_new_tokens) for b, p in enumerate(params)]
        self.hold = [(b, ids, m) for b, ids, m in hold if m > 0 and ids]

    def subset(self, index: torch.Tensor, keep: Sequence[int]) -> LogitShaper:
        """The shaper of rows `keep` of this one (`index`: them on the device), counts included."""
        out = LogitShaper.__new__(LogitShaper)
        out.counts = None if self.counts is None else self.counts[index]
        out.frequency, out.presence, out.repetition = (
            x[index] for x in (self.frequency, self.presence, self.repetition)
        )
        out.bias = None if self.bias is None else self.bias[index]
        where = {b: i for i, b in enumerate(keep)}
        out.hold = [(where[b], ids, m) for b, ids, m in self.hold if b in where]
        return out

    @staticmethod
    def joined(first: LogitShaper, then: LogitShaper) -> LogitShaper:
        """The shaper of `first`'s rows followed by `then`'s (counts and biases kept; a side
        without them: zeros)."""
        out = LogitShaper.__new__(LogitShaper)
        n = first.frequency.shape[0]

        def cat(a: torch.Tensor | None, b: torch.Tensor | None, rows_b: int) -> torch.Tensor | None:
            if a is None and b is None:
                return None
            like = a if a is not None else b
            assert like is not None
            zeros = lambda rows: like.new_zeros(rows, like.shape[1])  # noqa: E731
            return torch.cat([a if a is not None else zeros(n), b if b is not None else zeros(rows_b)])

        m = then.frequency.shape[0]
        out.counts, out.bias = cat(first.counts, then.counts, m), cat(first.bias, then.bias, m)
        out.frequency, out.presence, out.repetition = (
            torch.cat([a, b])
            for a, b in zip(
                (first.frequency, first.presence, first.repetition), (then.frequency, then.presence, then.repetition)
            )
        )
        out.hold = first.hold + [(n + b, ids, k) for b, ids, k in then.hold]
        return out

    def shape(self, logits: torch.Tensor, steps: Sequence[int] | int) -> torch.Tensor:
        """`logits` [rows, vocab] (float32) with the rows' penalties, holds and biases applied;
        `steps`: each row's count of generated tokens (one int: the same for all)."""
        out = logits
        if self.counts is not None:
            seen = self.counts > 0
            out = out - self.frequency * self.counts - self.presence * seen
            scaled = torch.where(out < 0, out * self.repetition, out / self.repetition)
            out = torch.where(seen, scaled, out)
        if self.bias is not None:
            out = out + self.bias
        held = [(b, ids) for b, ids, m in self.hold if (steps if isinstance(steps, int) else steps[b]) < m]
        if held:
            out = out.clone() if out is logits else out  # (the caller's tensor stays as it was)
            for b, ids in held:
                out[b, ids] = float("-inf")
        return out

    def count(self, tokens: torch.Tensor) -> None:
        """The tokens just sampled (one per row) join the counts."""
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], torch.ones_like(tokens[:, None], dtype=self.counts.dtype))


_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding 32-bit values (products wrap in
    int64; their low 32 bits, all that is kept, are exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def token_hash_of(vocab: int, device: torch.device) -> torch.Tensor:
    """The token half of seeded noise (a function of the vocabulary size alone: kept per engine)."""
    return _fmix32(torch.arange(vocab, device=device, dtype=torch.int64) * 0x27D4EB2F & _M32)


def seeded_uniform(
    seeds: torch.Tensor, step: torch.Tensor | int, vocab: int, token_hash: torch.Tensor | None = None
) -> torch.Tensor:
    """[len(seeds), vocab] float64 uniforms in (0, 1), each a hash of (seed, step, token): the
    counter-based noise of seeded sampling. Vectorised over rows (`step`: one for all, or one
    per row), and independent of which other rows are in the batch. `token_hash`:
    `token_hash_of(vocab, device)`, when the caller keeps it across steps."""
    s = _row_hash(seeds, step)
    tok = token_hash if token_hash is not None else token_hash_of(vocab, seeds.device)
    h = _fmix32(s[:, None] ^ tok[None, :])
    return (h.double() + 0.5) / 2.0**32


def _row_hash(seeds: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """The (seed, step) half of seeded noise, per row: 32-bit values in int64."""
    seeds = seeds.to(torch.int64)
    s = _fmix32((seeds & _M32) ^ _fmix32((seeds >> 32) & _M32))
    return _fmix32(s ^ ((step * 0x9E3779B1 + 0x7F4A7C15) & _M32))
