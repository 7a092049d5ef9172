"""Per-step metrics: phase times and memory, rollout and training statistics, across ranks.

Every rank measures its own phases; rank 0 gathers them over the bridge and writes one JSON line
per step to `<run dir>/metrics.jsonl` (optionally TensorBoard), and shows a progress bar.
Rates are global: tokens of all ranks over the slowest rank's phase time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rltrain.config import Config, config_to_dict
from rltrain.interfaces import World
from rltrain.runtime.failure import name_failure
from rltrain.runtime.files import append_line, atomic_write_text, set_rows_aside, step_rows
from rltrain.runtime.ledger import MemoryLedger

log = logging.getLogger("rltrain.loop")
DROPPED = "metrics.dropped.jsonl"  # rows of steps a resumed run runs again, moved out of metrics.jsonl


class PhaseClock:
    """Times each phase of a step and reads memory right after it; a phase that raises is logged
    with the rank, the phase and the step before the error goes on."""

    def __init__(self, device: torch.device, rank: int = 0, ledger: MemoryLedger | None = None):

        self.device, self.rank = device, rank
        self.ledger = ledger if ledger is not None else MemoryLedger(device)
        self.step = 0
        self.times: dict[str, float] = {}
        self.memory: dict[str, dict[str, float]] = {}
        self._step_start = time.perf_counter()

    def start_step(self, step: int = 0) -> None:
        self.step = step
        self.times, self.memory = {}, {}
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        except BaseException as e:
            name_failure(e, self.rank, f"phase {name} of step {self.step}")  # logged, and kept with the error
            raise
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0  # a phase entered twice adds up
            self.memory[name] = self.read_memory()

    def read_memory(self) -> dict[str, float]:
        """This rank's memory ledger (rltrain.runtime.ledger), GiB."""
        return {k: round(v, 4) for k, v in self.ledger.read().items()}

    @property
    def step_seconds(self) -> float:
        return time.perf_counter() - self._step_start


def recorded(path: Path) -> list[tuple[int, str]]:
    """(step, line) of every row in a metrics file (a torn last line left out)."""
    return step_rows(path)


def last_recorded_step(path: Path) -> int | None:
    """The last step with a metrics row (None without a metrics file). A step is done when its
    row is written, at its very end."""
    return max((step for step, _ in recorded(path)), default=0) if path.is_file() else None


class MetricsWriter:
    def __init__(self, cfg: Config, world: World, start_step: int = 0):
        self.cfg, self.world = cfg, world
        self.path = cfg.run_dir / "metrics.jsonl"
        self.bar = None
        self.tb = None
        self.wandb: Any = None
        self.mlflow: Any = None  # the mlflow module, its run active
        if world.rank == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._keep_steps_up_to(start_step)
            if cfg.metrics.progress_bar and sys.stderr.isatty():
                self.bar = tqdm(total=cfg.loop.steps, initial=start_step, desc="rltrain", dynamic_ncols=True)
            if cfg.metrics.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard is optional

                    self.tb = SummaryWriter(str(cfg.run_dir / "tensorboard"))
                except ImportError:
                    print("metrics.tensorboard=true but tensorboard is not installed; skipping it")
            if cfg.metrics.wandb.project:
                self.wandb = start_wandb(cfg, resumed=start_step > 0)
            if cfg.metrics.mlflow.tracking_uri:
                self.mlflow = start_mlflow(cfg, resumed=start_step > 0)

    def _keep_steps_up_to(self, start_step: int) -> None:
        """A resumed run keeps the rows its checkpoint covers; the rows after it (their steps run
        again) move to metrics.dropped.jsonl, so no step is counted twice and none is lost. (A run
        that starts at step 1 over existing rows was refused before: rltrain/history.py.)"""
        aside = self.path.with_name(DROPPED)
        moved = set_rows_aside(self.path, aside, lambda step: step <= start_step)
        if moved:
            log.warning(
                "resuming after step %d: %d metrics row(s) of later steps, which run again, moved to %s",
                start_step,
                moved,
                aside,
            )

    def step(
        self, step: int, rollout: Any, rewards: torch.Tensor | None, adv_stats: dict, train: dict, clock: PhaseClock
    ) -> dict[str, float]:
        thr = self.cfg.reward.pass_threshold
        flat = rewards.reshape(-1) if rewards is not None else torch.zeros(0)
        lengths = [len(s.completion.output_ids) for g in rollout.groups for s in g]
        prompts = [len(s.prompt.input_ids) for g in rollout.groups for s in g]
        local = {
            "n": float(flat.numel()),
            "reward_sum": float(flat.sum()),
            "reward_sq": float((flat**2).sum()),
            "passed": float((flat >= thr).sum()),
            "length_sum": float(sum(lengths)),
            "prompt_length_sum": float(sum(prompts)),
            **{k: v for k, v in rollout.stats.items()},
            "logp_diff_sum": adv_stats.get("logp_diff_engine_trainer", 0.0) * flat.numel(),
            "overlong_filtered": adv_stats.get("overlong_filtered", 0.0),
            "overlong_penalty_sum": adv_stats.get("overlong_penalty", 0.0) * flat.numel(),
            "times": clock.times,
            "memory": clock.memory,
            "step_seconds": clock.step_seconds,
        }
        gathered = self.world.bridge.all_gather_object(local, phase="metrics")
        if self.world.rank != 0:
            return {}
        tot = lambda k: sum(g[k] for g in gathered)  # noqa: E731
        n = max(tot("n"), 1.0)
        mean = tot("reward_sum") / n
        rec: dict[str, Any] = {
            "step": step + 1,
            "reward_mean": mean,
            "reward_std": max(tot("reward_sq") / n - mean**2, 0.0) ** 0.5,
            "pass_rate": tot("passed") / n,
            "response_length": tot("length_sum") / n,
            "prompt_length": tot("prompt_length_sum") / n,
            "samples": tot("samples"),
            "samples_trained": tot("n"),
            "generation_failed": tot("generation_failed"),
            "reward_failed": tot("reward_failed"),
            "groups_dropped": tot("groups_dropped"),
            "groups_identical": tot("groups_identical"),
            "groups_zero_advantage": tot("groups_zero_advantage"),
            # Generations lost to an engine that died, sampled again after its restart.
            "generation_retried": sum(g.get("generation_retried", 0.0) for g in gathered),
            "engine_restarts": max(g.get("engine_restarts", 0.0) for g in gathered),
            "logp_diff_engine_trainer": tot("logp_diff_sum") / n,
            **{k: v for k, v in train.items()},
        }
        if self.cfg.algo.overlong_filter:
            rec["overlong_filtered"] = tot("overlong_filtered")  # responses cut at the limit, out of the loss
        if self.cfg.algo.overlong_buffer:
            rec["overlong_penalty"] = tot("overlong_penalty_sum") / n  # mean reward added
        if self.cfg.algo.dynamic_sampling:  # DAPO: groups sampled, dropped (zero advantage) and kept, all ranks
            for k in ("sampled", "zero_advantage", "surplus", "kept"):
                rec[f"dynamic_groups_{k}"] = tot(f"dynamic_groups_{k}")
            rec["dynamic_batches"] = max(g["dynamic_batches"] for g in gathered)
        multi = sorted({k for g in gathered for k in g if k.startswith(("turns_", "tool_"))})
        if multi:  # multi-turn rollouts (rollout/multiturn.py): summed over the ranks
            rec["multiturn"] = {k: sum(g.get(k, 0.0) for g in gathered) for k in multi}
            rec["turns_per_trajectory"] = rec["multiturn"].get("turns_turns", 0.0) / max(
                rec["multiturn"].get("turns_trajectories", 0.0), 1.0
            )
        slowest = {p: max(g["times"].get(p, 0.0) for g in gathered) for p in gathered[0]["times"]}
        # loop.max_staleness: how many samples were trained at each lag behind the trained
        # weights ({"0": ..., "1": ...}), and the seconds of the rollout generated ahead, beside
        # the training it overlapped (its wait, if any, is the step's "rollout" phase).
        lags = sorted({k for g in gathered for k in g if k.startswith("stale_samples_")})
        if lags:
            rec["staleness"] = {k.removeprefix("stale_samples_"): sum(g.get(k, 0.0) for g in gathered) for k in lags}
        # loop.in_flight_update: the trained tokens at each lag (samples continued over an update
        # mix versions), and the rows the updates cut, continued or sampled again (inflight.py)
        token_lags = sorted({k for g in gathered for k in g if k.startswith("stale_tokens_")})
        if token_lags:
            rec["staleness_tokens"] = {
                k.removeprefix("stale_tokens_"): sum(g.get(k, 0.0) for g in gathered) for k in token_lags
            }
        for k in ("in_flight_cut", "in_flight_continued", "in_flight_requeued"):
            if any(k in g for g in gathered):
                rec[k] = sum(g.get(k, 0.0) for g in gathered)
        if any("rollout_ahead_s" in g for g in gathered):
            rec["rollout_ahead_s"] = max(g.get("rollout_ahead_s", 0.0) for g in gathered)
        rec["rollout_tokens_per_s"] = tot("response_tokens") / max(slowest.get("rollout", 0.0), 1e-9)
        rec["time"] = {**slowest, "step": max(g["step_seconds"] for g in gathered)}
        # inside the rollout phase (not phases of their own): the slowest rank's wait for its
        # engine's answers, and its decoding and scoring of them (rollout/collect.py's TIMES)
        rec["rollout_time"] = {k: max(g.get(k, 0.0) for g in gathered) for k in ("generate_s", "score_s")}
        rec["wall"] = time.time()  # when the step ended (start-up and shutdown are measured from it)
        rec["memory"] = {f"rank{r}": g["memory"] for r, g in enumerate(gathered)}
        append_line(self.path, json.dumps(rec))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{mean:.3f}",
                pass_rate=f"{rec['pass_rate']:.2f}",
                kl=f"{rec.get('kl', 0.0):.3f}",
                step_s=f"{rec['time']['step']:.1f}",
            )
        elif self.cfg.metrics.progress_bar:  # not a terminal (a batch log): a line, not \r frames
            log.info(
                "step %d/%d: reward %.3f, pass rate %.2f, kl %.3f, %.1f s",
                step + 1,
                self.cfg.loop.steps,
                mean,
                rec["pass_rate"],
                rec.get("kl", 0.0),
                rec["time"]["step"],
            )
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step + 1)
        if self.wandb is not None:
            self.wandb.log(flat_scalars(rec), step=step + 1)
        if self.mlflow is not None:
            self.mlflow.log_metrics(mlflow_names(flat_scalars(rec)), step=step + 1)
        return rec

    def evaluation(self, row: dict[str, Any] | None) -> None:
        """An evaluation's row (rank 0's; rollout/evaluation.py wrote it to eval.jsonl) to the
        other sinks, at the step whose weights it judged."""
        if row is None:
            return
        scalars = {k: float(v) for k, v in row.items() if k.startswith("eval/")}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, row["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=row["step"])
        if self.mlflow is not None:
            self.mlflow.log_metrics(mlflow_names(scalars), step=row["step"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.mlflow is not None:
            self.mlflow.end_run()
            self.mlflow = None


WANDB_ID = "wandb-run-id"  # in the run directory: a resumed run logs to the same W&B run


def start_wandb(cfg: Config, resumed: bool) -> Any:
    """The W&B run of this job (config/tracking.py WandbConfig), the resolved config as its config.
    Its id is made at the run's first start and kept in the run directory: a restart from a
    checkpoint resumes that run (W&B drops the steps it already has, and the rows after the
    checkpoint run again)."""
    import wandb  # noqa: PLC0415 - optional (the wandb extra; the config checks it is installed)

    w = cfg.metrics.wandb
    id_file = cfg.run_dir / WANDB_ID
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else secrets.token_hex(6)
    atomic_write_text(id_file, run_id + "\n")
    return wandb.init(
        project=w.project,
        entity=w.entity or None,
        name=w.name or cfg.run.name,
        id=run_id,
        resume="allow",
        mode=w.mode,
        dir=str(cfg.run_dir),
        config=json.loads(json.dumps(config_to_dict(cfg), default=str)),
    )


MLFLOW_ID = "mlflow-run-id"  # in the run directory: a resumed run logs to the same MLflow run


def start_mlflow(cfg: Config, resumed: bool) -> Any:
    """The MLflow run of this job (config/tracking.py MlflowConfig), the resolved config as its
    parameters and as config.json; resumed where the run directory keeps its id."""
    m = cfg.metrics.mlflow
    if m.tracking_uri.startswith("file:"):
        # MLflow 3 keeps its file store in maintenance mode behind this opt-in; a local store
        # needs nothing else (a server or a database is the tracking_uri's business).
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow  # noqa: PLC0415 - optional (the mlflow extra; the config checks it is installed)

    mlflow.set_tracking_uri(m.tracking_uri)
    id_file = cfg.run_dir / MLFLOW_ID
    config = json.loads(json.dumps(config_to_dict(cfg), default=str))
    if resumed and id_file.is_file():
        mlflow.start_run(run_id=id_file.read_text().strip())
        return mlflow
    mlflow.set_experiment(m.experiment)
    run = mlflow.start_run(run_name=m.run_name or cfg.run.name)
    atomic_write_text(id_file, run.info.run_id + "\n")
    mlflow.log_params({k: str(v)[:500] for k, v in flat_values(config).items()})
    mlflow.log_dict(config, "config.json")
    return mlflow


def flat_values(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (the override syntax)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat_values(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def mlflow_names(scalars: dict[str, float]) -> dict[str, float]:
    """Metric names as MLflow takes them (letters, digits, _ - . / and spaces): pass@k -> pass_at_k."""
    return {k.replace("@", "_at_"): v for k, v in scalars.items()}


def flat_scalars(rec: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """A metrics row's numbers, nested sections as `section/key` (the phase times, memory); the
    row's own step is the log's step, not a metric."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(flat_scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and (prefix or k != "step"):
            out[prefix + k] = float(v)
    return out
