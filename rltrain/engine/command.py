"""What starts the configured engine: its backend and device resolved, what it cannot do refused,
its server's command line and the environment that server adds to its rank's.

Nothing is started here: `engine/process.py` runs the command, `engine/launcher.py` decides which
rank does. `auto` resolves to SGLang where it is installed and a GPU is present, else the embedded
engine; the embedded engine's keys (`engine.embedded.*`) reach it as flags, and its API key through
its environment, off its command line. Each engine gets its own random seed (`engine_seed`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import torch

from rltrain.config import ConfigError, EngineConfig
from rltrain.engine.embedded import saver
from rltrain.engine.layout import EngineLayout

log = logging.getLogger("rltrain.engine")


def resolve_device(device: str) -> str:
    return device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_backend(backend: str) -> str:
    """auto: SGLang where it is installed and a GPU is present, else the embedded engine."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available():
        try:
            if importlib.util.find_spec("sglang") is not None:
                return "sglang"
        except (ImportError, ValueError):
            pass
    return "embedded"


def memory_saver_on(cfg: EngineConfig) -> bool:
    """Whether the embedded engine runs with its memory saver (engine/embedded/saver.py):
    engine.embedded.memory_saver, auto resolved (on CUDA where torch_memory_saver is installed)."""
    if resolve_backend(cfg.backend) != "embedded" or resolve_device(cfg.device) == "cpu":
        return False
    return cfg.embedded.memory_saver is True or (cfg.embedded.memory_saver == "auto" and saver.installed())


API_KEY_VARIABLE = "RLTRAIN_ENGINE_API_KEY"  # the embedded engine reads its API key here


def check_engine(cfg: EngineConfig, seeded: bool) -> None:
    """What the resolved engine cannot do, refused (or said) before it starts."""
    backend, device = resolve_backend(cfg.backend), resolve_device(cfg.device)
    if backend == "sglang" and device == "cpu" and cfg.deterministic:
        raise ConfigError(
            "engine.deterministic=true: SGLang on CPU cannot be deterministic (it refuses "
            "--enable-deterministic-inference with the torch_native attention it runs on CPU); set "
            "engine.deterministic=false (rollouts are then not repeatable), or use the embedded engine "
            "(engine.backend=embedded), which is deterministic everywhere"
        )
    if cfg.embedded.memory_saver is True and backend == "embedded":
        if device != "cuda":
            raise ConfigError(
                "engine.embedded.memory_saver=true: the embedded engine's memory saver is CUDA-only (the engine "
                f"runs on {device}); set engine.embedded.memory_saver=auto"
            )
        if not saver.installed():
            raise ConfigError(
                "engine.embedded.memory_saver=true: torch_memory_saver is not installed (pip install "
                "torch_memory_saver), or set engine.embedded.memory_saver=auto"
            )
    if backend == "sglang" and seeded and not cfg.deterministic:
        log.warning(
            "rollout.seeded=true but SGLang honours sampling seeds only with --enable-deterministic-inference "
            "(engine.deterministic=true): every sample still gets its own seed, but rollouts will not repeat"
        )


# SGLang's flag for HiCache (a host-memory tier under the KV cache), in both its spellings.
HOST_CACHE_FLAGS = ("--enable-hierarchical-cache", "--enable-hicache")


def refuse_host_cache(extra_args: list[str]) -> None:
    """SGLang's HiCache where the engine's memory is released for a colocated trainer (ConfigError).
    SGLang 0.5.23 releases only what its memory saver holds (/release_memory_occupation's tags:
    weights, kv_cache, cuda_graph); HiCache's host pool is pinned host memory allocated beside
    it, which no tag releases, so it would stay allocated through every training phase."""
    flags = [a for a in extra_args if a.split("=", 1)[0] in HOST_CACHE_FLAGS]
    if flags:
        raise ConfigError(
            f"engine.extra_args has {flags[0]} (SGLang's HiCache) while the engine's memory is released for a "
            "colocated trainer (loop.colocate=true, engine.release on): SGLang releases its weights, KV cache and "
            "CUDA graphs, never HiCache's host pool, which would stay allocated through training. Drop the flag, "
            "or keep the engine's memory (engine.release=false), or run the engines apart (loop.colocate=false)"
        )


def engine_seed(seed: int, layout: EngineLayout | None) -> int:
    """The random seed of `layout`'s engine: engine.seed plus the engine's place among all the
    job's engines (node by node), so that no two engines draw the same random numbers."""
    if layout is None:
        return seed
    return seed + layout.node_rank * layout.engines_per_node + layout.engine


def _program(module: str, model_path: str, host: str, port: int) -> list[str]:
    """The start of either server's command line (both take these flags, spelled so)."""
    return [sys.executable, "-m", module, "--model-path", model_path, "--host", host, "--port", str(port)]


def server_command(
    cfg: EngineConfig,
    model_path: str,
    port: int,
    host: str = "127.0.0.1",
    weights_roots: list[str] | tuple[str, ...] = (),
    layout: EngineLayout | None = None,
) -> list[str]:
    """The command line that starts the configured engine server (config: `EngineConfig`) for
    `layout`'s engine (None: one engine on the first device). `weights_roots`: the only
    directories the embedded engine loads weight versions from (besides its own model); SGLang
    loads any path it is given."""
    backend = resolve_backend(cfg.backend)
    device = resolve_device(cfg.device)
    tp_size, base_gpu = (layout.gpus_per_engine, layout.base_gpu_id) if layout is not None else (1, 0)
    if backend == "embedded":
        cmd = [
            *_program("rltrain.engine.embedded", model_path, host, port),
            "--device",
            device if device == "cpu" else f"cuda:{base_gpu}",
            "--dtype",
            cfg.dtype,
            "--seed",
            str(engine_seed(cfg.seed, layout)),
            "--max-batch-size",
            str(cfg.embedded.max_batch_size),
            "--parent-pid",
            str(os.getpid()),
        ]
        if device != "cpu":  # the paged KV cache's share of the GPU, as SGLang's
            cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
            if cfg.embedded.compile:
                cmd.append("--enable-torch-compile")
            if memory_saver_on(cfg):
                cmd.append(saver.FLAG)
        cmd += _max_total_tokens(cfg)
        if cfg.embedded.separate_http_process is True:  # (auto: resolved by setup.engine_config; else off)
            cmd.append("--separate-http-process")
        if tp_size > 1:  # SGLang's per-TP-rank payloads, received in one process (engine/embedded/receiver.py)
            cmd += ["--tp-size", str(tp_size)]
        if cfg.deterministic:
            cmd.append("--deterministic")
        if cfg.weights_backup:
            cmd.append("--weights-backup")
        for root in weights_roots:
            cmd += ["--weights-root", str(root)]
    elif backend == "sglang":
        cmd = [
            *_program("sglang.launch_server", model_path, host, port),
            "--tp-size",
            str(tp_size),
            "--mem-fraction-static",
            str(cfg.mem_fraction_static),
            "--skip-tokenizer-init",
            "--random-seed",
            str(engine_seed(cfg.seed, layout)),
            "--dtype",
            cfg.dtype,
            # The engine idles through every training phase; without this its scheduler spins a
            # whole CPU core the whole time.
            "--sleep-on-idle",
            *_max_total_tokens(cfg),
        ]
        if device == "cuda":
            cmd += ["--base-gpu-id", str(base_gpu), "--enable-memory-saver"]
            if cfg.weights_backup:
                cmd.append("--enable-weights-cpu-backup")
        else:
            # What runs on CPU (docs/engines.md): torch-native attention, no CUDA graphs.
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        if cfg.deterministic:
            cmd.append("--enable-deterministic-inference")
        if cfg.api_key:
            cmd += ["--api-key", cfg.api_key]
    else:
        raise ValueError(f"engine.backend={cfg.backend!r}: expected auto, embedded or sglang")
    return cmd + list(cfg.extra_args)


def _max_total_tokens(cfg: EngineConfig) -> list[str]:
    """--max-total-tokens where engine.max_total_tokens holds a count (`engine.pool.pool_tokens`
    resolves auto to one before the engines start; left auto here, the engine's own default)."""
    tokens = cfg.max_total_tokens
    return ["--max-total-tokens", str(tokens)] if tokens != "auto" and tokens > 0 else []


def secret_environment(cfg: EngineConfig) -> dict[str, str]:
    """What the engine server gets through its environment rather than its command line."""
    return {API_KEY_VARIABLE: cfg.api_key} if cfg.api_key else {}


# The memory saver (SGLang's, and the embedded engine's) does not support expandable segments:
# the trainer's allocator settings stay with the trainer.
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def server_environment(cfg: EngineConfig, layout: EngineLayout | None = None) -> dict[str, str | None]:
    """What the engine server's environment adds to (or, as None values, drops from) this process's."""
    env: dict[str, str | None] = dict(secret_environment(cfg))
    # Inherited as the trainer has it (cli sets 0 by default): both ends of an NCCL weight group
    # must agree on cuMem, and SGLang's memory saver wants it off.
    env["NCCL_CUMEM_ENABLE"] = os.environ.get("NCCL_CUMEM_ENABLE", "0")
    sglang = resolve_backend(cfg.backend) == "sglang"
    if sglang or memory_saver_on(cfg):
        env.update(dict.fromkeys(ALLOCATOR_VARIABLES))
    if sglang:
        on_cpu = resolve_device(cfg.device) == "cpu"
        if on_cpu and layout is not None and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = layout.cpu_binding()
    return env
