"""Command line: `[torchrun ...] python -m rltrain [COMMAND] --config FILE [key.sub=value ...]`.

Commands:
  train        (default) run the job described by the config
  show-config  print the resolved config (YAML) and exit
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rltrain.config import Config, ConfigError, dump_config, load_config, write_resolved_config
from rltrain.runtime.env import DistEnv

COMMANDS = ("train", "show-config")
log = logging.getLogger("rltrain")


def setup_logging(rank: int) -> None:
    """Rank-prefixed logs; ranks other than 0 only warn unless RLTRAIN_LOG_ALL_RANKS=1."""
    level = logging.INFO if rank == 0 or os.environ.get("RLTRAIN_LOG_ALL_RANKS") == "1" else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m rltrain",
        description="RL post-training for LLMs as one SPMD program. Start with torchrun for several ranks.",
        epilog="examples:\n"
        "  torchrun --nproc-per-node=2 -m rltrain --config configs/quickstart.yaml world.timeout_s=120\n"
        "  python -m rltrain show-config --config configs/quickstart.yaml run.seed=3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("command", nargs="?", default="train", help=f"one of: {', '.join(COMMANDS)} (default: train)")
    ap.add_argument("--config", "-c", help="YAML config file (defaults are used for keys it leaves out)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.seed=1 world.backend=gloo")
    args = ap.parse_intermixed_args(argv)
    # `python -m rltrain key=value` (no command): the first positional is an override.
    if "=" in args.command:
        args.overrides.insert(0, args.command)
        args.command = "train"
    if args.command not in COMMANDS:
        ap.error(f"unknown command {args.command!r}; expected one of: {', '.join(COMMANDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rltrain: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        sys.stdout.write(dump_config(cfg))
        return 0
    return train(cfg, env)


def train(cfg: Config, env: DistEnv) -> int:
    from rltrain.runtime.world import World

    if env.rank == 0:
        path = write_resolved_config(cfg, cfg.run_dir)
        log.info("resolved config written to %s", path)
    world = World.from_config(cfg.world, env)
    try:
        log.info("world up: %d ranks, backend %s, generation %d", world.world_size, world.backend, world.generation)
        # The driver loop (rollout -> train -> sync) is issue #4; until it lands the job stops
        # here with a clear message instead of pretending to train.
        log.error("the RL driver loop is not built yet; run `python -m rltrain.bench.world` to exercise the runtime")
        return 2
    finally:
        world.close()
