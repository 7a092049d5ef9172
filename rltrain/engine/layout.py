"""How a node's GPUs are split into engines, and which engine and TP rank each rank is.

A node runs `local_world_size` ranks, one per GPU (rank with local rank L on GPU L). Its GPUs
are cut into `local_world_size / gpus_per_engine` engines of `gpus_per_engine` consecutive GPUs
each; engine e of the node spans GPUs `e * gpus_per_engine ...` (SGLang's `--base-gpu-id`,
`--tp-size gpus_per_engine`) and is started by the first rank on them, its leader. The rank on
GPU `base + k` is the engine's TP rank k: it generates through that engine, and under
`sync.transport=tensor` it builds TP rank k's share of every weight bucket on its own GPU.

    gpus_per_engine=0 (auto)   SGLang: one engine over the whole node; the embedded engine
                               (one device each): one engine per GPU
    gpus_per_engine=1          one engine per GPU (small models)
    gpus_per_engine=8          one engine per 8-GPU node

The embedded engine over k > 1 GPUs is one process that computes on the first of them and takes
SGLang's per-TP-rank weight payloads for its k TP ranks (`--tp-size`): SGLang's layout and
protocol where SGLang is absent (and on CPU, where SGLang cannot run a MoE at EP > 1). It does
not shard the model: on GPUs it is for checking a layout, not for serving a model one GPU
cannot hold.

Engines on GPUs of their own (`engine.gpus` = m > 0, with `loop.colocate=false`): the node's first
`local_world_size` GPUs train (one rank each, as torchrun numbers them) and the m GPUs after them
serve rollout, cut into `m / gpus_per_engine` engines the same way: engine e spans GPUs
`local_world_size + e * gpus_per_engine ...`. The node's ranks share its engines round robin
(rank L generates through engine `L % engines`); the first rank of each engine, local rank e,
starts it and sends it its weights. No trainer rank is one of its TP ranks, so a weight payload
per TP rank (`sync.transport=tensor`) is not built for them: such engines are fed by
`distributed` (NCCL broadcast) or `disk`, and `tensor` takes engines of one GPU.

    torchrun --nproc-per-node=6 ... engine.gpus=2                # 6 trainer GPUs, 2 engines of one GPU
    torchrun --nproc-per-node=4 ... engine.gpus=4 engine.backend=sglang sync.transport=distributed
                                                                 # 4 trainer GPUs, one SGLang engine at TP 4

On CPU a "GPU" is a rank (or, apart, an engine slot): the same layout, with the node's CPU cores
shared out between the slots (`cpu_binding`).

A started engine's own report of its layout (/server_info) must be this layout
(`check_reported`): the sync builds one payload per TP rank of the layout, and routes experts by
SGLang's default expert groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rltrain.config import ConfigError, EngineConfig
from rltrain.runtime.env import DistEnv


@dataclass(frozen=True)
class EngineLayout:
    """This rank's place among the node's engines (pure: from the config and the environment)."""

    local_rank: int
    local_world_size: int
    node_rank: int
    gpus_per_engine: int
    engine_gpus: int = 0  # engine.gpus: the node's GPUs after the trainer's that serve rollout (0: shared)

    @classmethod
    def of(cls, cfg: EngineConfig, backend: str, env: DistEnv, visible_gpus: int | None) -> EngineLayout:
        """The layout the config asks for, checked against the node: `backend` is the resolved
        engine backend, `visible_gpus` the GPUs this process sees (None on CPU)."""
        n = env.local_world_size
        if cfg.gpus:
            return cls._apart(cfg, backend, env, visible_gpus)
        per = cfg.gpus_per_engine or (n if backend == "sglang" else 1)
        if per > n:
            raise ConfigError(
                f"engine.gpus_per_engine={per} is larger than the node: LOCAL_WORLD_SIZE={n} ranks "
                f"(torchrun --nproc-per-node); an engine spans GPUs of one node only, so set "
                f"engine.gpus_per_engine to a divisor of {n}"
            )
        if n % per:
            divisors = [d for d in range(1, n + 1) if n % d == 0]
            raise ConfigError(
                f"engine.gpus_per_engine={per} does not divide the node's {n} GPUs (LOCAL_WORLD_SIZE={n}): "
                f"set it to one of {divisors}"
            )
        if visible_gpus is not None and visible_gpus < n:
            raise ConfigError(
                f"LOCAL_WORLD_SIZE={n} ranks on this node but only {visible_gpus} GPU(s) visible: run one rank "
                f"per GPU (torchrun --nproc-per-node={visible_gpus}) or make all {n} visible (CUDA_VISIBLE_DEVICES)"
            )
        return cls(env.local_rank, n, env.node_rank, per)

    @classmethod
    def _apart(cls, cfg: EngineConfig, backend: str, env: DistEnv, visible_gpus: int | None) -> EngineLayout:
        """Engines on `cfg.gpus` GPUs of their own, after the node's trainer GPUs (module docstring)."""
        n, m = env.local_world_size, cfg.gpus
        per = cfg.gpus_per_engine or (m if backend == "sglang" else 1)
        if m % per:
            divisors = [d for d in range(1, m + 1) if m % d == 0]
            raise ConfigError(
                f"engine.gpus_per_engine={per} does not divide engine.gpus={m}, the node's GPUs that serve "
                f"rollout: set engine.gpus_per_engine to one of {divisors}, or engine.gpus to a multiple of {per}"
            )
        engines = m // per
        if engines > n:
            raise ConfigError(
                f"engine.gpus={m} at engine.gpus_per_engine={per} makes {engines} engines per node, more than its "
                f"{n} trainer rank(s) (LOCAL_WORLD_SIZE), one of which must start and feed each engine: set "
                f"engine.gpus_per_engine to {-(-m // n)} or more, or engine.gpus to at most {n * per}"
            )
        if visible_gpus is not None and visible_gpus < n + m:
            raise ConfigError(
                f"{n} trainer rank(s) per node (LOCAL_WORLD_SIZE) and engine.gpus={m} need {n + m} GPUs on each node, "
                f"but this process sees {visible_gpus}: run torchrun --nproc-per-node={max(visible_gpus - m, 0)} "
                f"(the trainer's GPUs; the engines take the last {m}), or set engine.gpus={max(visible_gpus - n, 0)}, "
                "or make every GPU visible (CUDA_VISIBLE_DEVICES)"
            )
        return cls(env.local_rank, n, env.node_rank, per, m)

    @property
    def apart(self) -> bool:
        """The engines are on GPUs of their own (engine.gpus), not on the trainer ranks'."""
        return self.engine_gpus > 0

    @property
    def engines_per_node(self) -> int:
        return (self.engine_gpus or self.local_world_size) // self.gpus_per_engine

    @property
    def engine(self) -> int:
        """This rank's engine on the node."""
        if self.apart:
            return self.local_rank % self.engines_per_node
        return self.local_rank // self.gpus_per_engine

    @property
    def tp_rank(self) -> int:
        """This rank's TP rank in its engine (its GPU's place in the engine); apart, 0 on every
        rank: no trainer rank is on an engine's GPUs (its leader speaks for it)."""
        return 0 if self.apart else self.local_rank % self.gpus_per_engine

    @property
    def is_engine_leader(self) -> bool:
        """The first rank of an engine's GPUs starts it and talks to it for the engine's ranks;
        apart, local rank e leads engine e."""
        return self.local_rank < self.engines_per_node if self.apart else self.tp_rank == 0

    @property
    def base_gpu_id(self) -> int:
        first = self.local_world_size if self.apart else 0  # apart: after the trainer's GPUs
        return first + self.engine * self.gpus_per_engine

    @property
    def trainer_tp_ranks(self) -> bool:
        """Whether each of the engine's TP ranks is a trainer rank (on its GPU), which builds that
        TP rank's weight payloads (`sync.transport=tensor`, TP > 1): colocated layouts only."""
        return not self.apart and self.gpus_per_engine > 1

    @property
    def name(self) -> str:
        """node<k>-engine<e>: the engine's name in logs, errors and file names."""
        return f"node{self.node_rank}-engine{self.engine}"

    def local_ranks(self) -> list[int]:
        """The local ranks of this rank's engine, in TP-rank order; apart, the ranks that
        generate through it, its leader first."""
        if self.apart:
            return list(range(self.engine, self.local_world_size, self.engines_per_node))
        return list(range(self.base_gpu_id, self.base_gpu_id + self.gpus_per_engine))

    def ranks(self, node_first_rank: int) -> list[int]:
        """The global ranks of this rank's engine, in TP-rank order (torchrun numbers a node's
        ranks consecutively from `node_first_rank`)."""
        return [node_first_rank + r for r in self.local_ranks()]

    def check_reported(self, info: dict[str, Any]) -> None:
        """The engine's /server_info against this layout (ConfigError naming what to set): its
        `tp_size` must be `gpus_per_engine` (an --tp-size in engine.extra_args would have the
        sync build payloads for TP ranks that do not exist, or miss some), for every model; and
        the two SGLang layouts whose expert placement the sync's routing does not follow are
        refused: `moe_dp_size` > 1 with expert parallelism (SGLang's EP groups are then cut
        from tp / (ep * moe_dp) ranks), and an elastic-EP joiner (`ep_join_rank_offset` != 0:
        its EP ranks start at the offset)."""
        where = f"{self.name} (engine.extra_args or the engine's defaults)"
        tp = info.get("tp_size")
        if tp != self.gpus_per_engine:
            raise ConfigError(
                f"{where} reports tp_size={tp!r}, but it was laid out over {self.gpus_per_engine} GPU(s) "
                f"(engine.gpus_per_engine={self.gpus_per_engine}): the sync would build weight payloads for TP "
                "ranks that do not exist, or miss some. Set the engine's TP size through engine.gpus_per_engine, "
                "not --tp-size in engine.extra_args"
            )
        moe_dp, ep = info.get("moe_dp_size", 1), info.get("ep_size", 1)
        if moe_dp != 1 and ep != 1:
            raise ConfigError(
                f"{where} reports moe_dp_size={moe_dp!r} with ep_size={ep!r}: SGLang then builds its expert groups "
                f"over tp_size / (ep_size * moe_dp_size) ranks, which the sync's expert routing does not follow; "
                "start it with --moe-dp-size 1 (the default), or without expert parallelism"
            )
        offset = info.get("ep_join_rank_offset", 0)
        if offset:
            raise ConfigError(
                f"{where} reports ep_join_rank_offset={offset!r} (an elastic-EP joiner): its EP ranks start at "
                "that offset, which the sync's expert routing does not follow; start it without "
                "--elastic-ep-join-rank-offset"
            )

    def cpu_binding(self, cores: list[int] | None = None) -> str:
        """SGLang's SGLANG_CPU_OMP_THREADS_BIND for this engine on CPU: the node's cores split
        evenly between its ranks, each TP rank bound to its rank's share ("0|1" for TP 2 on two
        cores). Without it SGLang refuses more TP ranks than NUMA nodes."""
        cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
        # One slot per GPU of the layout: the ranks', then (apart) the engines' own.
        share = max(1, len(cores) // (self.local_world_size + self.engine_gpus))
        parts = []
        for k in range(self.gpus_per_engine):
            slot = self.base_gpu_id + k
            mine = cores[(slot * share) % len(cores) : (slot * share) % len(cores) + share] or cores[:1]
            parts.append(",".join(map(str, mine)))
        return "|".join(parts)
