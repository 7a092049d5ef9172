"""The engines' KV pool sized to the rollout (engine.max_total_tokens) and the trainer kept on the
device where the rollout leaves it room (loop.offload_trainer=auto): rltrain/engine/pool.py,
rltrain/between_steps.py's `Residency`."""

from __future__ import annotations

import pytest
import torch

from conftest import SGLANG_POOL_TOKENS, start_engine
from rltrain.between_steps import Residency
from rltrain.config import ConfigError, load_config
from rltrain.engine.command import server_command
from rltrain.engine.embedded import kv_pool
from rltrain.engine.layout import EngineLayout
from rltrain.engine.pool import ROW_SLACK, pool_tokens, rollout_tokens
from rltrain.setup import residency

GIB = 2**30


def _cfg(*overrides: str):
    base = [
        "model.path=/nonexistent/model",
        "data.path=synthetic:addition",
        "engine.device=cuda",
        "data.prompts_per_step=64",
        "data.max_prompt_tokens=64",
        "rollout.n=8",
        "rollout.max_new_tokens=256",
    ]
    return load_config(None, [*base, *overrides])


def _layout(ranks: int = 1, per: int = 1, apart: int = 0) -> EngineLayout:
    return EngineLayout(local_rank=0, local_world_size=ranks, node_rank=0, gpus_per_engine=per, engine_gpus=apart)


def test_auto_sizes_a_colocated_gpu_engines_pool_to_the_rows_a_step_sends_it():
    """One engine per GPU: the rank's 64 x 8 rows, each a 64-token prompt and a 256-token
    response (+ the row slack); one SGLang engine over 8 ranks: the rows of all 8."""
    row = 64 + 256 + ROW_SLACK
    assert pool_tokens(_cfg(), _layout(), world_size=1) == 512 * row
    assert pool_tokens(_cfg(), _layout(ranks=8, per=1), world_size=8) == 64 * row  # 8 prompts x 8 each
    assert pool_tokens(_cfg(), _layout(ranks=8, per=8), world_size=8) == 8 * 64 * row
    assert pool_tokens(_cfg(), _layout(ranks=8, per=8), world_size=16) == 8 * 32 * row  # two nodes
    # uneven: a rank may get one prompt more than the average
    assert pool_tokens(_cfg("data.prompts_per_step=65"), _layout(ranks=2, per=1), world_size=2) == 33 * 8 * row


def test_the_longest_response_the_run_samples_sizes_each_row():
    """Multi-turn: the trajectory's whole budget (max_trajectory_tokens, else max_new_tokens x
    max_turns); evaluation, where it runs: its own max_new_tokens and n (one request of
    engine.prompts_per_request prompts at least)."""
    turns = _cfg("rollout.tools=[rltrain.rollout.env:calculator]", "rollout.max_turns=4")
    assert rollout_tokens(turns, 1, 1) == 512 * (64 + 4 * 256 + ROW_SLACK)
    budget = _cfg("rollout.tools=[rltrain.rollout.env:calculator]", "rollout.max_trajectory_tokens=700")
    assert rollout_tokens(budget, 1, 1) == 512 * (64 + 700 + ROW_SLACK)
    evaluating = _cfg(
        "eval.path=synthetic:addition",
        "eval.every=5",
        "eval.max_new_tokens=1000",
        "eval.n=64",
        "data.prompts_per_step=8",
    )
    # 8 x 8 rows a step, but one evaluation request holds 16 prompts x 64 samples
    assert rollout_tokens(evaluating, 1, 1) == 16 * 64 * (64 + 1000 + ROW_SLACK)
    unused = _cfg("eval.max_new_tokens=1000", "eval.n=64")  # (no eval.path: no evaluation runs)
    assert rollout_tokens(unused, 1, 1) == 512 * (64 + 256 + ROW_SLACK)


def test_auto_leaves_the_pool_to_the_memory_fraction_where_nothing_else_needs_the_device():
    """Not colocated, engines on GPUs of their own, on the CPU, or a --max-total-tokens of the
    user's in engine.extra_args: 0 (no flag); a configured count is passed as it is."""
    assert pool_tokens(_cfg("loop.colocate=false"), _layout(), 1) == 0
    assert pool_tokens(_cfg("loop.colocate=false"), _layout(ranks=1, per=1, apart=1), 1) == 0
    assert pool_tokens(_cfg("engine.device=cpu"), _layout(), 1) == 0
    assert pool_tokens(_cfg("engine.extra_args=[--max-total-tokens,5000]"), _layout(), 1) == 0
    assert pool_tokens(_cfg("engine.max_total_tokens=5000"), _layout(), 1) == 5000
    assert pool_tokens(_cfg("engine.max_total_tokens=0"), _layout(), 1) == 0


def test_max_total_tokens_is_checked():
    for bad in ("-1", "many"):
        with pytest.raises(ConfigError, match="engine.max_total_tokens"):
            _cfg(f"engine.max_total_tokens={bad}")
    with pytest.raises(ConfigError, match="set one of them"):
        _cfg("engine.max_total_tokens=5000", "engine.extra_args=[--max-total-tokens,6000]")


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_both_engines_are_started_with_the_pool_in_sglangs_flag(backend):
    cfg = _cfg(f"engine.backend={backend}", "engine.device=cpu").engine
    assert "--max-total-tokens" not in server_command(cfg, "m", 1)  # auto, unresolved: the engine's own
    cfg.max_total_tokens = 0
    assert "--max-total-tokens" not in server_command(cfg, "m", 1)
    cfg.max_total_tokens = 12345
    cmd = server_command(cfg, "m", 1)
    assert cmd[cmd.index("--max-total-tokens") + 1] == "12345"


def test_the_embedded_engine_caps_its_gpu_pool_as_sglang_does(monkeypatch):
    """On CUDA --max-total-tokens caps what the memory fraction gives and never raises it (SGLang's
    `_apply_token_constraints`); on the CPU it is the pool's size."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    page = kv_pool.KVPool.page_bytes(config, kv_pool.PAGE_SIZE, torch.bfloat16)
    monkeypatch.setattr(kv_pool.torch.cuda, "mem_get_info", lambda d: (80 * GIB, 80 * GIB))
    monkeypatch.setattr(kv_pool.torch.cuda, "memory_allocated", lambda d: 0)
    cuda = torch.device("cuda", 0)
    fraction = int(0.5 * 80 * GIB // page)  # what 0.5 of the device gives

    def pages(tokens: int, device: torch.device = cuda) -> int:
        return kv_pool.pool_pages(config, torch.bfloat16, device, 10**6, 10**6, tokens, 0.5)

    assert pages(0) == fraction
    assert pages(4096) == 4096 // kv_pool.PAGE_SIZE + 1  # capped (+ the scratch page)
    assert pages(10**12) == fraction  # never above the fraction's
    assert pages(4096, torch.device("cpu")) == 4096 // kv_pool.PAGE_SIZE + 1


def test_auto_keeps_the_whole_state_or_moves_all_of_it_and_fit_keeps_a_part():
    """auto (fsdp): the whole state stays where the last rollout left room for it beside the
    headroom, else none of it; fit keeps what fits; neither keeps anything before a rollout."""
    whole, part = Residency(headroom=4 * GIB, whole=True), Residency(headroom=4 * GIB)
    assert whole.keep(12 * GIB) == part.keep(12 * GIB) == 0
    whole.observe(free=20 * GIB, kept=0)  # 16 GiB of room
    assert whole.keep(12 * GIB) == 12 * GIB
    whole.observe(free=8 * GIB, kept=12 * GIB)  # (steady)
    assert whole.keep(12 * GIB) == 12 * GIB
    whole.observe(free=3 * GIB, kept=12 * GIB)  # the engine took more: all moves
    assert whole.keep(12 * GIB) == 0
    whole.observe(free=15 * GIB, kept=0)  # 11 GiB of room: not the whole
    assert whole.keep(12 * GIB) == 0
    part.observe(free=15 * GIB, kept=0)
    assert part.keep(12 * GIB) == 11 * GIB
    part.observe(free=40 * GIB, kept=0)
    assert part.keep(12 * GIB) == 12 * GIB


def test_what_stays_is_decided_against_the_state_at_the_put_away_not_at_the_measure():
    """The first rollout is measured before the first step creates the optimizer's state: a
    trainer of 4 GiB of weights then, 12 GiB with Adam's moments at the put-away. auto keeps all
    12 where the room holds them; it never keeps the 4 it knew of and moves the rest, a part (on
    the H100 of session 20, step 1 moved the optimizer state while keeping the weights)."""
    whole, part = Residency(headroom=4 * GIB, whole=True), Residency(headroom=4 * GIB)
    for r in (whole, part):
        r.observe(free=20 * GIB, kept=0)  # measured while the weights alone were the state
    assert whole.keep(12 * GIB) == part.keep(12 * GIB) == 12 * GIB
    for r in (whole, part):
        r.observe(free=10 * GIB, kept=0)  # 6 GiB of room: the 12 do not fit
    assert whole.keep(12 * GIB) == 0 and part.keep(12 * GIB) == 6 * GIB


def test_which_trainer_keeps_what():
    assert residency(_cfg()).whole  # auto, fsdp
    assert residency(_cfg("loop.offload_trainer=true")) is None  # the whole state every step
    fit = residency(_cfg("loop.offload_trainer=fit"))
    assert fit is not None and not fit.whole and fit.headroom == 4 * GIB
    assert residency(_cfg("trainer.backend=megatron")) is None  # moves its whole state (its offload's way)


def test_sglang_takes_the_pool_size_from_rltrains_config(sglang_server):
    """Real SGLang started from engine.max_total_tokens (conftest's servers): its pool is no larger."""
    info = sglang_server.client.server_info()
    assert 0 < info["max_total_num_tokens"] <= SGLANG_POOL_TOKENS


def test_the_embedded_engine_reports_its_pool_as_sglang_does(tmp_path, model_a):
    """The paged path's pool in SGLang's field (`max_total_num_tokens`), of the size it was given."""
    srv = start_engine("embedded", model_a, tmp_path, max_total_tokens=1024, extra_args=["--decode", "paged"])
    try:
        assert srv.client.server_info()["max_total_num_tokens"] == 1024
    finally:
        srv.client.close()
        srv.process.stop()
