"""Multi-turn rollouts (rollout/env.py, rollout/multiturn.py): token-in/token-out trajectories on a
live engine (the embedded engine and real SGLang on CPU), the loss mask on the model's tokens
only, tools that fail, hang or are called wrongly, environments that raise, the turn and token
limits, and seeded trajectories that repeat exactly."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from conftest import start_engine
from models import make_model
from qwen3_chat import qwen3_format_tokenizer
from rltrain.bench.multiturn import _Counting
from rltrain.config import ConfigError, DataConfig, RolloutConfig
from rltrain.engine.client import EngineClient
from rltrain.generation import Completion, SamplingParams
from rltrain.rollout.calculator import calculator
from rltrain.rollout.collect import Sample, _generate, _summarize, build_batch
from rltrain.rollout.data import LazyPrompts, Prompt
from rltrain.rollout.env import EnvStep, ToolEnvironment, Tools
from rltrain.rollout.multiturn import Conversation, MultiTurn
from rltrain.rollout.rewards import RewardRunner
from rltrain.rollout.synthetic import build_tokenizer

OBS = [7, 8, 9]


def _tokenizer() -> Any:
    """A word-level tokenizer over the test models' 256 ids (4 specials, then w0..w251)."""
    return build_tokenizer([f"w{i}" for i in range(252)])


class TwoTurns:
    """An environment that answers the model's first turn with OBS and ends after its second,
    rewarding 1.0; it records what it was given."""

    seen: list[tuple[str, list[int]]] = []

    def __init__(self, record: dict):
        self.record, self.turns = record, 0

    def reset(self) -> None:
        return None  # the data's prompt

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        TwoTurns.seen.append((text, token_ids))
        self.turns += 1
        return EnvStep(list(OBS)) if self.turns == 1 else EnvStep(None, reward=1.0)


class Recording:
    """The engine client, with every call's prompt and answer kept (the real client underneath)."""

    def __init__(self, client: Any):
        self.client, self.calls = client, []

    def generate(self, input_ids, params, return_logprob=True, positions=None) -> list[Completion]:
        out = self.client.generate(input_ids, params, return_logprob, positions)
        self.calls.append((list(input_ids[0]), out[0]))
        return out


def _params(n: int = 1, stops: bool = True) -> SamplingParams:
    """Turns of one token each (`stops`: every id of the test models' vocabulary stops a turn, so
    the trajectories' shapes do not depend on what is sampled; a random model has no end-of-turn
    habit), else turns that run to their token limit."""
    stop = list(range(256)) if stops else None
    return SamplingParams(max_new_tokens=5, temperature=1.0, n=n, sampling_seed=1_000_000, stop_token_ids=stop)


def test_a_two_turn_trajectory_trains_on_the_engine_tokens_and_never_on_the_observation(server):
    """Turn 2 is sent the running ids (prompt, turn 1's ids as the engine returned them, the
    observation); the trajectory holds exactly those ids, and the batch's loss mask is 1 on the
    sampled tokens only, with the engine's log-prob of each."""
    TwoTurns.seen = []
    cfg = RolloutConfig(max_new_tokens=5, max_turns=4)
    turns = MultiTurn(cfg, _tokenizer(), TwoTurns)
    client = Recording(server.client)
    prompt = Prompt(0, [1, 5, 6, 10], {})
    (t,) = turns.run(client, [prompt], [0], _params())
    (in1, c1), (in2, c2) = client.calls
    assert in1 == prompt.input_ids and in2 == prompt.input_ids + c1.output_ids + OBS
    assert t.completion.ok and t.turns == 2 and t.env_reward == 1.0 and t.ended_by == "env"
    assert t.completion.output_ids == c1.output_ids + OBS + c2.output_ids
    assert t.completion.loss_mask == [1] * len(c1.output_ids) + [0] * len(OBS) + [1] * len(c2.output_ids)
    assert t.completion.logprobs == c1.logprobs + [0.0] * len(OBS) + c2.logprobs
    assert TwoTurns.seen[0][1] == c1.output_ids  # the environment got the engine's ids
    batch, rewards = build_batch([[Sample(t.prompt, t.completion, reward=1.0)]], pad_id=0)
    row, mask = batch.tokens[0], batch.loss_mask[0].bool()
    assert row[: len(in2) + len(c2.output_ids)].tolist() == in2 + c2.output_ids
    assert row[mask].tolist() == c1.output_ids + c2.output_ids  # bitwise the sampled tokens
    assert set(OBS).isdisjoint(row[mask].tolist()) or OBS[0] in c1.output_ids + c2.output_ids
    assert batch.rollout_logp[0][mask].tolist() == pytest.approx(c1.logprobs + c2.logprobs)
    assert rewards.tolist() == [[1.0]]


def test_seeded_trajectories_repeat_exactly(server):
    """The same prompts and seeds give the same trajectories, token for token (a resumed run
    samples what the uninterrupted one sampled); every turn has its own seed. (SGLang follows a
    request's seed only with its deterministic sampler, engine.deterministic, which this session's
    server was not started with.)"""
    if server.kind == "sglang":
        pytest.skip("SGLang honours sampling seeds under engine.deterministic only")
    cfg = RolloutConfig(max_new_tokens=5, max_turns=3)
    runs = []
    for _ in range(2):
        TwoTurns.seen = []
        turns = MultiTurn(cfg, _tokenizer(), TwoTurns)
        runs.append(
            [t.completion.output_ids for t in turns.run(server.client, [Prompt(0, [1, 5, 6], {})], [0], _params(2))]
        )
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


class Always:
    """Answers every turn with an observation: the trajectory ends by its limits."""

    def __init__(self, record: dict):
        pass

    def reset(self) -> list[int]:
        return [1, 5, 6]

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        return EnvStep([7, 8], reward=0.5)


def test_a_trajectory_ends_at_max_turns_or_at_its_token_budget(server):
    by_turns = MultiTurn(RolloutConfig(max_new_tokens=3, max_turns=2), _tokenizer(), Always)
    (t,) = by_turns.run(server.client, [Prompt(0, [1], {})], [0], _params())
    assert t.ended_by == "max_turns" and t.turns == 2 and t.completion.finish_reason == "stop"
    assert t.completion.loss_mask.count(0) == 2 and t.env_reward == 1.0  # one observation between the turns
    assert t.prompt.input_ids == [1, 5, 6]  # the environment's first prompt
    by_budget = MultiTurn(RolloutConfig(max_new_tokens=3, max_turns=8, max_trajectory_tokens=7), _tokenizer(), Always)
    (t,) = by_budget.run(server.client, [Prompt(0, [1], {})], [0], _params())
    assert t.ended_by == "budget" and t.completion.finish_reason == "length" and t.completion.ok
    assert len(t.completion.output_ids) <= 7


@pytest.fixture(scope="module")
def paged(model_a, tmp_path_factory):
    """The embedded engine on its paged path (continuous batching; the CPU default is transformers'
    cache, a batch at a time)."""
    srv = start_engine("embedded", model_a, tmp_path_factory.mktemp("paged_logs"), extra_args=["--decode", "paged"])
    yield srv
    srv.client.close()
    srv.process.stop()


def _most_at_once(spans) -> int:
    """The most of the (sent, answered) spans that overlap at one time."""
    edges = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def test_every_trajectory_of_a_rank_is_in_flight_at_once_whatever_the_clients_fan_out(paged):
    """A rank's trajectories each send their turns from their own thread, all at once: their
    requests are in flight together, far more than `engine.max_inflight` (one call's fan-out),
    which used to bound every trajectory's turns together (a pool of max_inflight threads), and
    the engine batches them. (Counted by requests in flight at once, not rows per decode step:
    on a loaded machine the threads' requests come slower than the engine decodes.)"""
    client = EngineClient(paged.client.url, max_inflight=1, prompts_per_request=1)
    try:
        before = client.server_info()["decode_stats"]
        cfg = RolloutConfig(max_new_tokens=8, max_turns=2, continue_after_length=True)
        turns = MultiTurn(cfg, _tokenizer(), Always)
        prompts = [Prompt(i, [1, 5 + i], {}) for i in range(24)]
        timed = _Counting(client)  # (bench.multiturn's: when each request went out and came back)
        out = turns.run(timed, prompts, list(range(24)), _params(stops=False))
        after = client.server_info()["decode_stats"]
    finally:
        client.close()
    assert all(t.completion.ok and t.turns == 2 for t in out)
    most = _most_at_once([span for spans in timed.times.values() for span in spans])
    assert most >= 12, f"at most {most} of 24 trajectories' requests in flight at once"
    rows_per_step = (after["tokens"] - before["tokens"]) / (after["decode_steps"] - before["decode_steps"])
    assert rows_per_step > 1.5, f"{rows_per_step:.1f} rows per decode step: the trajectories' turns were not batched"


class Raises:
    def __init__(self, record: dict):
        if record.get("at") == "start":
            raise RuntimeError("no such maze")

    def reset(self) -> None:
        return None

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        raise ValueError("the environment crashed")


@pytest.mark.parametrize("at", ["start", "step"])
def test_an_environment_that_raises_fails_its_group_counted_never_scored(server, at):
    """The trajectory fails with the environment's error; its group is dropped and counted, the
    other groups are kept."""
    cfg = RolloutConfig(max_new_tokens=3, max_turns=3)
    turns = MultiTurn(cfg, _tokenizer(), lambda rec: Raises(rec) if rec.get("bad") else Always(rec))
    prompts = [Prompt(0, [1, 5], {"bad": True, "at": at}), Prompt(1, [1, 6], {})]
    rewards = RewardRunner(lambda text, record: 0.0, timeout_s=5, workers=1)
    try:
        groups = _generate(server.client, prompts, [0, 1], _params(2), _tokenizer(), rewards, {}, turns)
    finally:
        rewards.close()
    rollout = _summarize(groups, retried=0)
    assert rollout.stats["groups_dropped"] == 1 and len(rollout.groups) == 1
    assert rollout.stats["generation_failed"] == 2 and turns.stats.values["env_failed"] == 2
    errors = [s.error for s in groups[0]]
    assert all(("no such maze" if at == "start" else "the environment crashed") in e for e in errors), errors
    # The environment's rewards (0.5 for each of the 3 turns it answered), summed: never a failure's 0.
    assert [s.reward for s in groups[1]] == [1.5, 1.5]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "rested"


def boom() -> str:
    """Fail."""
    raise OSError("disk on fire")


def test_tool_calls_that_fail_hang_or_are_malformed_become_error_text_the_model_sees():
    tools = Tools([f"{__name__}:add", f"{__name__}:nap", f"{__name__}:boom"], timeout_s=0.3)
    try:
        assert [s["function"]["name"] for s in tools.schemas] == ["add", "nap", "boom"]
        env = ToolEnvironment({"prompt": "2 + 3"}, tools)
        assert env.reset() == [{"role": "user", "content": "2 + 3"}]
        text = (
            'let me see <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "nap", "arguments": {"seconds": 5}}</tool_call>'
            '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{not json</tool_call>'
        )
        t0 = time.perf_counter()
        step = env.step(text, [])
        assert time.perf_counter() - t0 < 3  # the hung tool held its call for the timeout only
        out = [m["content"] for m in step.observation]
        assert out[0] == "5" and "nap timed out after 0.3 s" in out[1]
        assert "boom raised OSError: disk on fire" in out[2] and "no tool named 'rm'" in out[3]
        assert "not a valid tool call" in out[4]
        assert all(m["role"] == "tool" for m in step.observation)
        stats = tools.stats
        assert sum(stats.calls.values()) == 5 and sum(stats.errors.values()) == 4 and stats.timeouts == 1
        assert env.step("the answer is 5", []).observation is None  # no call: done
    finally:
        tools.close()


TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def test_an_observation_follows_the_model_turn_as_the_chat_template_writes_it():
    """A tool message's ids are what the template writes after the model's content, less the
    end-of-turn token the model sampled itself, through the next generation prompt."""
    tok = build_tokenizer(["<|im_start|>", "<|im_end|>", "user", "assistant", "tool", ".", "\ue000", "5", "hi"])
    tok.chat_template = TEMPLATE
    conv = Conversation(tok)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = conv.observation_ids([{"role": "tool", "content": "5"}], last_sampled=end)
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "tool", "5", "<|im_end|>", "<|im_start|>", "assistant"]
    cut = conv.observation_ids([{"role": "tool", "content": "5"}], last_sampled=tok.convert_tokens_to_ids("hi"))
    assert tok.convert_ids_to_tokens(cut)[0] == "<|im_end|>"  # the model did not end its turn: the template does
    first = conv.prompt_ids([{"role": "user", "content": "hi"}], Prompt(0, [], {}))
    assert tok.convert_ids_to_tokens(first) == ["<|im_start|>", "user", "hi", "<|im_end|>", "<|im_start|>", "assistant"]
    assert conv.observation_ids([3, 4], None) == [3, 4]


def test_multi_turn_config_is_checked():
    # rollout.env with rollout.tools: the environment must be a ToolEnvironment (made with them).
    with pytest.raises(ValueError, match="both set"):
        MultiTurn.from_config(RolloutConfig(env=f"{__name__}:TwoTurns", tools=[f"{__name__}:add"]), _tokenizer())
    tool_env = MultiTurn.from_config(
        RolloutConfig(env="rltrain.rollout.synthetic:LookupTask", tools=["rltrain.rollout.synthetic:lookup"]),
        _tokenizer(),
    )
    assert tool_env.tools is not None and isinstance(tool_env.make_env({"answer": "3"}), ToolEnvironment)
    with pytest.raises(ConfigError, match="max_turns=0"):
        RolloutConfig(tools=["a:f"], max_turns=0).check()
    with pytest.raises(ValueError, match="rollout.tools='nowhere:f'"):
        MultiTurn.from_config(RolloutConfig(tools=["nowhere:f"]), _tokenizer())
    assert RolloutConfig(tools=[f"{__name__}:add"]).multi_turn and not RolloutConfig().multi_turn


def test_the_loop_trains_on_two_turn_trajectories(tmp_path):
    """The quickstart with `rollout.env`: every trajectory takes two model turns around a text
    observation; the trainer's log-probs of the sampled tokens equal the engine's (the trained
    tokens are the sampled ones, at their places), and the metrics count the turns and tokens."""
    import json
    import os
    from pathlib import Path

    from test_loop import run_quickstart

    digits = ",".join(str(4 + d) for d in range(19))  # the quickstart's number words: a turn is one of them
    tests = str(Path(__file__).parent)
    r = run_quickstart(
        tmp_path,
        "rollout.env=multiturn_env:Recheck",
        f"rollout.stop_token_ids=[{digits}]",
        "rollout.max_new_tokens=4",
        "metrics.plot=true",
        env={"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        mt = row["multiturn"]
        assert mt["turns_trajectories"] == row["samples"] and row["generation_failed"] == 0, row
        assert 1.0 < row["turns_per_trajectory"] <= 2.0, row
        assert mt["turns_observation_tokens"] > 0 and mt["turns_sampled_tokens"] > 0, mt
        assert row["logp_diff_engine_trainer"] < 1e-3, row
    assert (tmp_path / "quickstart" / "turns.png").stat().st_size > 10_000  # the multi-turn plot


@pytest.mark.parametrize("kind", ["embedded", "embedded-paged", "sglang"])
def test_a_prefix_cached_before_a_weight_update_is_never_served_after_it(kind, model_a, model_b, tmp_path):
    """Multi-turn trajectories resend their growing prefix every turn, which SGLang's radix cache
    keeps (on by default) and the embedded engine's paged path keeps (its prefix cache): a repeat
    is served from it (`cached_tokens`). A prefix cached under the old weights must not be reused
    after the sync: the weight update flushes it (rltrain sends flush_cache with every update;
    the embedded engine empties it at every weight write). Greedy continuations of the same long
    prompt after the update are transformers' own under the new weights, not the old ones'."""
    from conftest import HAVE_SGLANG, SKIP_SGLANG, start_engine
    from models import engine_greedy, hf_greedy

    if kind == "sglang" and not HAVE_SGLANG:
        if SKIP_SGLANG:
            pytest.skip("SGLang not installed and RLTRAIN_SKIP_SGLANG=1")
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    prompt = [[1, *range(10, 90)]]  # 81 tokens: several radix-cache pages, more than one of the embedded engine's
    want_a, want_b = hf_greedy(model_a, prompt, 4), hf_greedy(model_b, prompt, 4)
    assert want_a != want_b
    extra = ["--decode", "paged"] if kind == "embedded-paged" else []
    srv = start_engine(kind.removesuffix("-paged"), model_a, tmp_path, extra_args=extra)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    try:
        assert engine_greedy(srv.client, prompt, 4) == want_a  # the prefix is now cached under A
        if kind != "embedded":  # (transformers' cache: no prefix kept)
            (again,) = srv.client.generate(prompt, greedy)
            assert again.output_ids == want_a[0] and again.cached_tokens > 0
        srv.client.update_weights_from_disk(str(model_b), weight_version="b")
        (after,) = srv.client.generate(prompt, greedy)
        assert after.output_ids == want_b[0] and after.cached_tokens == 0
        assert engine_greedy(srv.client, [prompt[0] + want_b[0]], 2) == hf_greedy(model_b, [prompt[0] + want_b[0]], 2)
    finally:
        srv.client.close()
        srv.process.stop()


def test_a_turn_cut_at_its_length_ends_the_trajectory_unless_asked_to_go_on(server):
    """A turn that reaches max_new_tokens ends its trajectory with finish reason length (it was
    truncated); with rollout.continue_after_length the environment answers it like any turn."""
    params = dataclasses.replace(_params(stops=False), ignore_eos=True)  # every turn runs to its 5 tokens
    cut = MultiTurn(RolloutConfig(max_new_tokens=5, max_turns=3), _tokenizer(), Always)
    (t,) = cut.run(server.client, [Prompt(0, [1], {})], [0], params)
    assert t.ended_by == "length" and t.turns == 1 and t.completion.finish_reason == "length"
    on_cfg = RolloutConfig(max_new_tokens=5, max_turns=3, max_trajectory_tokens=100, continue_after_length=True)
    on = MultiTurn(on_cfg, _tokenizer(), Always)
    (t,) = on.run(server.client, [Prompt(0, [1], {})], [0], params)
    assert t.ended_by == "max_turns" and t.turns == 3 and t.completion.loss_mask.count(1) == 15


def test_a_tool_that_never_returns_holds_neither_its_trajectory_nor_the_process_exit(tmp_path):
    """A process whose tool call hangs (it sleeps an hour) gets the timeout text and then exits at
    once: the call's thread is a daemon, not a pool worker the interpreter joins at exit."""
    import subprocess
    import sys

    script = (
        "import time, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from rltrain.rollout.env import Tools\n"
        "tools = Tools(['hang:forever'], timeout_s=0.5, workers=1)\n"
        'print(tools.call(\'{"name": "forever", "arguments": {}}\')[1])\n'
        'print(tools.call(\'{"name": "forever", "arguments": {}}\')[1])\n'
    )
    (tmp_path / "hang.py").write_text(
        'import time\n\ndef forever() -> str:\n    """Never return."""\n    time.sleep(3600)\n    return \'late\'\n'
    )
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    # The second call finds the one slot held by the first, hung call: it times out too.
    assert r.stdout.splitlines() == ["error: forever timed out after 0.5 s"] * 2
    assert time.perf_counter() - t0 < 30


def secret(record: dict) -> str:
    """Look up this task's secret.

    Returns:
        The secret.
    """
    return str(record["secret"])


def test_a_tool_that_takes_the_record_gets_the_trajectory_s_record_never_the_model_s():
    """A tool with a `record` parameter gets the trajectory's data record (the task's context);
    a `record` the model passes is dropped, and the schema the model sees does not show it."""
    tools = Tools([f"{__name__}:secret"], timeout_s=5)
    try:
        assert tools.schemas[0]["function"]["parameters"].get("properties", {}) == {}
        env = ToolEnvironment({"prompt": "?", "secret": 42}, tools)
        forged = '<tool_call>{"name": "secret", "arguments": {"record": {"secret": 0}}}</tool_call>'
        assert env.step(forged, []).observation == [{"role": "tool", "name": "secret", "content": "42"}]
    finally:
        tools.close()


def test_the_lookup_task_pays_only_for_an_answer_grounded_in_a_lookup(tmp_path):
    """The tool quickstart's task (rollout/synthetic.py): its words survive a save and a load by
    AutoTokenizer (a "qwen2" checkpoint's would not: transformers 5 reads it as byte-level BPE and
    "find" tokenises to nothing), its chat template renders the tool's answer between markers,
    and only a right answer after a lookup that worked pays 1; a lookup then a wrong answer 0.1;
    a guess, right or not, 0."""
    from transformers import AutoTokenizer

    from rltrain.rollout import synthetic

    path = synthetic.build_tiny_model(
        tmp_path / "m", synthetic.lookup_words(), chat_template=synthetic.LOOKUP_TEMPLATE, qwen3=True
    )
    tok = AutoTokenizer.from_pretrained(path)
    words = synthetic.lookup_words()
    assert tok.convert_ids_to_tokens(tok("find 7", add_special_tokens=False)["input_ids"]) == ["find", "7"]
    call = tok.convert_tokens_to_ids(synthetic.LOOKUP_CALL)
    assert tok.decode([call]) == synthetic.LOOKUP_CALL and call == words.index(synthetic.LOOKUP_CALL) + 4
    tools = Tools(["rltrain.rollout.synthetic:lookup"], timeout_s=5)
    conv = Conversation(tok, tools.schemas)
    record = synthetic.lookup_records(5, seed=1)[2]
    env = synthetic.LookupTask(record, tools)
    assert tok.convert_ids_to_tokens(conv.prompt_ids(env.reset(), Prompt(0, [], record))) == ["find"]
    looked = env.step(synthetic.LOOKUP_CALL, [call])
    assert looked.reward == 0.0 and looked.observation is not None
    obs = conv.observation_ids(looked.observation, call)
    assert tok.convert_ids_to_tokens(obs) == ["<tool_response>", record["answer"], "</tool_response>"]
    assert env.step(record["answer"], []).reward == 1.0 and env.step(record["answer"], []).observation is None
    wrong = str((int(record["answer"]) + 1) % 10)
    assert env.step(wrong, []).reward == 0.1
    guess = synthetic.LookupTask(record, tools)
    guess.reset()
    assert guess.step(record["answer"], []).reward == 0.0  # right, but not looked up
    assert tools.stats.calls == {"lookup": 1} and not tools.stats.errors


def test_the_tool_quickstart_learns_to_call_the_tool_and_answer(tmp_path):
    """configs/quickstart-tools.yaml on two ranks from random weights: at the first step the model
    calls the tool in few trajectories and its reward is near 0; by the end nearly every
    trajectory looks the answer up and answers it (the README's second quickstart)."""
    import json

    from multiproc import run_torchrun
    from test_loop import REPO

    r = run_torchrun(
        tmp_path,
        ["-m", "rltrain"],
        [
            "--config",
            str(REPO / "configs" / "quickstart-tools.yaml"),
            f"run.dir={tmp_path}",
            f"model.path={tmp_path / 'base_model'}",
            "loop.steps=160",
            "checkpoint.interval=0",
            "metrics.plot=false",
        ],
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart-tools" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 161))

    def calls(row: dict) -> float:
        return row["multiturn"]["tool_calls"] / row["samples"]

    assert calls(rows[0]) < 0.3 and rows[0]["reward_mean"] < 0.2, rows[0]
    last = rows[-20:]
    assert sum(row["reward_mean"] for row in last) / 20 >= 0.8, [row["reward_mean"] for row in last]
    assert sum(calls(row) for row in last) / 20 >= 0.8
    assert all(row["multiturn"]["tool_errors"] == 0 and row["generation_failed"] == 0 for row in rows)


def test_a_resumed_tool_run_repeats_the_uninterrupted_trajectories_exactly(tmp_path):
    """The tool quickstart (embedded engine, deterministic) stopped after step 2 and resubmitted
    repeats the uninterrupted run's steps 3-4 exactly: the same trajectories (turns, tool calls,
    tokens, rewards) and the same training figures, the probe riding the same steps."""
    import json

    from multiproc import run_torchrun
    from test_loop import REPO

    def run(d, *extra: str) -> None:
        r = run_torchrun(
            d,
            ["-m", "rltrain"],
            [
                "--config",
                str(REPO / "configs" / "quickstart-tools.yaml"),
                f"run.dir={d}",
                f"model.path={d / 'base_model'}",
                "loop.steps=4",
                "checkpoint.interval=2",
                "engine.deterministic=true",
                "metrics.plot=false",
                *extra,
            ],
        )
        assert r.returncode == 0, r.stderr[-4000:]

    def rows(d) -> list[dict]:
        out = []
        for line in (d / "quickstart-tools" / "metrics.jsonl").read_text().splitlines():
            row = {k: v for k, v in json.loads(line).items() if k not in ("time", "rollout_time", "memory", "wall")}
            row = {k: v for k, v in row.items() if not k.endswith("_per_s")}
            row["multiturn"] = {k: v for k, v in row["multiturn"].items() if not k.endswith("_s")}  # (seconds)
            out.append(row)
        return out

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    run(straight)
    run(resumed, "loop.stop_after=2")
    run(resumed)
    got, want = rows(resumed), rows(straight)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == want
    assert want[2]["multiturn"]["turns_turns"] > want[2]["samples"]  # (trajectories of more than one turn)


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
# What Qwen3's format writes between a model turn that ended itself (<|im_end|>) and the next
# one: the tool's result in a user turn, then the generation prompt with thinking off.
TOOL_TURN = (
    "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def test_a_tool_trajectory_in_qwen3_s_chat_format_keeps_the_sampled_tokens_the_template_would_drop():
    """Qwen3's format with tools and data.chat_template_kwargs {enable_thinking: false}: the first
    prompt lists the calculator's schema and closes an empty think block; the model's call (the
    tool markers kept in the text its environment parses) is run, and its result's ids are the
    template's tool turn after the model's own <|im_end|>. The trajectory is the whole
    conversation as the template writes it but for the empty think block of the first answer,
    which the template drops from history: re-rendering the conversation would train on other
    tokens than were sampled (the trap token-in/token-out avoids)."""
    tok = qwen3_format_tokenizer()
    tools = Tools(["rltrain.rollout.calculator:calculator"], timeout_s=5)
    conv = Conversation(tok, tools.schemas, {"enable_thinking": False})
    env = ToolEnvironment({"prompt": "What is 12*7?"}, tools)
    first = conv.prompt_ids(env.reset(), Prompt(0, [], {}))
    shown = tok.decode(first)
    assert '"name": "calculator"' in shown and shown.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn1 = tok(CALL, add_special_tokens=False)["input_ids"] + [end]  # as the engine would return them
    step = env.step(tok.decode(turn1, skip_special_tokens=True), turn1)
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "84"}]
    obs = conv.observation_ids(step.observation, last_sampled=end)
    assert tok.decode(obs) == TOOL_TURN
    cut = conv.observation_ids(step.observation, last_sampled=turn1[-2])  # the turn did not end itself
    assert tok.decode(cut) == "<|im_end|>" + TOOL_TURN
    turn2 = tok("12*7 = 84, so \\boxed{84}.", add_special_tokens=False)["input_ids"] + [end]
    trajectory = first + turn1 + obs + turn2
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*7"}}}
    whole = [
        {"role": "user", "content": "What is 12*7?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        *step.observation,
        {"role": "assistant", "content": "12*7 = 84, so \\boxed{84}."},
    ]
    rendered = tok.apply_chat_template(whole, tools=tools.schemas, tokenize=False, enable_thinking=False)
    empty_think = "<think>\n\n</think>\n\n"
    assert tok.decode(trajectory) + "\n" == rendered.replace(
        "assistant\n<tool_call>", "assistant\n" + empty_think + "<tool_call>"
    )
    assert tok(rendered, add_special_tokens=False)["input_ids"] != trajectory + tok("\n")["input_ids"]
    # The data's prompts get the same keyword arguments (data.chat_template_kwargs).
    (prompt,) = LazyPrompts([{"prompt": "hi"}], tok, True, 100, template_kwargs={"enable_thinking": False})[:]
    assert tok.decode(prompt.input_ids).endswith(empty_think)
    (thinking,) = LazyPrompts([{"prompt": "hi"}], tok, True, 100)[:]
    assert tok.decode(thinking.input_ids).endswith("<|im_start|>assistant\n")


class CalculatorOnce(ToolEnvironment):
    """The model's first turn is taken as a call of the calculator on 12*7 (a random model writes
    no calls); the second ends the trajectory."""

    def step(self, text: str, token_ids: list[int]) -> EnvStep:
        if getattr(self, "called", False):
            return EnvStep(None, reward=1.0)
        self.called = True
        name, out = self.tools.call('{"name": "calculator", "arguments": {"expression": "12*7"}}', self.record)
        return EnvStep([{"role": "tool", "name": name, "content": out}])


def test_a_tool_trajectory_in_qwen3_s_format_on_the_embedded_engine(tmp_path):
    """End to end on a live engine: a tiny Qwen3 whose tokenizer writes Qwen3's chat format; the
    second turn is sent the prompt, the first turn's ids as sampled and the tool turn's ids, and
    the trajectory trains on the sampled ids only."""
    tok = qwen3_format_tokenizer()
    model = make_model(tmp_path / "model", seed=3, arch="qwen3", vocab=len(tok) + 7)
    tok.save_pretrained(model)
    srv = start_engine("embedded", model, tmp_path)
    tools = Tools(["rltrain.rollout.calculator:calculator"], timeout_s=5)
    try:
        cfg = RolloutConfig(
            max_new_tokens=5,
            max_turns=4,
            max_trajectory_tokens=200,  # (every byte a token)
            tools=["rltrain.rollout.calculator:calculator"],
            continue_after_length=True,
        )
        turns = MultiTurn(cfg, tok, lambda record: CalculatorOnce(record, tools), tools, {"enable_thinking": False})
        client = Recording(srv.client)
        env = CalculatorOnce({"prompt": "What is 12*7?"}, tools)
        first = turns.conversation.prompt_ids(env.reset(), Prompt(0, [], {}))
        params = SamplingParams(max_new_tokens=5, temperature=1.0, sampling_seed=7)
        (t,) = turns.run(client, [Prompt(0, [0], {"prompt": "What is 12*7?"})], [0], params)
        (in1, c1), (in2, c2) = client.calls
        obs = in2[len(in1) + len(c1.output_ids) :]
        assert in1 == first and in2[: len(in1) + len(c1.output_ids)] == in1 + c1.output_ids
        ended = c1.output_ids[-1] == tok.eos_token_id
        assert tok.decode(obs) == ("" if ended else "<|im_end|>") + TOOL_TURN
        assert t.completion.ok and t.turns == 2 and t.env_reward == 1.0 and t.ended_by == "env"
        assert t.completion.output_ids == c1.output_ids + obs + c2.output_ids
        assert t.completion.loss_mask == [1] * len(c1.output_ids) + [0] * len(obs) + [1] * len(c2.output_ids)
        assert turns.summary()["tool_calls_calculator"] == 1
    finally:
        tools.close()
        srv.client.close()
        srv.process.stop()


def test_the_calculator_computes_arithmetic_and_contains_hostile_expressions():
    """Numbers and + - * / // % ** only, parsed and never evaluated as code; every size bounded
    (a power checked before it is computed); through `Tools` each refusal is an error text the
    model sees, counted, and none of them takes the call's timeout."""
    assert calculator("(12 + 7) * 3 / 4") == "14.25" and calculator("2**10") == "1024"
    assert calculator("0.1 + 0.2") == "0.3" and calculator("7 // 2 - -1") == "4" and calculator("6 × 7") == "42"
    assert calculator("10**999 // 10**998") == "10" and calculator("2 ** -1") == "0.5"
    for hostile, why in [
        ("__import__('os').system('touch /tmp/pwned')", "not arithmetic"),
        ("().__class__.__bases__[0].__subclasses__()", "not arithmetic"),
        ("9**9**9**9", "digits"),
        ("(10**999) * (10**999)", "digits"),
        ("1" * 2000, "characters"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
        ("+".join(["1"] * 300), "operations"),
        ("2^10", "write \\*\\*"),
        ("1e308 * 10", "inf"),
        ("(-8) ** 0.5", "not a real number"),
        ("'a' * 10**9", "not arithmetic"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculator(hostile)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / (3 - 3)")
    tools = Tools(["rltrain.rollout.calculator:calculator"], timeout_s=5)
    try:
        name, out = tools.call('{"name": "calculator", "arguments": {"expression": "9**9**9**9"}}')
        assert name == "calculator" and out.startswith("error: calculator raised ValueError") and "digits" in out
        name, out = tools.call('{"name": "calculator", "arguments": {"expression": "1/0"}}')
        assert "ZeroDivisionError" in out
        assert tools.call('{"name": "calculator", "arguments": {"expression": "3*4"}}')[1] == "12"
        assert tools.stats.errors == {"calculator": 2} and tools.stats.timeouts == 0
    finally:
        tools.close()


def test_chat_template_kwargs_cannot_set_what_rltrain_passes():
    DataConfig(path="x.jsonl", chat_template_kwargs={"enable_thinking": False}).check()
    for key in ("tools", "add_generation_prompt", "tokenize", "not an identifier"):
        with pytest.raises(ConfigError, match="chat_template_kwargs"):
            DataConfig(path="x.jsonl", chat_template_kwargs={key: 1}).check()
