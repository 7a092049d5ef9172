"""Everything a run needs before its first step, checked before anything expensive starts."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rltrain import history, interfaces
from rltrain.between_steps import BetweenSteps, Residency, TrainerCycle
from rltrain.checkpoint import Checkpointer, CheckpointError, Restored
from rltrain.config import DISTRIBUTED_COLOCATED, Config, ConfigError, EngineConfig
from rltrain.engine.command import check_engine, resolve_backend, resolve_device
from rltrain.engine.launcher import NodeEngine
from rltrain.engine.layout import EngineLayout
from rltrain.engine.pool import pool_tokens
from rltrain.engine.process import EngineCrashed
from rltrain.history import Finished, HistoryError
from rltrain.interfaces import Trainer, World
from rltrain.rollout import synthetic
from rltrain.rollout.data import (
    DataError,
    LazyPrompts,
    Prompt,
    PromptSampler,
    parquet_to_arrow,
    read_records,
    tokenize_records,
)
from rltrain.rollout.evaluation import Evaluator
from rltrain.rollout.rewards import RewardRunner, load_reward
from rltrain.runtime.bridge import restart_attempt
from rltrain.runtime.failure import clear_failures
from rltrain.runtime.ledger import GIB
from rltrain.runtime.stop import clear_marker
from rltrain.sync.calibration import probe_at_start
from rltrain.sync.weight_sync import WeightSync
from rltrain.trainer.fsdp import FSDPTrainer
from rltrain.weights.hf_files import context_length_of

log = logging.getLogger("rltrain.setup")


@dataclass
class RunParts:
    tokenizer: PreTrainedTokenizerBase
    sampler: PromptSampler
    rewards: RewardRunner
    trainer: Trainer
    cycle: TrainerCycle  # the trainer between steps
    engine: interfaces.NodeEngine
    sync: WeightSync
    start_step: int
    initial_version: str | None
    evaluator: Evaluator | None = None  # eval.path's (rollout/evaluation.py)

    def closing(self) -> list[tuple[str, Callable[[], None]]]:
        """What ends the run's parts, in order, each named (the loop runs every one)."""
        return [
            ("the reward workers' close", self.rewards.close),
            ("the weight sync's close", self.sync.close),
            ("the engine's shutdown", self.engine.shutdown),
        ]


def _on_rank0(world: World, what: str, fn: Callable[[], object]) -> None:
    """Run `fn` on rank 0; every rank learns whether it worked (no rank waits on a failed one)."""
    error = None
    if world.rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = f"{what}: {type(e).__name__}: {e}"
    errors = world.bridge.all_gather_object(error, phase=what)
    if errors[0]:
        raise RuntimeError(errors[0])


def check_context(cfg: Config, context: int, model: str) -> int:
    """The model's context length (the engine's --context-length where the config sets one), after
    checking that a response of rollout.max_new_tokens fits in it beside a prompt."""
    args = list(cfg.engine.extra_args)
    if "--context-length" in args[:-1]:
        context = int(args[args.index("--context-length") + 1])
    if cfg.rollout.max_new_tokens >= context:
        raise ConfigError(
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the context of "
            f"{model} ({context} tokens): lower it below {context}"
        )
    return context


def setup_run(cfg: Config, world: World, resume_from: Path | None) -> RunParts:
    """`resume_from`: the checkpoint the run continues from (`where_the_run_begins`), or None."""
    hf_logging.disable_progress_bar()  # one "Writing model shards" bar per weight version is noise
    model_path = Path(cfg.model.path)
    if cfg.model.build != "none":
        words, _, template = synthetic.TASKS["lookup" if cfg.model.build == "tiny-lookup" else "addition"]
        # Every rank joins this collective; only rank 0 looks at the disk. (Each rank checking
        # `exists()` itself raced with rank 0's build: a late rank skipped the collective.)
        _on_rank0(
            world,
            "building the tiny model",
            lambda: (
                model_path.exists()
                or synthetic.build_tiny_model(
                    model_path,
                    words(),
                    hidden=cfg.model.build_hidden,
                    layers=cfg.model.build_layers,
                    seed=cfg.run.seed,
                    experts=4 if cfg.model.build == "tiny-addition-moe" else 0,
                    chat_template=template,
                    qwen3=cfg.model.build == "tiny-lookup",
                )
            ),
        )
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={str(model_path)!r} is not an HF checkpoint directory (no config.json)")
    data_path = cfg.data.path
    if data_path.startswith("synthetic:"):
        task = data_path.removeprefix("synthetic:")
        data_path = str(cfg.run_dir / "data" / f"{task}.jsonl")
        records = synthetic.TASKS[task][1]
        _on_rank0(
            world,
            "writing the synthetic dataset",
            lambda: synthetic.write_jsonl(Path(data_path), records()),
        )

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model_cfg = AutoConfig.from_pretrained(model_path)
    if len(tokenizer) > model_cfg.vocab_size:
        raise ValueError(
            f"tokenizer of {model_path} has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{model_cfg.vocab_size}: tokenizer and model do not match"
        )
    context = check_context(cfg, context_length_of(model_cfg), str(model_path))
    outside = [t for t in cfg.rollout.stop_token_ids if t >= model_cfg.vocab_size]
    if outside:
        raise ConfigError(
            f"rollout.stop_token_ids {outside[:5]} are outside the model's vocabulary of {model_cfg.vocab_size}"
        )
    prompts = _prompts(cfg, world, data_path, tokenizer, context)
    if cfg.data.prompts_per_step % world.world_size:
        raise ValueError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the {world.world_size} ranks"
        )
    sampler = PromptSampler(prompts, cfg.data.prompts_per_step, cfg.run.seed)
    eval_prompts = _eval_prompts(cfg, world, tokenizer, context) if cfg.eval.path else None
    rewards = RewardRunner(
        load_reward(cfg.reward.function, cfg.reward.format_regex), cfg.reward.timeout_s, cfg.reward.workers
    )

    check_placement(cfg, world)
    trainer = _trainer(cfg, world, str(model_path), tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    # On GPUs the engines start first, on devices nothing else holds yet: SGLang sizes its KV pool
    # from the free memory it sees at start-up, and the engine and the trainer at once could need
    # more than the device has; colocated, the engines then let go of their memory for the
    # trainer. On the CPU the trainer is built while the engines start (mostly their imports).
    # The embedded engine loads weight versions only from the sync directory (and its own model).
    overlap = resolve_device(cfg.engine.device) == "cpu"

    def create_trainer() -> None:
        trainer.create()
        log.info("trainer created (%s), %s the engines start", cfg.trainer.backend, "while" if overlap else "after")

    engine = NodeEngine.launch(
        engine_config(cfg),
        cfg.engine_model_path,
        world,
        cfg.run_dir,
        weights_roots=[str(cfg.weights_dir)],
        colocate=cfg.loop.colocate,
        vocab_size=model_cfg.vocab_size,
        meanwhile=create_trainer if overlap else None,
        pool=lambda layout: pool_tokens(cfg, layout, world.world_size),
    )
    # The engines serve model.path as each loaded it: what the sync's probe is calibrated against.
    start = probe_at_start(cfg, world, [engine.client], engine.layout, prompts[0].input_ids)
    engine.release_memory()
    if not overlap:
        create_trainer()
    sync = WeightSync(  # before a checkpoint is loaded: the trainer holds model.path's weights too
        cfg,
        world,
        trainer,
        [engine.client],
        cfg.engine_model_path,
        engine.layout,
        awake=not engine.releases,
        start=start,
        alive=lambda: engine_alive(engine),
    )
    checkpointer = Checkpointer(checkpoint_dir(cfg), world, cfg.checkpoint.keep_last)
    restored = _resume(cfg, checkpointer, trainer, sampler, resume_from)
    cycle = TrainerCycle(
        trainer,
        checkpointer,
        BetweenSteps.of(cfg),
        cfg.loop.colocate,
        cfg.checkpoint.interval,
        (cfg.loop.steps, cfg.loop.stop_after),
        residency(cfg),
    )
    if restored is not None:
        cycle.saved, cycle.saved_step = restored.path, restored.step

    if world.rank == 0:  # what each phase switch does here, decided from the config and the machine
        log.info(
            "phase switches: world: %s; engines: %s; sync.transport=%s%s; sync probe: %s; old log-probs: %s",
            "torn down and rebuilt" if world.reload else f"stays up ({world.backend}: nothing to free)",
            "release their memory" if engine.releases else "keep their memory",
            cfg.sync.transport,
            f": {cfg.sync_transport}" if cfg.sync.transport == "auto" else "",
            sync.checks.probe.value
            + (", the trainer's side in the next training step's first micro-batch" if sync.rides else ""),
            "from the training forward" if cfg.algo.old_logp_from_training else "a separate pass",
        )
    initial = None
    if restored is not None:
        # The engine starts from model.path; give it the restored weights under their version.
        assert restored.version is not None, "a checkpoint records the weight version it was saved at"
        initial = restored.version
    elif engine.releases:
        initial = INITIAL_VERSION  # released without a backup: the engine's weights are gone
    if initial is not None:
        engine.resume_weights()
        # Verified like every step's; where a training step follows, its probe rides that step
        # as every step's sync does (a resumed run's steps then run the forwards an uninterrupted
        # run's would: the same rows in the same micro-batches, the same numerics).
        first_step = restored.step if restored is not None else 0
        sync.push(initial, ride=first_step < history.last_step(cfg))
    initial = engine.weight_version()
    log.info(
        "engine %s serves weight version %s; %d prompts, %d per step",
        engine.url,
        initial,
        len(prompts),
        cfg.data.prompts_per_step,
    )
    start_step = restored.step if restored else 0
    evaluator = None
    if eval_prompts is not None:
        evaluator = Evaluator(cfg, world, eval_prompts, tokenizer, rewards, start_step)
    return RunParts(tokenizer, sampler, rewards, trainer, cycle, engine, sync, start_step, initial, evaluator)


def _prompts(cfg: Config, world: World, path: str, tokenizer: PreTrainedTokenizerBase, context: int) -> LazyPrompts:
    """The training prompts (rollout/data.py): a parquet file converted once by rank 0 into the
    memory-mapped copy every rank reads; every prompt checked up front, each rank tokenising its
    share, and a problem anywhere raised on every rank (the first record's)."""
    cache = cfg.run_dir / "data" / "cache"
    if path.endswith(".parquet") and Path(path).is_file():
        _on_rank0(world, f"converting {path} to Arrow", lambda: parquet_to_arrow(Path(path), cache))
    prompts = LazyPrompts(
        read_records(path, cfg.data.fields, cache),
        tokenizer,
        cfg.data.chat_template,
        cfg.data.max_prompt_tokens,
        source=path,
        context=(context, cfg.rollout.max_new_tokens),
        template_kwargs=cfg.data.chat_template_kwargs,
    )
    found = [
        p
        for p in world.bridge.all_gather_object(
            prompts.check(world.rank, world.world_size), phase="checking the prompts"
        )
        if p
    ]
    if found:
        raise DataError(min(found)[1])
    return prompts


def _eval_prompts(cfg: Config, world: World, tokenizer: PreTrainedTokenizerBase, context: int) -> list[Prompt]:
    """eval.path's prompts, tokenised and checked as the training prompts are (before any
    expensive work); synthetic:addition is written into the run directory first."""
    path = cfg.eval.path
    if path == "synthetic:addition":
        path = str(cfg.run_dir / "data" / "eval-addition.jsonl")
        _on_rank0(
            world,
            "writing the synthetic evaluation set",
            lambda: synthetic.write_jsonl(Path(path), synthetic.addition_records()),
        )
    records = read_records(path, cfg.data.fields)
    return tokenize_records(
        records[: cfg.eval.max_prompts] if cfg.eval.max_prompts else records,
        tokenizer,
        cfg.data.chat_template,
        cfg.data.max_prompt_tokens,
        source=path,
        context=(context, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens),
        template_kwargs=cfg.data.chat_template_kwargs,
    )


def residency(cfg: Config) -> Residency | None:
    """What the trainer may keep on the device while the engines roll out: fit, a measured part;
    auto with the fsdp backend, its whole state where the last rollout left room for it (the
    engines' KV pool sized to the rollout: engine.max_total_tokens), else none of it."""
    headroom = int(cfg.loop.offload_headroom_gib * GIB)
    if cfg.loop.offload_trainer == "fit":
        return Residency(headroom)
    if cfg.loop.offload_trainer == "auto" and cfg.trainer.backend == "fsdp":
        return Residency(headroom, whole=True)
    return None


def engine_config(cfg: Config) -> EngineConfig:
    """`cfg.engine` with what depends on the rest of the run decided: the embedded engine's HTTP
    in a process of its own where `separate_http_process` is auto and the rollout is multi-turn on
    GPUs (its requests then come and go every turn, hundreds at once)."""
    split = cfg.engine.embedded.separate_http_process
    if split != "auto":
        return cfg.engine
    split = cfg.rollout.multi_turn and resolve_device(cfg.engine.device) == "cuda"
    embedded = dataclasses.replace(cfg.engine.embedded, separate_http_process=split)
    return dataclasses.replace(cfg.engine, embedded=embedded)


def engine_alive(engine: NodeEngine) -> bool:
    """Whether this rank's engine process still runs (True on a rank that does not own it)."""
    try:
        engine.check_alive()
    except EngineCrashed:
        return False
    return True


INITIAL_VERSION = "0"  # the trainer's weights before its first step, when the setup sends them


def check_placement(cfg: Config, world: World) -> None:
    """What the config asks of the engines that cannot work where they run (ConfigError), before
    anything starts: the engines' layout over the node's GPUs included."""
    check_engine(cfg.engine, cfg.rollout.seeded)
    device = resolve_device(cfg.engine.device)
    if cfg.sync_transport == "distributed" and device == "cuda" and not cfg.engine.gpus:
        raise ConfigError(DISTRIBUTED_COLOCATED)
    visible = torch.cuda.device_count() if device == "cuda" else None
    layout = EngineLayout.of(cfg.engine, resolve_backend(cfg.engine.backend), world.env, visible)
    if layout.apart and layout.gpus_per_engine > 1 and cfg.sync_transport == "tensor":
        raise ConfigError(
            f"sync.transport=tensor to engines of {layout.gpus_per_engine} GPUs of their own (engine.gpus="
            f"{cfg.engine.gpus}): a tensor sync hands each TP rank its payload from the trainer rank on that TP "
            "rank's GPU, and no trainer rank is on an engine's GPUs; use sync.transport=distributed (NCCL "
            "broadcast to the engine's ranks) or disk, or engine.gpus_per_engine=1"
        )


def _trainer(cfg: Config, world: World, model_path: str, pad_id: int) -> Trainer:
    if cfg.trainer.backend == "megatron":
        from rltrain.trainer.megatron.trainer import MegatronTrainer  # noqa: PLC0415 - megatron-core is optional

        return MegatronTrainer(
            cfg.trainer,
            cfg.algo,
            model_path,
            world.device,
            world,
            seed=cfg.run.seed,
            total_steps=cfg.loop.steps,
            temperature=cfg.rollout.temperature,
            pad_id=pad_id,
        )
    return FSDPTrainer(
        cfg.trainer,
        cfg.algo,
        model_path,
        world.device,
        seed=cfg.run.seed,
        total_steps=cfg.loop.steps,
        temperature=cfg.rollout.temperature,
        pad_id=pad_id,
    )


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else cfg.run_dir / "checkpoints"


def where_the_run_begins(cfg: Config, world: World) -> Path | Finished | None:
    """Before anything starts, rank 0 reads the run directory's history (history.begin) and every
    rank takes its answer: all must load the same checkpoint, and a refusal stops every rank with
    the same message. A job's first attempt clears the failure records of earlier jobs; a
    restart keeps them until it records a step (the loop): it may have nothing to run, or be
    refused, and then reports them."""
    choice: Path | Finished | str | None = None
    if world.rank == 0:
        try:
            choice = history.begin(cfg, checkpoint_dir(cfg))
        except HistoryError as e:
            choice = str(e)
        if not isinstance(choice, str):
            clear_marker(cfg.run_dir)  # this job runs: no longer the one that stopped
        if restart_attempt() == 0:
            clear_failures(cfg.run_dir)
    choice = world.bridge.broadcast_object(choice, src=0, phase="where the run begins")
    if isinstance(choice, str):
        raise HistoryError(choice)
    return choice


def _resume(
    cfg: Config, checkpointer: Checkpointer, trainer: Trainer, sampler: PromptSampler, found: Path | None
) -> Restored | None:
    """checkpoint.resume: auto (`found`: newest complete, corrupt ones skipped), none, or a directory."""
    mode = cfg.checkpoint.resume
    if mode in ("none", "auto"):
        path = found
        if path is None:
            return None
    else:
        path = Path(mode)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume={mode!r} is not a checkpoint directory")
    restored = checkpointer.load(path, trainer)
    sampler.load_state_dict(restored.extra["sampler"])
    log.info("resumed from %s: step %d, weight version %s", path, restored.step, restored.version)
    return restored
