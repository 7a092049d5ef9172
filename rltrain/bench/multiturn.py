"""Benchmark: multi-turn rollouts (rollout/multiturn.py) against the same sampled tokens in one turn.

    python -m rltrain.bench.multiturn                                   # CPU: a small model, embedded engine
    python -m rltrain.bench.multiturn --device cuda --shape 1.7b --trajectories 512   # #51's figure
    python -m rltrain.bench.multiturn --device cuda --shape 1.7b --trajectories 512 --http same   # one process
    python -m rltrain.bench.multiturn --device cuda --shape 1.7b --engine-args=--enable-prefill-pieces   # (batching.py)
    python -m rltrain.bench.multiturn --device cuda --shape 1.7b --engine-args=--disable-prefill-cuda-graph  # graphs.py
    python -m rltrain.bench.multiturn --engine sglang --sglang-pythonpath tests/sglang_shim   # CPU, SGLang
    python -m rltrain.bench.multiturn --shape tiny --engine embedded-paged --trajectories 512 --tokens 16   # host work

A Qwen3-shaped model with random weights (bench.models) on one engine. The workload: N
trajectories of T turns, each turn exactly K sampled tokens (ignore_eos; a turn cut at its length
goes on: `rollout.continue_after_length`), each answered by an
observation of O random token ids (an environment of this module), all N in flight at once as the
rollout runs them. The reference, in the same run: the same N prompts sampled single-turn for
T x K tokens each (the same sampled tokens). Reported: sampled tokens/s and turns/s of both, the
share (goal >= 70%), over how long each turn's requests went out and came back (a spread
desynchronises the rows: the engine admits them in waves), and the tokens the engine prefilled
per turn (the prompt tokens it was sent less those its prefix cache served: SGLang's
`cached_tokens`) against the ideal, the observation's O tokens and the previous turn's last
token (goal <= 1.1x).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import torch

from rltrain.bench.engine import _start
from rltrain.bench.models import QWEN3_SHAPES, build, build_model
from rltrain.config import RolloutConfig
from rltrain.engine.client import EngineClient
from rltrain.generation import Completion, SamplingParams
from rltrain.rollout.data import Prompt
from rltrain.rollout.env import EnvStep
from rltrain.rollout.multiturn import MultiTurn

VOCAB = 1000  # token ids drawn for prompts and observations: 10 .. VOCAB (or the model's vocabulary)
TINY_HIDDEN, TINY_VOCAB = 64, 1000  # --shape tiny


class RandomObservations:
    """Answers every model turn with the record's `obs` random ids below its `vocab` (seeded by
    the record): the trajectory runs to its turn limit."""

    def __init__(self, record: dict):
        self.rng = random.Random(record["seed"])
        self.obs, self.vocab = record["obs"], record["vocab"]

    def reset(self) -> None:
        return None

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        return EnvStep([self.rng.randrange(10, self.vocab) for _ in range(self.obs)])


class _Ids:
    """The least tokenizer the rollout needs here: decode (the environment ignores the text)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--shape",
        default=None,
        choices=[*sorted(QWEN3_SHAPES), "tiny"],
        help="default: 1.7b on CUDA, 0.6b cut to 2 layers on CPU; tiny: a Qwen2 of width 64 and 1,000 tokens "
        "(the device's work next to nothing: what is left is the host's, the engine's and the rollout's, per turn)",
    )
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument(
        "--engine",
        default="embedded",
        choices=["embedded", "embedded-paged", "sglang"],
        help="embedded-paged: its paged path on the CPU too (the CPU default is transformers' cache)",
    )
    ap.add_argument("--trajectories", type=int, default=None, help="default: 512 on CUDA, 16 on CPU")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="sampled tokens per turn")
    ap.add_argument("--obs", type=int, default=32, help="observation tokens per turn")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--sglang-pythonpath", default="", help="tests/sglang_shim on a CPU-only machine")
    ap.add_argument("--sglang-args", default="", help="extra SGLang server flags on CUDA, one string")
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--engine-args", default="", help="extra flags of the embedded engine, one string")
    ap.add_argument(
        "--http",
        default="auto",
        choices=["auto", "same", "separate"],
        help="the embedded engine's HTTP in the scheduler's process or one of its own (--separate-http-process); "
        "auto: as the loop runs multi-turn rollouts (engine.embedded.separate_http_process=auto): separate on CUDA",
    )
    ap.add_argument("--dir", default=None)
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    if a.engine.startswith("embedded") and (a.http == "separate" or (a.http == "auto" and cuda)):
        a.engine_args = f"{a.engine_args} --separate-http-process".strip()
    shape = a.shape or ("1.7b" if cuda else "0.6b")
    layers = a.layers if a.layers is not None else (None if cuda else 2)
    n = a.trajectories or (512 if cuda else 16)
    root = Path(a.dir or tempfile.mkdtemp(prefix="rltrain-bench-multiturn-"))
    path = root / f"model_{shape}_{layers}"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not (path / "config.json").exists():
        if shape == "tiny":
            build_model(path, TINY_HIDDEN, layers or 1, TINY_VOCAB, dtype)
        else:
            build(path, shape, torch.device(a.device), dtype, layers)
    vocab = min(VOCAB, TINY_VOCAB if shape == "tiny" else QWEN3_SHAPES[shape].vocab)
    print(
        f"# rltrain.bench.multiturn  {time.strftime('%Y-%m-%d')}  torch {torch.__version__}  {a.device}  "
        f"{a.engine}  {shape} ({layers or 'all'} layers)  {n} trajectories x {a.turns} turns x {a.tokens} sampled "
        f"+ {a.obs} observation tokens, prompts of {a.prompt_len}"
        + (f"  engine flags: {a.engine_args}" if a.engine_args else "")
    )
    proc, client = _start(a.engine, path, a.device, "bfloat16" if cuda else "float32", root, max(n, 1), a)
    try:
        rng = random.Random(0)
        records = [{"seed": i, "obs": a.obs, "vocab": vocab} for i in range(n)]
        prompts = [Prompt(i, [rng.randrange(10, vocab) for _ in range(a.prompt_len)], records[i]) for i in range(n)]
        positions = list(range(n))
        turn = SamplingParams(max_new_tokens=a.tokens, temperature=1.0, ignore_eos=True, sampling_seed=1 << 20)
        budget = a.turns * (a.tokens + a.obs)
        cfg = RolloutConfig(
            max_new_tokens=a.tokens, max_turns=a.turns, max_trajectory_tokens=budget, continue_after_length=True
        )
        rows = []
        for _ in range(2):  # the first warms the engine up (graphs, caches); the second is reported
            client.flush_cache()
            single = SamplingParams(
                max_new_tokens=a.tokens * a.turns, temperature=1.0, ignore_eos=True, sampling_seed=1 << 21
            )
            s0 = _engine_stats(client)
            t0 = time.perf_counter()
            once = client.generate([p.input_ids for p in prompts], single, positions=positions)
            single_s = time.perf_counter() - t0
            s1 = _engine_stats(client)
            client.flush_cache()
            turns = MultiTurn(cfg, _Ids(), RandomObservations)
            counted = _Counting(client)
            t0 = time.perf_counter()
            trajectories = turns.run(counted, prompts, positions, turn)
            multi_s = time.perf_counter() - t0
            counted.start = t0
            s2 = _engine_stats(client)
            rows.append((single_s, once, multi_s, trajectories, counted, (s0, s1, s2)))
        single_s, once, multi_s, trajectories, counted, marks = rows[-1]
        failed = sum(not t.completion.ok for t in trajectories) + sum(not c.ok for c in once)
        sampled = sum(sum(t.completion.loss_mask or []) for t in trajectories)
        single_tokens = sum(len(c.output_ids) for c in once)
        n_turns = sum(t.turns for t in trajectories)
        later = [c for c in counted.calls if c[0] > a.prompt_len]  # turns after the first
        sent = sum(s for s, _ in later) / max(len(later), 1)
        cached = sum(c for _, c in later) / max(len(later), 1)
        prefilled = sent - cached
        ideal = a.obs + 1
        print(f"{'':>28s} {'single-turn':>12s} {'multi-turn':>12s}")
        print(f"{'sampled tokens':>28s} {single_tokens:12d} {sampled:12d}")
        print(f"{'seconds':>28s} {single_s:12.2f} {multi_s:12.2f}")
        print(f"{'sampled tokens/s':>28s} {single_tokens / single_s:12.0f} {sampled / multi_s:12.0f}")
        print(f"{'turns/s':>28s} {n / single_s:12.1f} {n_turns / multi_s:12.1f}")
        share = (sampled / multi_s) / (single_tokens / single_s)
        print(f"multi-turn tokens/s = {share:.0%} of single-turn (goal >= 70%)")
        print("each turn's requests, from the multi-turn rollout's start (their spread desynchronises the rows):")
        print("\n".join(counted.spread()))
        print(
            f"prefilled per later turn: {prefilled:.1f} tokens (sent {sent:.1f}, from the prefix cache {cached:.1f}); "
            f"ideal {ideal} (the observation + the last sampled token): {prefilled / ideal:.2f}x (goal <= 1.1x)"
        )
        counts = [m for m in marks if m is not None]
        if len(counts) == len(marks):  # the embedded engine's paged path counts its work (/server_info)
            print("the engine's work (embedded, paged path):")
            print(f"{'':>28s} {'single-turn':>12s} {'multi-turn':>12s}")
            phases = [{k: b[k] - a[k] for k in b} for a, b in zip(counts, counts[1:])]
            for key, label, fmt in (
                ("prefills", "prefill forwards", "12.0f"),
                ("prefills_in_pieces", "  of them in pieces", "12.0f"),
                ("prefill_tokens", "prefilled tokens", "12.0f"),
                ("decode_steps", "decode steps", "12.0f"),
                ("rows", "tokens per decode step", "12.1f"),
                ("admits", "admission tries", "12.0f"),
                ("admits_unread", "  first tokens read later", "12.0f"),
                ("serve_s", "seconds generating", "12.2f"),
                ("serve_off_cpu_s", "of it off a CPU (locks, cores)", "12.2f"),
                ("admit_s", "of it admitting (+prefill)", "12.2f"),
                ("prefill_launch_s", "queuing prefill forwards", "12.2f"),
                ("prefill_launch_off_cpu_s", "  of it off a CPU", "12.2f"),
                ("prefill_pack_s", "  packing prompts, indices", "12.2f"),
                ("prefill_model_s", "  the model's forward", "12.2f"),
                ("prefill_model_off_cpu_s", "    of it off a CPU", "12.2f"),
                ("prefill_rest_s", "  sampling first tokens, copies", "12.2f"),
                ("prefill_tokens_per", "  tokens per prefill", "12.0f"),
                ("prefill_graph_captures", "  prefill graphs captured", "12.0f"),
                ("prefill_wait_s", "waiting for prefills", "12.2f"),
                ("batch_state_s", "of it batch state rebuilt", "12.2f"),
                ("subset_s", "  or cut to the rows going on", "12.2f"),
                ("launch_s", "of it queuing decode steps", "12.2f"),
                ("wait_s", "of it waiting for the device", "12.2f"),
                ("collect_s", "of it reading steps, answering", "12.2f"),
                # (CUDA: new device and pinned host memory on the hot path; runtime.memory.allocator_counts)
                ("cuda_mallocs", "cudaMalloc calls", "12.0f"),
                ("cuda_alloc_retries", "  retried, all cache freed", "12.0f"),
                ("pinned_host_allocs", "pinned host blocks made", "12.0f"),
                ("pinned_host_alloc_ms", "  their ms", "12.1f"),
            ):
                for p in phases:
                    p["rows"] = p["tokens"] / max(p["decode_steps"], 1)
                    p["serve_off_cpu_s"] = p["serve_s"] - p.get("serve_cpu_s", p["serve_s"])
                    p["prefill_launch_off_cpu_s"] = p["prefill_launch_s"] - p.get(
                        "prefill_launch_cpu_s", p["prefill_launch_s"]
                    )
                    p["prefill_tokens_per"] = p["prefill_tokens"] / max(p["prefills"], 1)
                    p["prefill_model_off_cpu_s"] = p.get("prefill_model_s", 0.0) - p.get("prefill_model_cpu_s", 0.0)
                    p["prefill_rest_s"] = (
                        p["prefill_launch_s"] - p.get("prefill_pack_s", 0.0) - p.get("prefill_model_s", 0.0)
                    )
                if key not in phases[0]:
                    continue  # (the allocator counters: CUDA only)
                vals = [p.get(key, 0.0) for p in phases]
                print(f"{label:>28s} " + " ".join(f"{v:{fmt}}" for v in vals))
        print(f"failed: {failed}")
        return 1 if failed else 0
    finally:
        client.close()
        proc.stop()


def _engine_stats(client: EngineClient) -> dict | None:
    """The embedded engine's paged-path counters (None: another engine or path)."""
    try:
        stats = client.server_info().get("decode_stats")
    except Exception:  # noqa: BLE001 - SGLang has no such counters
        return None
    return stats if isinstance(stats, dict) and "serve_s" in stats else None


class _Counting:
    """The engine client, keeping each turn's prompt length and the part of it its prefix cache
    served, and when each turn's request went out and came back."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.calls: list[tuple[int, int]] = []  # (prompt tokens, cached)
        self.times: dict[int, list[tuple[float, float]]] = {}  # prompt tokens -> (sent, answered), perf_counter
        self.start = 0.0  # when the rollout began
        self._lock = threading.Lock()

    def generate(
        self,
        input_ids: list[list[int]],
        params: SamplingParams,
        return_logprob: bool = True,
        positions: list[int] | None = None,
    ) -> list[Completion]:
        t0 = time.perf_counter()
        out = self.client.generate(input_ids, params, return_logprob, positions)
        t1 = time.perf_counter()
        with self._lock:
            self.calls += [(len(ids), c.cached_tokens) for ids, c in zip(input_ids, out)]
            for ids in input_ids:
                self.times.setdefault(len(ids), []).append((t0, t1))
        return out

    def spread(self) -> list[str]:
        """Per turn (its prompt length: every trajectory's turn k has the same one here), over how
        long its requests went out and their answers came back, from the rollout's `start`."""
        start, lines = self.start, []
        for k, length in enumerate(sorted(self.times), 1):
            sent = sorted(t0 - start for t0, _ in self.times[length])
            back = sorted(t1 - start for _, t1 in self.times[length])
            q = len(back) // 10
            lines.append(
                f"{'turn ' + str(k):>28s} sent {sent[0]:6.3f} .. {sent[-1]:6.3f} s "
                f"(median {sent[len(sent) // 2]:.3f}), "
                f"answered {back[0]:6.3f} .. {back[-1]:6.3f} s "
                f"(deciles 1 / 5 / 9: {back[q]:.3f} / {back[len(back) // 2]:.3f} / {back[-1 - q]:.3f})"
            )
        return lines


if __name__ == "__main__":
    raise SystemExit(main())
