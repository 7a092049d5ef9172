"""Multi-turn rollouts, token in and token out: each trajectory alternates model turns sampled by the
engine and observations from its environment (env.py), all of a rank's trajectories at once.

    trajectories = MultiTurn(cfg.rollout, tokenizer, make_env)
    completions = trajectories.run(client, prompts, positions, params)   # prompt-major, n per prompt

The engine is sent the trajectory's running token ids every turn and its sampled ids are kept as
it returned them, never decoded and tokenised again; an observation's tokens are appended after
them: token ids as given, text tokenised alone, chat messages as the chat template renders them
after the model's turn (`Conversation.observation_ids`: what the template writes between the
end of the model's content and the next generation prompt, less the stop token the model sampled
itself). A trajectory's `Completion` holds every token after its first prompt with `loss_mask` 1
on the model's tokens only, and the engine's log-prob of each (0 on observation tokens, which are
never trained on).

Each trajectory runs on its own thread: its turns go to the engine as they come (the engine
batches the requests in flight; no turn waits for other trajectories' turns), and a tool that is
slow holds its own trajectory only. Limits: `rollout.max_turns` model turns, and
`rollout.max_trajectory_tokens` tokens after the first prompt (each turn may sample what is left;
reaching it ends the trajectory with finish reason `length`, as an overlong response does); a
turn cut at `rollout.max_new_tokens` ends it too, unless `rollout.continue_after_length`. Every
turn of trajectory (prompt i, sample j) has its own sampling seed: turn 0 the single-turn one
(`sample_seed`), turn t a hash of it and t, so a resumed run samples the same trajectories.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

from rltrain.config import RolloutConfig
from rltrain.generation import Completion, SamplingParams, sample_seed
from rltrain.interfaces import RolloutClient
from rltrain.rollout.data import Prompt
from rltrain.rollout.env import Environment, EnvStep, Observation, Tools
from rltrain.runtime.net import allow_open_files

MARK = "\ue000"  # a private-use character: where the model's content goes in a rendered turn
# Trajectories of a rank in flight at once, a thread and an engine connection each (all of a
# rank's, up to this many).
MAX_IN_FLIGHT = 4096
TURN_STATS = ("turns_", "tool_")  # the prefixes of a rollout's multi-turn stats (`MultiTurn.summary`)


@dataclass
class Trajectory:
    """One trajectory's result: its first prompt (as rendered) and its `Completion` (every token
    after it; `loss_mask` 1 on sampled tokens), with its turns and the environment's rewards."""

    prompt: Prompt
    completion: Completion
    turns: int = 0
    observation_tokens: int = 0
    last_turn: list[int] = field(default_factory=list)  # the model's last turn: what `reward.function` scores
    env_reward: float | None = None  # the sum of the rewards `step` returned (None: none)
    ended_by: str = "env"  # env, max_turns, budget, length (a turn's own limit), failed


@dataclass
class TurnStats:
    """A rollout's trajectories, summed over them (thread-safe)."""

    values: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kv: float) -> None:
        with self._lock:
            for k, v in kv.items():
                self.values[k] = self.values.get(k, 0.0) + v


class Conversation:
    """Token ids of prompts and observations, as the tokenizer's chat template writes them."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,  # data.chat_template_kwargs
    ):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.template_kwargs = dict(template_kwargs or {})

    def _render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat-message observations need a tokenizer with a chat template")
        return str(
            self.tokenizer.apply_chat_template(
                messages, tools=self.tools, tokenize=False, add_generation_prompt=generation, **self.template_kwargs
            )
        )

    def _ids(self, text: str) -> list[int]:
        return list(map(int, self.tokenizer(text, add_special_tokens=False)["input_ids"]))

    def prompt_ids(self, first: Observation | None, prompt: Prompt) -> list[int]:
        """The first prompt's ids: the data's (None), ids as given, text tokenised, or messages
        rendered with the tools and a generation prompt."""
        if first is None:
            return list(prompt.input_ids)
        if isinstance(first, str):
            return self._ids(first)
        if _is_ids(first):
            return [int(t) for t in first]
        return self._ids(self._render(cast("list[dict[str, Any]]", first), generation=True))

    def observation_ids(self, obs: Observation, last_sampled: int | None) -> list[int]:
        """An observation's ids, to follow the model's turn whose last sampled id is `last_sampled`."""
        if isinstance(obs, str):
            return self._ids(obs)
        if _is_ids(obs):
            return [int(t) for t in obs]
        turn: list[dict[str, Any]] = [{"role": "user", "content": "."}, {"role": "assistant", "content": MARK}]
        text = self._render(turn + cast("list[dict[str, Any]]", obs), generation=True)
        after = text[text.index(MARK) + len(MARK) :]  # the turn's end, the observation, the next prompt
        if last_sampled is not None:
            stop = self.tokenizer.decode([last_sampled], skip_special_tokens=False)
            body = after.lstrip()
            if stop and body.startswith(stop):  # the model sampled the turn's end itself
                after = body[len(stop) :]
        return self._ids(after)


def _is_ids(obs: Any) -> TypeGuard[list[int]]:
    return isinstance(obs, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs)


def turn_seed(params: SamplingParams, prompt: int, sample: int, turn: int) -> int | None:
    """Turn `turn`'s sampling seed of sample `sample` of prompt `prompt` (module doc)."""
    first = sample_seed(params, prompt, sample)
    if first is None or turn == 0:
        return first
    digest = hashlib.blake2b(f"{first}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


class MultiTurn:
    """A rank's multi-turn rollouts (module doc). `make_env(record)`: a trajectory's environment."""

    def __init__(
        self,
        cfg: RolloutConfig,
        tokenizer: Any,
        make_env: Callable[[dict[str, Any]], Environment],
        tools: Tools | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.cfg, self.tokenizer, self.make_env, self.tools = cfg, tokenizer, make_env, tools
        self.conversation = Conversation(tokenizer, tools.schemas if tools is not None else None, template_kwargs)
        self.stats = TurnStats()

    def summary(self) -> dict[str, float]:
        """The trajectories run since `stats` was last emptied, and the tool calls since the last
        summary: `turns_*` (trajectories, turns, sampled and observation tokens, seconds in the
        engine and the environment, how trajectories ended, environments that failed) and
        `tool_*` (calls, errors and timeouts, all tools and per tool; seconds)."""
        out = {f"turns_{k}": v for k, v in self.stats.values.items()}
        if self.tools is not None:
            t, self.tools.stats = self.tools.stats, type(self.tools.stats)()
            out["tool_calls"] = float(sum(t.calls.values()))
            out["tool_errors"] = float(sum(t.errors.values()))
            out["tool_timeouts"] = float(t.timeouts)
            out["tool_s"] = t.seconds
            out.update({f"tool_calls_{name}": float(n) for name, n in t.calls.items()})
            out.update({f"tool_errors_{name}": float(n) for name, n in t.errors.items()})
        return out

    @staticmethod
    def from_config(cfg: RolloutConfig, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> MultiTurn:
        """`rollout.env`'s environment class, or the tool environment over `rollout.tools`
        (`template_kwargs`: data.chat_template_kwargs)."""
        from rltrain.rollout.env import ToolEnvironment, load_object  # noqa: PLC0415 - (the same package)

        if cfg.env and not cfg.tools:
            cls = load_object(cfg.env, "rollout.env")
            return MultiTurn(cfg, tokenizer, cls, None, template_kwargs)
        if cfg.env:  # a tool environment of the user's: made as cls(record, tools), it may score
            tool_env = load_object(cfg.env, "rollout.env")
            if not (isinstance(tool_env, type) and issubclass(tool_env, ToolEnvironment)):
                raise ValueError(
                    f"rollout.env={cfg.env} and rollout.tools are both set: the environment must then be a "
                    "rltrain.rollout.env.ToolEnvironment (made with the tools); another environment runs its own tools"
                )
            tools = Tools(list(cfg.tools), cfg.tool_timeout_s)
            return MultiTurn(cfg, tokenizer, lambda record: tool_env(record, tools), tools, template_kwargs)
        tools = Tools(list(cfg.tools), cfg.tool_timeout_s)
        return MultiTurn(cfg, tokenizer, lambda record: ToolEnvironment(record, tools), tools, template_kwargs)

    def run(
        self, client: RolloutClient, prompts: list[Prompt], positions: list[int], params: SamplingParams
    ) -> list[Trajectory]:
        """Every prompt's `params.n` trajectories, prompt-major, each on its own thread."""
        jobs = [(p, pos, j) for p, pos in zip(prompts, positions) for j in range(params.n)]
        if not jobs:
            return []
        workers = min(len(jobs), MAX_IN_FLIGHT)
        # (threads started for each rollout: a pool kept from the last one, its idle threads all
        # woken at once, spread the later turns twice as wide on an H100; session 29's report)
        allow_open_files(workers + 1024)  # a connection to the engine each
        with ThreadPoolExecutor(workers, thread_name_prefix="rltrain-trajectory") as pool:
            return list(pool.map(lambda job: self._one(client, params, *job), jobs))

    def _one(self, client: RolloutClient, params: SamplingParams, prompt: Prompt, pos: int, j: int) -> Trajectory:
        failed = Completion(prompt_index=pos, sample_index=j)
        try:
            env = self.make_env(prompt.record)
            first = self.conversation.prompt_ids(env.reset(), prompt)
        except Exception as e:  # noqa: BLE001 - the environment's failure fails this trajectory only
            failed.error = f"environment failed to start: {type(e).__name__}: {e}"
            self.stats.add(env_failed=1)
            return Trajectory(prompt, failed, ended_by="failed")
        start = Prompt(prompt.index, first, prompt.record)
        ids, mask, logp = list(first), list[int](), list[float]()
        budget = self.cfg.max_trajectory_tokens or self.cfg.max_new_tokens * self.cfg.max_turns
        out = Trajectory(start, Completion(prompt_index=pos, sample_index=j, prompt_tokens=len(first)))
        rewards: list[float] = []
        versions: list[str | None] = []  # the version of each token of the trajectory after its prompt
        t_engine = t_env = 0.0
        while True:
            left = budget - len(mask)
            seed = turn_seed(params, pos, j, out.turns)
            turn_params = dataclasses.replace(
                params,
                n=1,
                max_new_tokens=min(params.max_new_tokens or left, left),
                sampling_seed=None if seed is None else seed - pos,
            )
            t0 = time.perf_counter()
            (c,) = client.generate([ids], turn_params, positions=[pos])
            t_engine += time.perf_counter() - t0
            out.turns += 1
            if not c.ok:
                out.completion.error = c.error or f"turn {out.turns}: finish reason {c.finish_reason!r}"
                out.ended_by = "failed"
                break
            versions += c.token_versions or [c.weight_version] * len(c.output_ids)
            out.last_turn = list(c.output_ids)
            ids += c.output_ids
            mask += [1] * len(c.output_ids)
            logp += list(c.logprobs) if c.logprobs else [0.0] * len(c.output_ids)
            if len(mask) >= budget:
                out.ended_by = "budget"
                break
            if c.finish_reason == "length" and not self.cfg.continue_after_length:
                out.ended_by = "length"
                break
            text = self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
            t0 = time.perf_counter()
            try:
                step: EnvStep = env.step(text, list(c.output_ids))
            except Exception as e:  # noqa: BLE001 - fails this trajectory, counted
                out.completion.error = f"environment failed at turn {out.turns}: {type(e).__name__}: {e}"
                out.ended_by = "failed"
                self.stats.add(env_failed=1)
                break
            finally:
                t_env += time.perf_counter() - t0
            if step.reward is not None:
                rewards.append(float(step.reward))
            if step.observation is None:
                break
            if out.turns >= self.cfg.max_turns:  # no turn left to answer it
                out.ended_by = "max_turns"
                break
            obs = self.conversation.observation_ids(step.observation, c.output_ids[-1] if c.output_ids else None)
            if len(mask) + len(obs) >= budget:  # no room left for the model to answer it
                out.ended_by = "budget"
                break
            ids += obs
            versions += versions[-1:] * len(obs)  # (not sampled: the version of the turn it answers)
            mask += [0] * len(obs)
            logp += [0.0] * len(obs)
            out.observation_tokens += len(obs)
        c = out.completion
        c.output_ids, c.logprobs, c.loss_mask = ids[len(first) :], logp, mask
        if out.ended_by in ("budget", "length") and c.error is None:
            c.finish_reason = "length"
        elif c.error is None:
            c.finish_reason = "stop"
        # Turns of several versions only where a weight update came between them (loop.in_flight_update):
        # each token's kept, the trajectory's the oldest (what the staleness bound judges).
        c.weight_version = versions[0] if versions else None
        c.token_versions = versions if len(set(versions)) > 1 else None
        out.env_reward = sum(rewards) if rewards else None
        self.stats.add(
            trajectories=1,
            turns=out.turns,
            sampled_tokens=sum(mask),
            observation_tokens=out.observation_tokens,
            engine_s=t_engine,
            env_s=t_env,
            **{f"ended_by_{out.ended_by}": 1},
        )
        return out
