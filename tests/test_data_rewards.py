"""Datasets, sharding, rewards and sample collection (against a live embedded engine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rltrain.generation import SamplingParams
from rltrain.rollout import synthetic
from rltrain.rollout.collect import build_batch, collect
from rltrain.rollout.data import (
    DataError,
    LazyPrompts,
    PromptSampler,
    parquet_to_arrow,
    read_records,
    tokenize_records,
)
from rltrain.rollout.rewards import (
    RewardRunner,
    extract_boxed,
    load_reward,
    math_reward,
    normalised_math_reward,
    normalize_answer,
    verified_math_reward,
)


@pytest.fixture(scope="module")
def tok():
    return synthetic.build_tokenizer(synthetic.addition_words())


def test_malformed_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: not valid JSON"):
        read_records(f)
    f.write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: needs a 'prompt' \(text\) or 'messages'"):
        read_records(f)
    f.write_text("[1, 2]\n")
    with pytest.raises(DataError, match="expected a JSON object, got list"):
        read_records(f)
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "nope.jsonl")


def test_datasets_as_users_have_them_read_with_their_own_field_names(tmp_path):
    """A directory `datasets.save_to_disk` wrote, a parquet file (pyarrow, written by datasets)
    and jsonl, their fields named `question` / `solution`: read with `data.fields` as rltrain's
    `prompt` / `answer`, every record; a record without the mapped field, a DatasetDict's
    directory and a directory of something else are refused naming the record or the split."""
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"{a} + 1 =", "solution": str(a + 1), "id": a} for a in range(25)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(tmp_path / "disk", max_shard_size=200)  # (several Arrow files)
    assert len(list((tmp_path / "disk").glob("*.arrow"))) > 1
    ds.to_parquet(tmp_path / "d.parquet", batch_size=7)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = {"prompt": "question", "answer": "solution"}
    for path in (tmp_path / "disk", tmp_path / "d.parquet", tmp_path / "d.jsonl"):
        got = read_records(path, fields)
        want = [(r["question"], r["solution"], r["id"]) for r in rows]
        assert [(r["prompt"], r["answer"], r["id"]) for r in got] == want
        with pytest.raises(DataError, match=r"needs a 'prompt' \(text\) or 'messages'.*data.fields maps"):
            read_records(path)
    datasets.Dataset.from_list([*rows[:3], {"question": None, "solution": None, "id": 3}]).remove_columns(
        "question"
    ).save_to_disk(tmp_path / "bare")
    with pytest.raises(
        DataError, match=r"bare: has no field 'question' \(data.fields maps prompt to it\); its columns"
    ):
        read_records(tmp_path / "bare", fields)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(tmp_path / "dict")
    with pytest.raises(DataError, match=r"holds a DatasetDict \(splits test, train\): set data.path to one split"):
        read_records(tmp_path / "dict", fields)
    (tmp_path / "other").mkdir()
    with pytest.raises(DataError, match="not one datasets' save_to_disk wrote"):
        read_records(tmp_path / "other")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a parquet file pyarrow can read"):
        read_records(tmp_path / "bad.parquet")


def test_a_large_parquet_file_is_read_through_one_memory_mapped_copy(tmp_path):
    """Parquet goes once into an Arrow file in the cache directory (atomically: a damaged file
    leaves nothing behind) and is read through its memory map: the same records, in order, as the
    file read whole; the copy is reused while the file is unchanged and remade when it changes,
    the old one removed; nulls in the prompt column are named by record."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"question": f"{a} + 1 =", "solution": str(a + 1)} for a in range(1000)]
    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    fields = {"prompt": "question", "answer": "solution"}
    cache = tmp_path / "cache"
    copy = parquet_to_arrow(path, cache)
    got = read_records(path, fields, cache)
    assert type(got).__name__ == "ArrowRecords" and len(got) == 1000
    assert [r["answer"] for r in got[::97]] == [r["solution"] for r in rows[::97]]
    assert got[-1]["prompt"] == "999 + 1 =" and got[5] == {**rows[5], "prompt": "5 + 1 =", "answer": "6"}
    assert list(read_records(path, fields)) == list(got)  # (read whole, into memory)
    assert parquet_to_arrow(path, cache) == copy and copy.stat().st_mtime_ns == copy.stat().st_mtime_ns
    pq.write_table(pa.Table.from_pylist(rows[:10]), path)
    again = parquet_to_arrow(path, cache)
    assert again != copy and not copy.exists() and len(read_records(path, fields, cache)) == 10
    # A damaged body: a DataError naming the file, and no copy (nor temporary) left in the cache.
    data = path.read_bytes()
    path.write_bytes(data[:4] + b"\0" * (len(data) - 200) + data[-196:])
    with pytest.raises(DataError, match="big.parquet: (cannot read it as parquet|not a parquet file)"):
        parquet_to_arrow(path, cache)
    assert [p.name for p in cache.iterdir()] == [again.name] or list(cache.iterdir()) == []
    # The check's byte sizes, from string and large_string columns (pandas writes the latter).
    pq.write_table(pa.table({"prompt": pa.array(["1 + 2 =", "héllo"], pa.large_string())}), tmp_path / "l.parquet")
    assert read_records(tmp_path / "l.parquet").prompt_bytes([1, 0]) == [6, 7]
    pq.write_table(pa.Table.from_pylist([*rows[:3], {"question": None, "solution": "x"}]), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n.parquet record 3: needs a 'prompt'"):
        read_records(tmp_path / "n.parquet", fields, cache)


def test_prompts_are_tokenised_when_drawn_and_checked_up_front_in_shares(tok):
    """LazyPrompts gives the ids tokenize_records gives; `check` on each rank's share finds a
    too-long prompt only on the rank that owns it, and the lowest record wins when ranks compare."""
    records = synthetic.addition_records()
    lazy = LazyPrompts(records, tok, False, 16)
    eager = tokenize_records(records, tok, False, 16)
    assert [p.input_ids for p in lazy] == [p.input_ids for p in eager] and lazy[7].record is records[7]
    assert lazy.check(0, 2) is None and lazy.check(1, 2) is None
    bad = [*records[:40], {"prompt": "1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 ="}, *records[41:70]]
    bad[60] = {"prompt": "1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 1 ="}
    lazy = LazyPrompts(bad, tok, False, 16, source="d.jsonl")
    found = [lazy.check(r, 3, batch=8) for r in range(3)]
    assert found[2] is None and found[1] is not None and found[1][0] == 40 and found[0][0] == 60
    assert min(f for f in found if f)[1].startswith("d.jsonl record 40: prompt has 19 tokens")
    with pytest.raises(DataError, match="d.jsonl record 60: prompt has 19 tokens"):
        lazy[60]
    chat = LazyPrompts([{"messages": [{"role": "user", "content": "1 + 2"}]}], tok, False, 16, source="c")
    assert chat.check() == (0, "c record 0: chat prompts need a tokenizer with a chat template")
    assert LazyPrompts([{"prompt": 3}], tok, False, 16, source="i").check()[1].startswith("i records 0..0: cannot")


def test_prompt_longer_than_limit_is_rejected_up_front(tok):
    with pytest.raises(DataError, match=r"record 1: prompt has 7 tokens, more than data.max_prompt_tokens=5"):
        tokenize_records([{"prompt": "1 + 2 ="}, {"prompt": "1 + 2 + 3 ="}], tok, False, 5)


def test_chat_prompts_need_a_chat_template(tok):
    with pytest.raises(DataError, match="need a tokenizer with a chat template"):
        tokenize_records([{"messages": [{"role": "user", "content": "1 + 2 ="}]}], tok, False, 64)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} ={% endif %}"
    )
    try:
        (p,) = tokenize_records([{"messages": [{"role": "user", "content": "1 + 2"}]}], tok, False, 64)
        assert tok.convert_ids_to_tokens(p.input_ids) == ["1", "+", "2", "="]
        # A batch of both kinds: the chat record through the template, the plain one as it is.
        mixed = [{"prompt": "1 + 2"}, {"messages": [{"role": "user", "content": "1 + 2"}]}]
        plain, chat = (tok.convert_ids_to_tokens(p.input_ids) for p in LazyPrompts(mixed, tok, False, 64).take([0, 1]))
        assert chat == ["1", "+", "2", "="] and plain[-3:] == ["1", "+", "2"]
    finally:
        tok.chat_template = None


def test_sharding_is_deterministic_disjoint_and_resumable(tok):
    prompts = tokenize_records(synthetic.addition_records(), tok, False, 16)
    a = [PromptSampler(prompts, 8, seed=3) for _ in range(2)]
    step0 = [a[r].next_batch(r, 2) for r in range(2)]
    ids0 = [p.index for b in step0 for p in b]
    assert len(ids0) == 8 and len(set(ids0)) == 8
    # Same global batch with 1 rank as with 2 ranks.
    single = PromptSampler(prompts, 8, seed=3).next_batch(0, 1)
    assert sorted(p.index for p in single) == sorted(ids0)
    # Resume: a fresh sampler from the saved state continues identically, across epochs too.
    s = PromptSampler(prompts, 8, seed=3)
    for _ in range(20):
        s.next_batch(0, 1)
    state = s.state_dict()
    s2 = PromptSampler(prompts, 8, seed=3)
    s2.load_state_dict(state)
    # 20 steps of 8 from 100 prompts crossed an epoch boundary (12 steps per epoch).
    assert state["epoch"] == 1
    assert [p.index for p in s2.next_batch(0, 1)] == [p.index for p in _advance(prompts, 21)]


def _advance(prompts, k):
    s = PromptSampler(prompts, 8, seed=3)
    for _ in range(k - 1):
        s.next_batch(0, 1)
    return s.next_batch(0, 1)


def test_math_reward_extraction_and_normalisation():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{42}") == "42"
    assert extract_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed("no box") is None
    assert normalize_answer(" $1,000.50$ ") == "1000.5" and normalize_answer("3.00") == "3"
    assert math_reward(r"The answer is \boxed{1,000}.", {"answer": "1000"}) == 1.0
    assert math_reward("first 12 then 7", {"answer": "7"}) == 1.0
    assert math_reward("no number here", {"answer": "7"}) == 0.0
    assert load_reward("exact_match")(" abc ", {"answer": "abc"}) == 1.0
    assert load_reward("format", r"\d+")("123", {}) == 1.0


# (response, answer, the normaliser's verdict, math-verify's verdict): `math` is right on every
# row (it takes either's match; every "wrong" row is wrong for both). The rows where only
# math-verify matches are what a hand-written normaliser gets wrong.
VERIFIER_TABLE = [
    (r"So we get \boxed{12} apples.", "12", 1, 1),  # \boxed{} in prose
    ("The total is 1,000 dollars", "1000", 1, 1),  # thousands separator
    (r"\boxed{(1, 2]}", "(1,2]", 1, 1),  # interval, spacing
    ("first 12 then 7", "7", 1, 1),  # the last number
    (r"\boxed{3.50}", "3.5", 1, 1),  # trailing zero
    (r"\boxed{\frac{1}{2}}", "1/2", 0, 1),  # LaTeX fraction
    ("The answer is 0.5", "1/2", 0, 1),  # decimal against fraction
    (r"$\frac{3}{4}$", "0.75", 0, 1),
    (r"\boxed{x = 3}", "3", 0, 1),  # an equation's value
    (r"\boxed{\left(1, 2\right]}", "(1,2]", 0, 1),  # \left( \right]
    (r"\boxed{\{1,2,3\}}", r"\{3,2,1\}", 0, 1),  # sets, any order
    (r"\boxed{5\text{ cm}}", "5", 0, 1),  # units
    (r"\boxed{10\%}", "10", 0, 1),  # percent
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 0, 1),  # equal expressions
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 0, 1),  # equal polynomials
    (r"\boxed{3}", "4", 0, 0),  # wrong
    (r"\boxed{[0, 1)}", "(0,1]", 0, 0),  # wrong interval ends
    (r"\boxed{1/3}", "0.333", 0, 0),  # not equal, only close
    ("no number here", "7", 0, 0),
]


@pytest.mark.parametrize(("response", "answer", "normalised", "verified"), VERIFIER_TABLE)
def test_the_math_reward_gets_every_row_of_the_verifier_table_right(response, answer, normalised, verified):
    """Each verifier's verdict on the table (math-verify's where it is installed: the dev set-up
    installs it), and `math`'s: right on every row, in the caller's thread and in the runner's
    pool threads (where math-verify must not use its signal timeouts)."""
    record = {"answer": answer}
    assert normalised_math_reward(response, record) == normalised
    got = verified_math_reward(response, record)
    if got is None:
        pytest.skip("math-verify is not installed (the math extra)")
    assert got == verified
    assert math_reward(response, record) == float(normalised or verified)
    runner = RewardRunner(load_reward("math"), timeout_s=30, workers=2)
    try:
        (scored,) = runner.score([(response, record)])
    finally:
        runner.close()
    assert scored.error is None and scored.reward == float(normalised or verified)


def _hangs_on_some(text, rec):
    if rec.get("hang"):
        time.sleep(30)
    return 1.0


def test_a_reward_that_never_returns_costs_its_own_samples_not_the_step():
    """Three calls that hang, two pool threads, 40 items: the hung ones fail once their own
    timeout passes, every other item is scored, and the step's scoring ends in a few timeouts'
    time. (Before: the hung calls held both threads, every item queued behind them waited out a
    timeout of its own, and all of them failed: 40 timeouts, none scored.)"""
    items = [("x", {"hang": i in (0, 1, 17)}) for i in range(40)]
    runner = RewardRunner(_hangs_on_some, timeout_s=0.5, workers=2)
    t0 = time.monotonic()
    try:
        out = runner.score(items)
    finally:
        runner.close()
    assert time.monotonic() - t0 < 5
    assert [i for i, s in enumerate(out) if s.error] == [0, 1, 17]
    assert all("timed out" in out[i].error for i in (0, 1, 17))
    assert all(s.reward == 1.0 for i, s in enumerate(out) if i not in (0, 1, 17))
    assert runner.abandoned == 3


def test_a_grader_that_never_returns_does_not_hold_the_process_at_exit(tmp_path):
    """A job whose grader hung in a reward thread exits once its work is done, not when the
    grader would have returned (ThreadPoolExecutor's threads are joined at exit: before, the
    process waited out the grader's 60 s)."""
    script = tmp_path / "job.py"
    script.write_text(
        "import time\n"
        "from rltrain.rollout.rewards import RewardRunner\n"
        "def grade(text, rec):\n"
        "    if rec['hang']:\n"
        "        time.sleep(60)\n"
        "    return 1.0\n"
        "runner = RewardRunner(grade, timeout_s=0.3, workers=2)\n"
        "out = runner.score([('x', {'hang': i == 0}) for i in range(6)])\n"
        "assert [s.error is None for s in out] == [False] + [True] * 5, out\n"
        "runner.close()\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_custom_reward_loading_errors():
    with pytest.raises(ValueError, match="expected math, exact_match, format or module:function"):
        load_reward("nope")
    with pytest.raises(ValueError, match="cannot import it"):
        load_reward("no_such_module_xyz:f")
    assert load_reward("json:dumps") is json.dumps


def _slow(text, rec):
    time.sleep(5)
    return 1.0


def test_failing_or_slow_rewards_are_failures_not_zeros():
    def flaky(text, rec):
        if rec["k"] == 1:
            raise KeyError("answer")
        if rec["k"] == 2:
            return float("nan")
        return 0.0

    runner = RewardRunner(flaky, timeout_s=2)
    out = runner.score([("x", {"k": 0}), ("x", {"k": 1}), ("x", {"k": 2})])
    assert out[0].reward == 0.0 and out[0].error is None
    assert out[1].reward is None and "raised KeyError" in out[1].error
    assert out[2].reward is None and "NaN" in out[2].error
    slow = RewardRunner(_slow, timeout_s=0.2)
    (res,) = slow.score([("x", {})])
    assert res.reward is None and "timed out" in res.error
    slow.close()


def test_collect_drops_groups_with_failures_and_counts_them(server, tok):
    records = [{"prompt": f"{a} + 1 =", "answer": str(a + 1), "bad": a == 3} for a in range(6)]
    prompts = tokenize_records(records, tok, False, 16)

    def reward(text, rec):
        if rec["bad"]:
            raise RuntimeError("grader crashed")
        return 1.0 if text.strip() == rec["answer"] else 0.0

    runner = RewardRunner(reward, timeout_s=10)
    server.client.vocab_size = 256
    try:
        ro = collect(server.client, prompts, SamplingParams(max_new_tokens=2, n=4), tok, runner)
    finally:
        server.client.vocab_size = None
    assert ro.stats["samples"] == 24 and ro.stats["reward_failed"] == 4 and ro.stats["groups_dropped"] == 1
    assert len(ro.groups) == 5 and all(len(g) == 4 for g in ro.groups)
    assert all(s.reward is not None for g in ro.groups for s in g)
    batch, rewards = build_batch(ro.groups, pad_id=0)
    assert rewards.shape == (5, 4) and batch.tokens.shape[0] == 20
    # The loss mask covers exactly the response tokens; engine log-probs sit on them.
    for b, s in enumerate(s for g in ro.groups for s in g):
        P, R = len(s.prompt.input_ids), len(s.completion.output_ids)
        assert batch.loss_mask[b].nonzero().flatten().tolist() == list(range(P, P + R))
        assert batch.tokens[b, P : P + R].tolist() == s.completion.output_ids
    runner.close()


def test_responses_decode_in_one_call_exactly_as_one_decode_each(tok, monkeypatch):
    """A fast tokenizer that cleans up no spaces decodes a rollout's responses in one call into
    its Rust tokenizer, to exactly the texts of one `decode` each (special tokens skipped); one
    that cleans up spaces decodes each with `decode`."""
    import copy
    import random

    from rltrain.rollout.collect import decode_responses

    rng = random.Random(0)
    special = tok.all_special_ids
    responses = [[rng.randrange(len(tok)) for _ in range(rng.randrange(0, 12))] + special[:1] for _ in range(64)]
    want = [tok.decode(r, skip_special_tokens=True) for r in responses]
    assert sum(map(len, want)) > 0
    calls = []
    real = tok.backend_tokenizer.decode_batch
    monkeypatch.setattr(
        type(tok.backend_tokenizer), "decode_batch", lambda self, *a, **k: calls.append(1) or real(*a, **k)
    )
    assert decode_responses(tok, responses) == want and calls == [1]
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    assert decode_responses(cleaning, responses) == [cleaning.decode(r, skip_special_tokens=True) for r in responses]
    assert calls == [1]


def test_a_prompt_that_leaves_no_room_for_a_whole_response_is_refused_at_start_up():
    """The model's context bounds prompt + rollout.max_new_tokens (not data.max_prompt_tokens alone)."""
    tok = synthetic.build_tokenizer(synthetic.addition_words())
    records = [{"prompt": "1 + 2 ="}, {"prompt": " ".join(["1"] * 40)}]
    assert len(tokenize_records(records, tok, False, 1024, context=(128, 64))) == 2
    with pytest.raises(DataError, match=r"record 1: prompt has 41 tokens; with rollout.max_new_tokens=100 .* 128"):
        tokenize_records(records, tok, False, 1024, context=(128, 100))


def test_max_new_tokens_beyond_the_models_context_is_a_config_error():
    from rltrain.config import ConfigError, build_config
    from rltrain.setup import check_context

    cfg = build_config({"model": {"path": "m"}, "data": {"path": "x.jsonl"}, "rollout": {"max_new_tokens": 4096}})
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=4096 leaves no room .* \(2048 tokens\)"):
        check_context(cfg, 2048, "m")
    cfg.engine.extra_args = ["--context-length", "8192"]  # the engine's own limit, where set
    assert check_context(cfg, 2048, "m") == 8192


def test_pass_at_k_is_the_unbiased_estimator_and_the_eval_row_counts_failures_apart():
    """pass@k against its definition (the chance that k of the n samples, drawn without
    replacement, hold a passing one: counted over every k-subset); the eval row's figures, a
    prompt with a failed sample counted in the failures and left out of pass@k, never scored 0."""
    from itertools import combinations

    from rltrain.rollout.evaluation import ks_of, pass_at_k, summarize

    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(combinations([1] * c + [0] * (n - c), k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert ks_of(1) == [1] and ks_of(4) == [1, 2, 4] and ks_of(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    prompts = [
        {
            "samples": 4,
            "scored": 4,
            "passed": 1,
            "reward_sum": 1.0,
            "length_sum": 40,
            "generation_failed": 0,
            "reward_failed": 0,
        },
        {
            "samples": 4,
            "scored": 4,
            "passed": 4,
            "reward_sum": 4.0,
            "length_sum": 20,
            "generation_failed": 0,
            "reward_failed": 0,
        },
        {
            "samples": 4,
            "scored": 3,
            "passed": 0,
            "reward_sum": 0.0,
            "length_sum": 30,
            "generation_failed": 1,
            "reward_failed": 0,
        },
    ]
    row = summarize(prompts, 4)
    assert row["eval/prompts"] == 3 and row["eval/prompts_scored"] == 2 and row["eval/generation_failed"] == 1
    assert row["eval/reward_mean"] == pytest.approx(5 / 11) and row["eval/response_length"] == pytest.approx(90 / 11)
    assert row["eval/pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert row["eval/pass@4"] == pytest.approx(1.0) and row["eval/pass@2"] == pytest.approx((0.5 + 1.0) / 2)


def test_the_plots_people_read(tmp_path):
    """reward.png draws a moving mean beside the raw curve; phase_time.png gives every phase its
    own colour and leaves the first step's start-up out of its scale (the title gives it);
    eval.jsonl gets eval.png."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from rltrain.plot import moving_mean, moving_window, write_plots

    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_window(10) == 1 and moving_window(400) == 20 and moving_window(10_000) == 50
    phases = [f"phase{i}" for i in range(12)]
    rows = [
        {
            "step": s,
            "reward_mean": s / 40,
            "pass_rate": s / 50,
            "time": {p: (30.0 if s == 1 else 0.1) for p in phases} | {"step": 1.0},
            "memory": {"rank0": {"rollout": {"host_rss": 1.0}, "train": {"host_rss": 2.0}}},
        }
        for s in range(1, 41)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/pass@1": 0.1, "eval/reward_mean": 0.1}) + "\n")
    drawn = []
    saved = plt.Figure.savefig

    def keep(fig, path, **kw):  # the figures as drawn, before they are closed
        drawn.append((Path(path).name, fig))
        return saved(fig, path, **kw)

    plt.Figure.savefig = keep
    try:
        write_plots(tmp_path)
    finally:
        plt.Figure.savefig = saved
    figs = dict(drawn)
    assert {"reward.png", "phase_time.png", "eval.png"} <= set(figs)
    (ax,) = figs["phase_time.png"].axes
    colours = [tuple(c.get_facecolor()[0]) for c in ax.collections]
    assert len(colours) == 12 and len(set(colours)) == 12
    assert ax.get_ylim()[1] < 30 and "start-up: 360.00 s" in ax.get_title()
    (ax,) = figs["reward.png"].axes
    assert len(ax.lines) == 4 and any("mean" in line.get_label() for line in ax.lines)
