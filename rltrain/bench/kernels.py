"""Fused log-prob/entropy kernels against the naive torch versions (needs a CUDA device).

    python -m rltrain.bench.kernels [--tokens 16384,32768,65536] [--vocab 151936] [--hidden 4096]
                                    [--sample-rows 64,512]

Per token count, forward + backward (upstream gradients for log-prob and entropy):

  logits   given bf16 logits [N, V]: reference (float32 log-softmax) vs the Triton kernels
  linear   given hidden [N, H] and the LM head [V, H]: matmul + reference vs the chunked fused
           path (logits never materialised for all tokens)

Time is the median of timed repeats after a warm-up; peak is the most memory allocated above
what the inputs (and for `linear` the weight) already hold. The logits kernels stream the
logits three times (forward read, backward read + gradient write): their bandwidth is shown next
to a device-to-device copy measured in the same run (bytes read + written per second), and the
linear path's matmul rate next to a plain bf16 matmul's.

Then the embedded engine's per-step sampling (a seeded draw and its log-prob per row from a
decode step's bf16 logits [rows, V]): the torch ops of before (a float32 copy, the one-program-
per-row draw, a gather and logsumexp) against the one-pass kernel (`sample_tokens`), with the
bytes of logits read per second next to the same copy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], object], repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes above the memory allocated before the first call)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()  # warm-up (and Triton compilation)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _run(fn: Callable[[], object], repeats: int) -> tuple[float | None, int | None]:
    try:
        return _timed(fn, repeats)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def copy_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s, _ = _timed(lambda: dst.copy_(src), 5)
    return 2 * nbytes / s / 1e9


def matmul_tflops(n: int, h: int, v: int) -> float:
    a = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    s, _ = _timed(lambda: a @ b.t(), 5)
    return 2 * n * h * v / s / 1e12


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,32768,65536")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sample-rows", default="64,512", help="rows of the sampling comparison ('' skips it)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("rltrain.bench.kernels needs a CUDA device (the kernels' CPU path is the torch reference)")
        return 2

    from rltrain.kernels import (
        linear_logprobs_entropy,
        logprobs_entropy,
        reference_linear_logprobs_entropy,
        reference_logprobs_entropy,
    )

    V, H, T = a.vocab, a.hidden, a.temperature
    print(
        f"# rltrain.bench.kernels  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  "
        f"{torch.cuda.get_device_name()}  vocab {V}  hidden {H}  bf16, forward + backward"
    )
    copy = copy_gbps(4 << 30)
    print(
        f"device-to-device copy: {copy:.0f} GB/s (read + write);  bf16 matmul [16384x{H}]x[{H}x{V}]: "
        f"{matmul_tflops(16384, H, V):.0f} TFLOP/s"
    )
    print(
        f"{'path':>7s} {'tokens':>7s} | {'naive s':>8s} {'naive GiB':>9s} | {'fused s':>8s} {'fused GiB':>9s} | "
        f"{'time':>6s} {'memory':>7s} | {'fused GB/s':>10s} {'of copy':>7s}"
    )
    for n in (int(x) for x in a.tokens.split(",") if x):
        g = torch.Generator(device="cuda").manual_seed(n)
        targets = torch.randint(0, V, (n,), device="cuda", generator=g)
        glogp = torch.randn(n, device="cuda", generator=g)
        gent = torch.randn(n, device="cuda", generator=g)

        def step(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], *inputs: torch.Tensor) -> Callable[[], None]:
            def run() -> None:
                for x in inputs:
                    x.grad = None
                logp, ent = fn(*inputs)
                ((logp * glogp).sum() + (ent * gent).sum()).backward()
                del logp, ent
                for x in inputs:
                    x.grad = None

            return run

        rows = []
        logits = (torch.randn(n, V, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
        naive = _run(step(lambda x: reference_logprobs_entropy(x, targets, T), logits), a.repeats)
        fused = _run(step(lambda x: logprobs_entropy(x, targets, T), logits), a.repeats)
        del logits
        torch.cuda.empty_cache()
        streamed = 3 * n * V * 2  # forward read, backward read + gradient write (bf16)
        rows.append(("logits", naive, fused, streamed))
        hidden = torch.randn(n, H, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
        weight = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16).requires_grad_(True)
        naive = _run(step(lambda x, w: reference_linear_logprobs_entropy(x, w, targets, T), hidden, weight), a.repeats)
        fused = _run(step(lambda x, w: linear_logprobs_entropy(x, w, targets, T), hidden, weight), a.repeats)
        del hidden, weight
        torch.cuda.empty_cache()
        rows.append(("linear", naive, fused, None))
        for path, (ns, nm), (fs, fm), nbytes in rows:
            fmt = lambda s: "OOM" if s is None else f"{s:.4f}"  # noqa: E731
            gib = lambda m: "OOM" if m is None else f"{m / 2**30:.2f}"  # noqa: E731
            ratio_t = f"{fs / ns:.2f}x" if ns and fs else "-"
            ratio_m = f"{fm / nm:.3f}x" if nm and fm else "-"
            bw = (
                f"{nbytes / fs / 1e9:10.0f} {nbytes / fs / 1e9 / copy:6.0%}" if nbytes and fs else f"{'':>10s} {'':>7s}"
            )
            print(
                f"{path:>7s} {n:>7d} | {fmt(ns):>8s} {gib(nm):>9s} | {fmt(fs):>8s} {gib(fm):>9s} | "
                f"{ratio_t:>6s} {ratio_m:>7s} | {bw}"
            )
    if a.sample_rows:
        sampling(V, [int(x) for x in a.sample_rows.split(",")], a.repeats, copy)
    return 0


def sampling(vocab: int, row_counts: list[int], repeats: int, copy: float) -> None:
    """The engine's per-step seeded draw + log-prob: the unfused torch path vs `sample_tokens`."""
    from rltrain.engine.embedded.sampling import _row_hash
    from rltrain.kernels.triton_sampling import sample_tokens, seeded_argmax

    print(f"\nsampling one token + its log-prob per row from bf16 logits [rows x {vocab}] (seeded, temperature 1)")
    print(f"{'rows':>5s} | {'unfused s':>9s} | {'fused s':>8s} | {'time':>6s} | {'fused GB/s':>10s} {'of copy':>7s}")
    for rows in row_counts:
        g = torch.Generator(device="cuda").manual_seed(rows)
        logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=g)
        steps = torch.randint(0, 1024, (rows,), device="cuda", generator=g)
        drawn = torch.ones(rows, dtype=torch.int8, device="cuda")

        def unfused() -> None:
            x = logits.to(torch.float32, copy=True)
            tokens = seeded_argmax(x, _row_hash(seeds, steps))
            x.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)

        def fused() -> None:
            sample_tokens(logits, None, seeds, steps, drawn)

        (us, _), (fs, _) = _timed(unfused, repeats), _timed(fused, repeats)
        gbs = rows * vocab * 2 / fs / 1e9
        print(f"{rows:>5d} | {us:9.5f} | {fs:8.5f} | {fs / us:5.2f}x | {gbs:10.0f} {gbs / copy:7.0%}")


if __name__ == "__main__":
    raise SystemExit(main())
