"""Benchmark: what a large prompt dataset costs each rank, read as rltrain reads it and as every
rank reading the whole file would.

    python -m rltrain.bench.data [--records 1000000] [--ranks 2] [--steps 20] [--prompts-per-step 512]

A parquet file of `--records` GSM8K-like records (a question of ~50 words, a numeric answer; row
groups of 10,000), a byte-level BPE tokenizer trained on a sample of them, and `--ranks` real
processes (torch.multiprocessing, a gloo group), each as a training rank is:

- `whole`: every rank reads every record into Python dicts and tokenises every prompt up front
  (what rltrain did before: `read_records` → list, `tokenize_records` over it all);
- `mapped`: rank 0 converts the file once into an uncompressed Arrow copy (`parquet_to_arrow`), every
  rank memory-maps it, checks its share of the prompts up front (`LazyPrompts.check`, the ranks
  exchange the results) and tokenises only the prompts each step draws.

Per rank, from a baseline taken after the imports and the tokenizer: the seconds until the first
step could start, the growth of its private memory (USS: pages no other process shares) and of
its resident memory (RSS, which also counts the pages of a memory-mapped file it has read: the
page cache, one copy for all the ranks), after 20 steps; and the time to draw a step's share of
prompts. The yardstick printed beside them: the records decoded as an Arrow
table (their bytes in memory, once), and the machine's memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rltrain.rollout.data import (
    LazyPrompts,
    PromptSampler,
    parquet_to_arrow,
    read_records,
    tokenize_records,
)

_NOUNS = ["apples", "pencils", "books", "marbles", "cookies", "stamps", "tickets", "coins", "shells", "cards"]
_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
_VERBS = ["buys", "sells", "gives away", "finds", "collects", "loses", "bakes", "trades"]


def question(rng: random.Random) -> tuple[str, str]:
    """A GSM8K-like word problem (~50 words) and its answer."""
    name, noun = rng.choice(_NAMES), rng.choice(_NOUNS)
    a, b, c = rng.randrange(2, 500), rng.randrange(2, 60), rng.randrange(2, 9)
    parts = [
        f"{name} has {a} {noun}.",
        f"On Monday {name} {rng.choice(_VERBS)} {b} more {noun}, and on Tuesday twice as many as on Monday.",
        f"Each box holds {c} {noun}, and {name} wants to put every one of them into boxes before the weekend.",
        f"How many boxes does {name} need, if a box that is only partly full still counts as one box?",
    ]
    total = a + 3 * b
    return " ".join(parts), str(-(-total // c))


def write_dataset(path: Path, n: int, seed: int = 0) -> None:
    import pyarrow as pa  # noqa: PLC0415 - the data extra
    import pyarrow.parquet as pq  # noqa: PLC0415

    rng = random.Random(seed)
    schema = pa.schema([("question", pa.string()), ("answer", pa.string()), ("id", pa.int64())])
    with pq.ParquetWriter(path, schema) as w:
        for start in range(0, n, 10_000):
            rows = [question(rng) for _ in range(min(10_000, n - start))]
            w.write_table(
                pa.table(
                    {
                        "question": [q for q, _ in rows],
                        "answer": [a for _, a in rows],
                        "id": list(range(start, start + len(rows))),
                    },
                    schema=schema,
                )
            )


def write_tokenizer(path: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    rng = random.Random(seed + 1)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator((question(rng)[0] for _ in range(20_000)), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


_FIELDS = {"prompt": "question"}
_TIMEOUT = datetime.timedelta(seconds=1800)  # (the whole file tokenised on every rank takes minutes)


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _uss_mib() -> float:
    """Memory only this process holds (not shared pages such as a memory-mapped file's)."""
    return psutil.Process().memory_full_info().uss / 2**20


def _rank(rank: int, a: argparse.Namespace, mode: str, work: Path, port: int) -> None:
    import pyarrow.compute  # noqa: PLC0415, F401 - imported before the baseline: its libraries are not data
    import pyarrow.parquet  # noqa: PLC0415, F401
    from transformers import AutoTokenizer  # noqa: PLC0415

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.ranks, timeout=_TIMEOUT
    )
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    path, cache = work / "data.parquet", work / "cache"
    dist.barrier()
    base, base_private = _rss_mib(), _uss_mib()
    t0 = time.perf_counter()
    convert_s = 0.0
    prompts: Any
    if mode == "whole":
        prompts = tokenize_records(list(read_records(path, _FIELDS)), tokenizer, False, 1024, source=str(path))
    else:
        if rank == 0:
            parquet_to_arrow(path, cache)
            convert_s = time.perf_counter() - t0
        dist.barrier()
        prompts = LazyPrompts(read_records(path, _FIELDS, cache), tokenizer, False, 1024, source=str(path))
        found: list[Any] = [None] * a.ranks
        dist.all_gather_object(found, prompts.check(rank, a.ranks))
        assert not any(found), found
    ready_s = time.perf_counter() - t0
    sampler = PromptSampler(prompts, a.prompts_per_step, seed=0)
    t1 = time.perf_counter()
    drawn = 0
    for _ in range(a.steps):
        drawn += sum(len(p.input_ids) for p in sampler.next_batch(rank, a.ranks))
    draw_ms = (time.perf_counter() - t1) / a.steps * 1e3
    out = {
        "rank": rank,
        "mode": mode,
        "ready_s": ready_s,
        "convert_s": convert_s,
        "draw_ms": draw_ms,
        "tokens_drawn": drawn,
        "rss_growth_mib": _rss_mib() - base,
        "private_growth_mib": _uss_mib() - base_private,
        "base_mib": base,
    }
    (work / f"{mode}.{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=512)
    p.add_argument("--modes", default="mapped,whole", help="comma-separated: mapped, whole")
    a = p.parse_args(argv)
    import pyarrow.parquet as pq  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="rltrain-bench-data-") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        write_dataset(work / "data.parquet", a.records)
        write_s = time.perf_counter() - t0
        write_tokenizer(work / "tokenizer")
        decoded = pq.read_table(work / "data.parquet").nbytes / 2**20
        print(
            f"# {a.records:,} records, parquet {os.path.getsize(work / 'data.parquet') / 2**20:.0f} MiB (written in "
            f"{write_s:.1f} s), decoded as Arrow {decoded:.0f} MiB; {a.ranks} ranks; {a.steps} steps of "
            f"{a.prompts_per_step} prompts; machine: {os.cpu_count()} CPUs, "
            f"{psutil.virtual_memory().total / 2**30:.1f} GiB; torch {torch.__version__}"
        )
        rows = []
        for mode in a.modes.split(","):
            port = random.Random().randrange(20_000, 60_000)
            mp.start_processes(_rank, args=(a, mode, work, port), nprocs=a.ranks, start_method="spawn")
            rows += [json.loads((work / f"{mode}.{r}.json").read_text()) for r in range(a.ranks)]
            if mode == "mapped":
                copy = next((work / "cache").glob("*.arrow"))
                print(f"# the Arrow copy: {copy.stat().st_size / 2**20:.0f} MiB on disk, shared by the ranks' maps")
        print(
            "| mode | rank | ready (s) | of which converting (s) | private growth (MiB) | resident growth (MiB) | "
            "of which shared (MiB) | draw a step (ms) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['mode']} | {r['rank']} | {r['ready_s']:.1f} | {r['convert_s']:.1f} | "
                f"{r['private_growth_mib']:.0f} | {r['rss_growth_mib']:.0f} | "
                f"{r['rss_growth_mib'] - r['private_growth_mib']:.0f} | {r['draw_ms']:.1f} |"
            )
        total = psutil.virtual_memory().total / 2**20
        for mode in dict.fromkeys(r["mode"] for r in rows):
            private = sum(r["private_growth_mib"] for r in rows if r["mode"] == mode)
            print(
                f"# {mode}: the ranks' private memory grew by {private:.0f} MiB in all ({private / decoded:.2f}x the "
                f"records decoded once, {decoded:.0f} MiB; the machine has {total:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
