"""Run under torchrun by test_world_torchrun.py: World on torchrun's own agent store."""

import json
import os
import sys

import torch
import torch.distributed as dist

from rltrain.runtime.world import World

world = World(backend="gloo", timeout=60)
pair = world.new_group([0, 1], description="pair")
sums = []
for _ in range(3):
    world.destroy()
    world.rebuild()
    t = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(t, group=pair.pg)
    sums.append(t.item())
gens = world.bridge.all_gather_object(world.generation)
agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
world.close()
if world.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"sums": sums, "gens": gens, "agent_store": agent_store}, f)
