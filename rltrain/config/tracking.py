"""Where metrics go: jsonl, TensorBoard, plots, a progress bar, and the trackers (W&B, MLflow),
each an optional extra checked when the config is read."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from rltrain.config.errors import ConfigError


@dataclass
class WandbConfig:
    """Weights & Biases (the `wandb` extra): off while `project` is empty. Offline runs write
    under the run directory (`wandb sync` uploads them later); a resumed run logs to the same
    W&B run (its id is kept in the run directory)."""

    project: str = ""
    name: str = ""  # the W&B run's name (default: run.name)
    mode: Literal["offline", "online"] = "offline"
    entity: str = ""

    def check(self) -> None:
        _installed("wandb", "metrics.wandb.project", self.project)


@dataclass
class MlflowConfig:
    """MLflow (the `mlflow` extra, mlflow-skinny): off while `tracking_uri` is empty. A server
    (`http://host:5000`, `databricks`) or a local `file:/path/mlruns` store; a resumed run logs
    to the same MLflow run (its id is kept in the run directory)."""

    tracking_uri: str = ""
    experiment: str = "rltrain"
    run_name: str = ""  # default: run.name

    def check(self) -> None:
        _installed("mlflow", "metrics.mlflow.tracking_uri", self.tracking_uri)


def _installed(package: str, key: str, value: str) -> None:
    """A tracker asked for (`key` set) needs its package, rltrain's extra of the same name."""
    if value and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f'{key}={value!r} but {package} is not installed: pip install "rltrain[{package}]" (or leave {key} empty)'
        )


@dataclass
class MetricsConfig:
    progress_bar: bool = True
    tensorboard: bool = False
    plot: bool = True  # write PNGs into the run directory at the end
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
