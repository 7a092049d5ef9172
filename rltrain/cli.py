"""Command line: `[torchrun ...] python -m rltrain [COMMAND] --config FILE [key.sub=value ...]`.

Commands:
  train        (default) run the job described by the config
  show-config  print the resolved config (YAML), or with --run-dir its run directory, and exit
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import sys
from pathlib import Path

from rltrain.config import Config, ConfigError, dump_config, load_config
from rltrain.runtime.env import DistEnv
from rltrain.runtime.files import atomic_write_text
from rltrain.runtime.stop import StopRequest

COMMANDS = ("train", "show-config")
log = logging.getLogger("rltrain")


def setup_logging(rank: int) -> None:
    """Rank-prefixed logs; ranks other than 0 only warn unless RLTRAIN_LOG_ALL_RANKS=1;
    RLTRAIN_LOG_LEVEL=DEBUG also shows every world transition with its timings."""
    level = logging.INFO if rank == 0 or os.environ.get("RLTRAIN_LOG_ALL_RANKS") == "1" else logging.WARNING
    level = getattr(logging, os.environ.get("RLTRAIN_LOG_LEVEL", logging.getLevelName(level)).upper(), level)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # One line per HTTP request would drown the progress bar.
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


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
    ap.add_argument("--run-dir", action="store_true", help="show-config: print only the resolved run directory")
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
    stop = StopRequest().install()  # first: a stop signal from here on ends the run after a checkpoint
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = DistEnv.from_environ()
    setup_logging(env.rank)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"rltrain: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "show-config":
        sys.stdout.write(f"{cfg.run_dir}\n" if args.run_dir else dump_config(cfg))
        return 0
    return train(cfg, env, stop)


def write_resolved_config(cfg: Config, run_dir: Path) -> Path:
    """Write `config.yaml` into the run directory atomically (temp file, fsync, rename)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    atomic_write_text(target, dump_config(cfg))
    return target


def _report_cpus(env: DistEnv) -> None:
    """The CPUs this node's ranks may run on (a scheduler that pins CPUs gives a job what it asked
    for, one core if it asked for nothing)."""
    if not env.is_node_leader:
        return
    cpus = len(os.sched_getaffinity(0))
    if env.rank == 0:
        log.info("node %d: %d rank(s) on %d CPU(s)", env.node_rank, env.local_world_size, cpus)
    if cpus < env.local_world_size:
        log.warning(
            "node %d: %d rank(s) share %d CPU(s): ask the scheduler for more (sbatch --exclusive, or --cpus-per-task)",
            env.node_rank,
            env.local_world_size,
            cpus,
        )


def train(cfg: Config, env: DistEnv, stop: StopRequest) -> int:
    from rltrain.history import HistoryError, PreviousAttemptFailed  # noqa: PLC0415 - show-config and --help answer without importing torch
    from rltrain.loop import run  # noqa: PLC0415 - show-config and --help answer without importing torch
    from rltrain.runtime.bridge import restart_attempt  # noqa: PLC0415 - show-config and --help answer without importing torch
    from rltrain.runtime.failure import failing_in, how_the_job_failed, name_failure, record_failure  # noqa: PLC0415
    from rltrain.runtime.world import World  # noqa: PLC0415 - show-config and --help answer without importing torch

    # A crash outside Python (a segfault or abort in a library, at exit too) prints every
    # thread's Python stack instead of only an exit code.
    with contextlib.suppress(ValueError, OSError, RuntimeError):  # a stderr without a file descriptor
        faulthandler.enable(all_threads=True)
    # NCCL's cuMem allocations and SGLang's memory saver do not mix, and both ends of an NCCL
    # weight group must agree: off unless the user says otherwise (the engine inherits it).
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    _report_cpus(env)
    if env.rank == 0:
        path = write_resolved_config(cfg, cfg.run_dir)
        log.info("resolved config written to %s", path)
    if cfg.trainer.deterministic:
        import torch  # noqa: PLC0415 - show-config and --help answer without importing torch

        # Read by cuBLAS when its first handle is made (below, after the world), and inherited by
        # the engine process.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        with failing_in(env.rank, "the world's start"):
            world = World.from_config(cfg.world, env)
        last = run(cfg, world, stop)
        with failing_in(env.rank, "the world's close at the end of the run"):
            world.close()
    except ConfigError as e:  # what only the machine shows (the engine layout, its device)
        print(f"rltrain: rank {env.rank}: config error: {e}", file=sys.stderr)
        return 2
    except HistoryError as e:
        if env.rank == 0:
            print(f"rltrain: refusing to start: {e}", file=sys.stderr)
            if restart_attempt() > 0:  # what the attempt before it failed on
                before = how_the_job_failed(cfg.run_dir, env.world_size)
                print(f"rltrain: the attempt before this restart failed: {before}", file=sys.stderr)
        return 2
    except PreviousAttemptFailed as e:
        if env.rank == 0:
            print(f"rltrain: {e}", file=sys.stderr)
        return e.status
    except BaseException as e:
        name_failure(e, env.rank, "the loop")  # unless a part of it named it
        record_failure(cfg.run_dir, env.rank, e)  # for the restart, if there is one
        raise
    if env.rank == 0 and cfg.metrics.plot:
        _write_plots(cfg.run_dir)
    if env.rank == 0 and last:
        log.info("done: step %d, reward %.3f, pass rate %.3f", last["step"], last["reward_mean"], last["pass_rate"])
    return 0


def _write_plots(run_dir: Path) -> None:
    """The run's plots; a failure is a warning: every step is recorded, and the plots can be
    written again from the metrics."""
    from rltrain.plot import write_plots  # noqa: PLC0415 - show-config and --help answer without importing torch

    try:
        for p in write_plots(run_dir):
            log.info("wrote %s", p)
    except Exception as e:  # noqa: BLE001 - said, with the command that writes them again
        log.warning("plots not written (%s: %s); `python -m rltrain.plot %s` writes them", type(e).__name__, e, run_dir)
