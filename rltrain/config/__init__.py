"""Typed configuration: dataclasses, YAML files and dotted command-line overrides.

A config is a tree of dataclasses. `load_config(path, overrides)` reads YAML, applies
`key.sub=value` overrides on top, converts every leaf to its declared type and validates
the result. Every error names the key, the value seen, what was expected and, for typos,
the closest valid keys — before any expensive work starts.

The sections live by theme: run.py (run, world, model, loop, checkpoint, release, sync),
sampling.py (data, eval, rollout, reward), training.py (algo, trainer), engine.py (engine),
tracking.py (metrics and its trackers); parsing.py reads a tree of them. This module holds the
whole `Config`, its cross-section checks and the entry points.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rltrain.config.engine import EmbeddedEngineConfig, EngineConfig
from rltrain.config.errors import ConfigError
from rltrain.config.parsing import build_section, check_tree, parse_override, set_dotted
from rltrain.config.run import (
    CheckpointConfig,
    LoopConfig,
    ModelConfig,
    ReleaseConfig,
    RunConfig,
    SyncConfig,
    WorldConfig,
)
from rltrain.config.sampling import DataConfig, EvalConfig, RewardConfig, RolloutConfig
from rltrain.config.tracking import MetricsConfig, MlflowConfig, WandbConfig
from rltrain.config.training import AlgoConfig, TrainerConfig

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DISTRIBUTED_COLOCATED",
    "DataConfig",
    "EmbeddedEngineConfig",
    "EngineConfig",
    "EvalConfig",
    "LoopConfig",
    "MetricsConfig",
    "MlflowConfig",
    "ModelConfig",
    "ReleaseConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TrainerConfig",
    "WandbConfig",
    "WorldConfig",
    "build_config",
    "config_to_dict",
    "dump_config",
    "load_config",
]


@dataclass
class Config:
    """The whole run. Sections are added as the system grows; unknown keys are errors."""

    run: RunConfig = field(default_factory=RunConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    release: ReleaseConfig = field(default_factory=ReleaseConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    @property
    def sync_transport(self) -> str:
        """sync.transport, with auto resolved: tensor when colocated, else disk."""
        if self.sync.transport != "auto":
            return self.sync.transport
        return "tensor" if self.loop.colocate else "disk"

    @property
    def engine_model_path(self) -> str:
        return self.engine.model_path or self.model.path

    def check(self) -> None:
        """Cross-section checks (each section checks itself first)."""
        if self.release.train and self.release.source == "host" and self.checkpoint.interval == 0:
            raise ConfigError(
                "release.train with release.source=host keeps the released trainer only in RAM: "
                "set checkpoint.interval >= 1 so it is also written to disk"
            )
        if self.sync_transport == "delta" and self.loop.colocate:
            raise ConfigError(
                "sync.transport=delta needs loop.colocate=false: a delta saves bytes on a slow shared "
                "disk, but colocated engines read the trainer's memory directly (use tensor)"
            )
        if self.engine.gpus and self.loop.colocate:
            raise ConfigError(
                f"engine.gpus={self.engine.gpus} puts the engines on GPUs of their own, where nothing is shared "
                "with the trainer: set loop.colocate=false (or engine.gpus=0 to colocate them on the trainer's GPUs)"
            )
        if self.sync_transport == "distributed" and self.engine.device == "cuda" and not self.engine.gpus:
            raise ConfigError(DISTRIBUTED_COLOCATED)
        if (
            self.sync_transport == "distributed"
            and self.engine.backend == "embedded"
            and self.engine.gpus_per_engine > 1
        ):
            raise ConfigError(
                f"sync.transport=distributed with engine.backend=embedded and engine.gpus_per_engine="
                f"{self.engine.gpus_per_engine}: the embedded engine's TP ranks are one process, which cannot join "
                "the weight-update group as each of them; use sync.transport=tensor or disk (or engine.backend=sglang)"
            )
        if self.loop.offload_trainer == "fit" and self.trainer.backend != "fsdp":
            raise ConfigError(
                f"loop.offload_trainer=fit keeps part of the trainer's state on the device, which "
                f"trainer.backend={self.trainer.backend}'s offload cannot (it moves the whole state): use "
                "loop.offload_trainer=true"
            )
        if self.algo.advantage in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline") and self.rollout.n < 2:
            raise ConfigError(
                f"algo.advantage={self.algo.advantage} compares samples of a prompt: needs rollout.n >= 2, "
                f"got {self.rollout.n}"
            )
        if self.loop.max_staleness and self.algo.dynamic_sampling:
            raise ConfigError(
                "loop.max_staleness=1 with algo.dynamic_sampling: dynamic sampling's rounds agree over the ranks "
                "while the rollout ahead runs beside training; set one of them off"
            )
        if self.algo.dynamic_sampling and self.rollout.n < 2:
            raise ConfigError("algo.dynamic_sampling keeps groups whose samples' rewards differ: needs rollout.n >= 2")
        if self.algo.overlong_buffer >= self.rollout.max_new_tokens:
            raise ConfigError(
                f"algo.overlong_buffer={self.algo.overlong_buffer} must be smaller than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens} (the penalty ramps over the last overlong_buffer tokens)"
            )
        if (
            self.algo.kl_in == "reward"
            and self.algo.kl_coef
            and self.algo.advantage not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
        ):
            raise ConfigError(
                "algo.kl_in=reward is the REINFORCE++ form; with "
                f"algo.advantage={self.algo.advantage} put the KL in the loss (algo.kl_in=loss)"
            )

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) / self.run.name

    @property
    def weights_dir(self) -> Path:
        return Path(self.sync.weights_dir) if self.sync.weights_dir else self.run_dir / "weights"


# Without engine.gpus the engines run on their ranks' GPUs (engine/layout.py), colocated or not.
DISTRIBUTED_COLOCATED = (
    "sync.transport=distributed on GPU with engine.gpus=0: the engines run on the trainer ranks' own GPUs "
    "(engine/layout.py; with loop.colocate=false too), so each trainer rank and the engine TP rank on its GPU "
    "would be one NCCL weight-update group's two ranks on one device, which NCCL refuses (a duplicate GPU): "
    "use sync.transport=tensor (CUDA IPC) or disk, or put the engines on GPUs of their own "
    "(loop.colocate=false, engine.gpus=N)"
)


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (optional), apply `key.sub=value` overrides, convert and validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {str(p)!r}: expected a mapping at the top level, got {type(loaded).__name__}"
            )
        raw = loaded
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    return build_config(raw)


def build_config(raw: dict[str, Any]) -> Config:
    """Build a validated `Config` from plain nested dicts (YAML-shaped)."""
    cfg = build_section(Config, raw, prefix="")
    check_tree(cfg)
    if cfg.loop.max_staleness and not cfg.algo.corrects_rollout:
        cfg.algo.rollout_is = "token"  # off-policy samples are always corrected (LoopConfig.max_staleness)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
