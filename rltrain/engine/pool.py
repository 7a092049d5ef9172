"""How many tokens an engine's KV pool holds: engine.max_total_tokens, resolved for the run.

SGLang sizes its pool from --mem-fraction-static (0.8 of an H200 holds ~108 GiB of KV for a 1.7B
model), far more than a step's rollout can fill: 512 rows of a 1,024-token prompt and a 256-token
response are ~70 GiB at most, ~17 GiB as the rows usually are. Colocated, every byte of pool
beyond the rollout's rows is a byte the trainer's state cannot stay in while the engines roll
out, so it is copied out and back every step. With `auto` the pool is capped at what one step's
rollout can hold at once (`rollout_tokens`), through SGLang's own --max-total-tokens, which
never raises the pool above what the memory fraction gives; the embedded engine takes the flag
the same way. A larger batch than that (an evaluation's) is queued by the engine, not refused.
"""

from __future__ import annotations

from rltrain.config import Config
from rltrain.engine.command import resolve_device
from rltrain.engine.layout import EngineLayout

# Tokens a row may hold past its prompt and response: its last page part-filled, by less than a
# page (the embedded engine's pages are 64 tokens, kv_pool.PAGE_SIZE; SGLang's 1 by default).
ROW_SLACK = 64


def pool_tokens(cfg: Config, layout: EngineLayout, world_size: int) -> int:
    """The --max-total-tokens each engine of this run is started with (0: none, the pool from
    engine.mem_fraction_static): the configured count; with `auto`, `rollout_tokens` where the
    engines share the ranks' GPUs, else 0 (engines on the CPU, on GPUs of their own, or with
    the flag in engine.extra_args: the user's)."""
    engine = cfg.engine
    if engine.max_total_tokens != "auto":
        return engine.max_total_tokens
    shared = cfg.loop.colocate and not layout.apart and resolve_device(engine.device) == "cuda"
    if not shared or "--max-total-tokens" in engine.extra_args:
        return 0
    return rollout_tokens(cfg, layout.gpus_per_engine, world_size)


def rollout_tokens(cfg: Config, ranks_per_engine: int, world_size: int) -> int:
    """The most tokens one step's rollout can hold in one engine at once: each of its ranks'
    rows (the rank's share of data.prompts_per_step, rollout.n samples each; where evaluation
    runs, at least one of its requests: engine.prompts_per_request prompts of eval.n samples),
    each a prompt of data.max_prompt_tokens and the longest response the run samples (a
    trajectory's whole budget in multi-turn rollouts; evaluation's, where it runs), plus
    `ROW_SLACK`. More rows than that (the rest of an evaluation) wait in the engine's queue."""
    rollout, evaluation = cfg.rollout, cfg.eval
    if rollout.multi_turn:
        response = rollout.max_trajectory_tokens or rollout.max_new_tokens * rollout.max_turns
    else:
        response = rollout.max_new_tokens
    rows = -(-cfg.data.prompts_per_step // world_size) * rollout.n
    if evaluation.path and (evaluation.every or evaluation.before_train):
        response = max(response, evaluation.max_new_tokens or rollout.max_new_tokens)
        rows = max(rows, cfg.engine.prompts_per_request * evaluation.n)
    return rows * ranks_per_engine * (cfg.data.max_prompt_tokens + response + ROW_SLACK)
