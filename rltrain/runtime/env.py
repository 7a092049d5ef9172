"""The process's place in the job, read from torchrun's environment (or world size 1 without it)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of this process. Without torchrun: one rank, one node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    under_torchrun: bool

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0 owns the node's engine and other per-node resources."""
        return self.local_rank == 0

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> DistEnv:
        e = os.environ if environ is None else environ
        if "RANK" not in e and "WORLD_SIZE" not in e:
            return cls(0, 1, 0, 1, 0, None, None, False)
        try:
            rank = int(e["RANK"])
            world_size = int(e["WORLD_SIZE"])
            local_rank = int(e.get("LOCAL_RANK", rank))
            local_world_size = int(e.get("LOCAL_WORLD_SIZE", world_size))
            node_rank = int(e.get("GROUP_RANK", e.get("NODE_RANK", rank // max(local_world_size, 1))))
            port = e.get("MASTER_PORT")
            env = cls(
                rank,
                world_size,
                local_rank,
                local_world_size,
                node_rank,
                e.get("MASTER_ADDR"),
                int(port) if port else None,
                "TORCHELASTIC_RUN_ID" in e,
            )
        except (KeyError, ValueError) as err:
            raise RuntimeError(
                f"incomplete or malformed distributed environment ({err}): start with torchrun, "
                "or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            ) from None
        if not (0 <= env.rank < env.world_size) or env.world_size % env.local_world_size:
            raise RuntimeError(
                f"inconsistent distributed environment: RANK={env.rank} WORLD_SIZE={env.world_size} "
                f"LOCAL_WORLD_SIZE={env.local_world_size} (world size must be a multiple of the local size)"
            )
        if env.world_size > 1 and (env.master_addr is None or env.master_port is None):
            raise RuntimeError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (torchrun sets them)")
        return env


def single_node_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun would set for rank `rank` of `world_size` on one node, the store on
    127.0.0.1:`port`: for processes a benchmark spawns itself."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
