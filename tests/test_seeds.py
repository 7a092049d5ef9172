"""Every sample its own seed, every engine its own random seed.

SGLang's deterministic inference samples a row without a `sampling_seed` with the seed 42
(sglang 0.5.23, `SamplingBatchInfo.from_schedule_batch`), so with engine.deterministic=true and
rollout.seeded=false the n samples of a prompt would all be one sample: zero advantage, silently.
The rollout therefore seeds every row, from the rank's own generator when the run is not seeded.
The test runs a rank's rollout against real SGLang with --enable-deterministic-inference on CPU,
which SGLang itself does not start there: tests/faults/sglang_cpu_deterministic.py says what
stands in (its CPU attention registered as deterministic, batch-invariant mode off, its CPU
hash op in torch ops); SGLang's own seeding and seeded draw run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import HAVE_SGLANG, SGLANG_SHIM, SKIP_SGLANG, engine_config, start_server
from multiproc import run_ranks, values
from rltrain.config import EngineConfig
from rltrain.engine.command import server_command
from rltrain.engine.layout import EngineLayout
from rltrain.generation import SamplingParams
from rltrain.rollout import synthetic

HERE = Path(__file__).resolve().parent
N = 8


@pytest.fixture(scope="module")
def addition(tmp_path_factory):
    """The quickstart's tiny model (a word-level tokenizer: the rollout decodes and scores) and data."""
    root = tmp_path_factory.mktemp("addition")
    model = synthetic.build_tiny_model(root / "model", synthetic.addition_words(), seed=0)
    data = synthetic.write_jsonl(root / "data.jsonl", synthetic.addition_records())
    return model, data


@pytest.fixture(scope="module")
def deterministic_sglang(addition, tmp_path_factory):
    if not HAVE_SGLANG:
        if SKIP_SGLANG:
            pytest.skip("SGLang not installed and RLTRAIN_SKIP_SGLANG=1")
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    env = {
        "PYTHONPATH": os.pathsep.join([str(HERE / "faults"), str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")]),
        "RLTRAIN_TEST_SGLANG_CPU_DETERMINISTIC": "1",
        "TORCHDYNAMO_DISABLE": "1",  # (its seeded draw is torch.compile'd: a C++ build per shape on CPU)
    }
    log = tmp_path_factory.mktemp("sglang_logs") / "sglang.log"
    srv = start_server(engine_config("sglang", deterministic=True), addition[0], log, env)
    yield srv
    srv.client.close()
    srv.process.stop()


def _rollout_rank(rank: int, world_size: int, url: str, model: str, data: str) -> list[list[list[int]]]:
    """A rank's first rollout through StepRollout, as the loop runs it (rollout.seeded=false)."""
    from transformers import AutoTokenizer

    from rltrain.config import load_config
    from rltrain.engine.client import EngineClient
    from rltrain.rollout.data import PromptSampler, read_records, tokenize_records
    from rltrain.rollout.rewards import RewardRunner, load_reward
    from rltrain.rollout.step import StepRollout
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=120)
    client = EngineClient(url, request_timeout_s=120)
    rewards = RewardRunner(load_reward("math"), 30, 1)
    try:
        cfg = load_config(
            None,
            [
                f"model.path={model}",
                f"data.path={data}",
                "data.prompts_per_step=4",
                f"rollout.n={N}",
                "rollout.max_new_tokens=3",
                "rollout.seeded=false",
                "engine.deterministic=true",
            ],
        )
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = tokenize_records(read_records(data), tokenizer, False, 64)
        sampler = PromptSampler(prompts, cfg.data.prompts_per_step, cfg.run.seed)
        rollout = StepRollout(cfg, world, sampler, tokenizer, rewards).collect(client, step=0)
        assert rollout.stats["generation_failed"] == 0, rollout.stats
        return [[s.completion.output_ids for s in group] for group in rollout.groups]
    finally:
        rewards.close()
        client.close()
        world.close()


def test_the_n_samples_of_a_prompt_differ_on_deterministic_sglang_without_rollout_seeds(deterministic_sglang, addition):
    groups = values(run_ranks(_rollout_rank, 1, deterministic_sglang.process.url, *map(str, addition)))[0]
    assert len(groups) == 4 and all(len(g) == N for g in groups)
    identical = [g[0] for g in groups if len({tuple(s) for s in g}) == 1]
    assert not identical, f"{len(identical)} of {len(groups)} groups are one sample {N} times: {identical}"
    # What the rollout seeds against: SGLang gives every row without a seed the same one.
    unseeded = deterministic_sglang.client.generate(
        [[0, 1]], SamplingParams(max_new_tokens=3, n=N), return_logprob=False
    )
    assert len({tuple(c.output_ids) for c in unseeded}) == 1


def test_every_engine_is_started_with_its_own_random_seed():
    """engine.seed plus the engine's place among the job's engines: two engines of a node, and
    the engines of two nodes, never share one; the first keeps engine.seed."""

    def seeds(backend: str, flag: str) -> list[int]:
        cfg = EngineConfig(backend=backend, device="cpu", seed=7)
        out = []
        for node in (0, 1):
            for local in (0, 2):  # the leaders of two engines of two GPUs each, on a node of 4
                cmd = server_command(cfg, "/m", 1, layout=EngineLayout(local, 4, node, 2))
                out.append(int(cmd[cmd.index(flag) + 1]))
        return out

    assert seeds("sglang", "--random-seed") == [7, 8, 9, 10]
    assert seeds("embedded", "--seed") == [7, 8, 9, 10]
