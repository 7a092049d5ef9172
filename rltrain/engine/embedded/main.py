"""Start the embedded engine: its command line, the engine, and its HTTP server.

    python -m rltrain.engine.embedded --model-path DIR --port 30000 [--device cuda] [--dtype bfloat16]

The command line takes SGLang's spelling of every flag the two share (sglang 0.5.23,
`srt/server_args.py`), beside this engine's own, so a command line written for one works for the
other: --model, --random-seed, --max-running-requests, --enable-deterministic-inference,
--enable-weights-cpu-backup, --tensor-parallel-size, --expert-parallel-size / --ep,
--base-gpu-id (with --device cuda), --disable-decode-cuda-graph, --cuda-graph-backend-decode,
--weight-version, --api-key, --disable-overlap-schedule, --dtype half / float, --log-level in lower
case; --skip-tokenizer-init and --sleep-on-idle are accepted and change nothing here. Any other
flag is an error.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from rltrain.engine.embedded.engine import EmbeddedEngine
from rltrain.engine.embedded.http import MAX_BODY_BYTES, EngineHTTPServer, make_handler
from rltrain.engine.embedded.server import EmbeddedServer
from rltrain.engine.embedded.split import EngineChild
from rltrain.runtime.net import allow_open_files

log = logging.getLogger("rltrain.engine.embedded")

OPEN_FILES = 65535  # (SGLang raises its limit to the same)
API_KEY_VARIABLE = "RLTRAIN_ENGINE_API_KEY"  # the launcher's way: the key stays off the command line
DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
SGLANG_DTYPES = {"half": "float16", "float": "float32"}  # SGLang's other spellings


def parser() -> argparse.ArgumentParser:
    """The engine's flags; where SGLang has the same flag, its spelling too (module doc)."""
    ap = argparse.ArgumentParser(
        prog="python -m rltrain.engine.embedded",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model-path", "--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    ap.add_argument(
        "--base-gpu-id",
        type=int,
        default=None,
        help="SGLang's: with --device cuda, the engine runs on cuda:<this> (no effect on the CPU)",
    )
    ap.add_argument("--dtype", default="auto", choices=[*DTYPES, *SGLANG_DTYPES])
    ap.add_argument(
        "--max-batch-size", "--max-running-requests", type=int, default=256, help="sequences generated at once"
    )
    ap.add_argument("--seed", "--random-seed", type=int, default=0)
    ap.add_argument(
        "--deterministic",
        "--enable-deterministic-inference",
        action="store_true",
        help="run each request as its own batch, so results do not depend on what else is queued",
    )
    ap.add_argument(
        "--ep-size",
        "--expert-parallel-size",
        "--ep",
        type=int,
        default=1,
        help="expert ownership: this engine holds experts of rank --ep-rank",
    )
    ap.add_argument("--ep-rank", type=int, default=0)
    ap.add_argument(
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="take SGLang's per-TP-rank weight payloads for this many TP ranks (one process, one device; "
        "with --ep-size, experts split over the ranks as SGLang splits them)",
    )
    ap.add_argument("--backup-dir", default=None, help="where released weights are backed up on CPU")
    ap.add_argument(
        "--weights-backup",
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep released weights in host memory and restore them on resume (default: discard them, "
        "as SGLang does without --enable-weights-cpu-backup: garbage until updated)",
    )
    ap.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    ap.add_argument(
        "--weights-root",
        action="append",
        default=[],
        help="load weight versions only from inside this directory (repeatable; none: anywhere)",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=0,
        help="prompt + new tokens per sequence (SGLang's flag; 0: the model config's own)",
    )
    ap.add_argument(
        "--decode",
        default="auto",
        choices=["auto", "paged", "hf"],
        help="paged: paged KV cache, CUDA graphs, continuous batching; hf: transformers' own cache, a batch at "
        "a time; auto: paged on CUDA where the model passes its start-up probe, else hf",
    )
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=0,
        help="tokens in the paged KV cache, at most (0: what --mem-fraction-static gives; on CUDA never more, as "
        "SGLang's flag; on the CPU exactly this many)",
    )
    ap.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.8,
        help="share of the GPU for weights + paged KV cache, as SGLang's flag",
    )
    ap.add_argument(
        "--disable-cuda-graph",
        "--disable-decode-cuda-graph",
        action="store_true",
        help="paged decode without CUDA graphs (only decode steps are captured here)",
    )
    ap.add_argument(
        "--cuda-graph-backend-decode",
        choices=["full", "disabled"],
        default=None,
        help="SGLang's: disabled is --disable-cuda-graph; full (whole decode steps) is what is captured here",
    )
    ap.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="paged decode and prefill with the transformer blocks torch.compiled (as SGLang's flag; compiles at "
        "start-up)",
    )
    ap.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="CUDA: weights, KV cache and graphs' memory through torch_memory_saver (SGLang's flag): released "
        "and resumed at the same addresses, so captured graphs are kept (saver.py)",
    )
    ap.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="the paged path reads each decode step's tokens before queuing the next (SGLang's flag): the host's "
        "per-step work then runs between the device's steps instead of beside them",
    )
    ap.add_argument(
        "--enable-prefill-pieces",
        action="store_true",
        help="the paged path queues a prefill admitted while rows run in pieces between their decode steps, on a "
        "stream of its own, instead of at once with the decode waiting (this engine's own flag: batching.py)",
    )
    ap.add_argument(
        "--enable-prefill-cuda-graph",
        action="store_true",
        help="the paged path's prefills of up to 8,192 new tokens run from static inputs padded to a bucket, "
        "captured as CUDA graphs and replayed (their host cost is ~1 ms per layer queued eagerly; graphs.py). "
        "Default: on with --enable-memory-saver (the graphs kept through releases: every bucket captured once, "
        "at the first prefill), off without it (dropped at every release)",
    )
    ap.add_argument(
        "--disable-prefill-cuda-graph",
        action="store_true",
        help="every prefill queued eagerly, with the memory saver too",
    )
    ap.add_argument(
        "--separate-http-process",
        action="store_true",
        help="HTTP (framing, JSON, the API key) in this process, the engine and its scheduler in a child process, "
        "as SGLang splits its server: the scheduler does not share the interpreter lock with the HTTP handler "
        "threads (split.py)",
    )
    ap.add_argument("--weight-version", default="default", help="the weights' version until an update sets one")
    ap.add_argument(
        "--api-key",
        default="",
        help=f"every endpoint needs 'Authorization: Bearer <key>' (SGLang's flag; {API_KEY_VARIABLE} in the "
        "environment, as the launcher passes it, keeps it off the command line and wins)",
    )
    ap.add_argument("--max-body-mb", type=int, default=MAX_BODY_BYTES >> 20, help="largest request body taken")
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ... (any case)")
    for flag in ("--skip-tokenizer-init", "--sleep-on-idle"):
        ap.add_argument(
            flag,
            action="store_true",
            help="SGLang's; changes nothing here (token ids in and out, no tokenizer; the idle scheduler waits)",
        )
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its flags checked together (an unknown flag: argparse's error, exit 2)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.base_gpu_id is not None and args.device.startswith("cuda:"):
        ap.error(f"--base-gpu-id {args.base_gpu_id} with --device {args.device}: give the device's index once")
    if args.enable_prefill_cuda_graph and args.disable_prefill_cuda_graph:
        ap.error("--enable-prefill-cuda-graph with --disable-prefill-cuda-graph: give one")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`EmbeddedEngine`'s keyword arguments for the parsed command line."""
    device = args.device
    if device == "cuda" and args.base_gpu_id is not None:
        device = f"cuda:{args.base_gpu_id}"
    return {
        "device": device,
        "dtype": SGLANG_DTYPES.get(args.dtype, args.dtype),
        "max_batch_size": args.max_batch_size,
        "seed": args.seed,
        "backup_dir": args.backup_dir,
        "weights_backup": args.weights_backup,
        "deterministic": args.deterministic,
        "ep_size": args.ep_size,
        "ep_rank": args.ep_rank,
        "tp_size": args.tp_size,
        "context_length": args.context_length,
        "decode": args.decode,
        "max_total_tokens": args.max_total_tokens,
        "mem_fraction_static": args.mem_fraction_static,
        "cuda_graphs": not (args.disable_cuda_graph or args.cuda_graph_backend_decode == "disabled"),
        "compile": args.enable_torch_compile,
        "memory_saver": args.enable_memory_saver,
        "weight_version": args.weight_version,
        "overlap": not args.disable_overlap_schedule,
        "prefill_pieces": args.enable_prefill_pieces,
        # (None: with the memory saver)
        "prefill_cuda_graph": True
        if args.enable_prefill_cuda_graph
        else False
        if args.disable_prefill_cuda_graph
        else None,
    }


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent (the rank that launched us) is gone — a second guard next to PDEATHSIG."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            log.error("parent process %d is gone; shutting down", parent_pid)
            os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    faulthandler.enable()  # a crash in native code (CUDA, a driver) leaves its Python stack in the log
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s embedded-engine %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    torch.set_num_threads(max(1, int(os.environ.get("RLTRAIN_ENGINE_THREADS", torch.get_num_threads()))))

    hf_logging.disable_progress_bar()
    allow_open_files(OPEN_FILES)  # a connection each: a multi-turn rollout's trajectories, every rank's
    t0 = time.perf_counter()
    api_key = os.environ.pop(API_KEY_VARIABLE, "") or args.api_key  # every endpoint needs it when set
    options = {"model_path": args.model_path, **engine_options(args)}
    server_options = {"weights_roots": args.weights_root, "api_key": api_key}
    child: EngineChild | None = None
    if args.separate_http_process:
        child = EngineChild.start(options, server_options, args.log_level)
        routes: Any = child
        engine: Any = None
        where = f"{options['device']}, engine process {child.proc.pid}"
    else:
        engine = EmbeddedEngine(**options)
        routes = EmbeddedServer(engine, **server_options)
        where = f"{engine.device}, {engine.dtype}"
    httpd = EngineHTTPServer((args.host, args.port), make_handler(routes, args.max_body_mb << 20))
    exit_code = 0
    if child is not None:

        def engine_gone() -> None:  # (its requests answered 503: the launcher sees the server gone too)
            nonlocal exit_code
            exit_code = 1
            threading.Thread(target=httpd.shutdown, daemon=True).start()

        child.on_death = engine_gone
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Started by rltrain's launcher SIGTERM is ignored (the job's stop signal is for its
        # ranks, which stop this server with SIGINT): kept so.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: threading.Thread(target=httpd.shutdown, daemon=True).start())
    log.info(
        "serving %s on http://%s:%d (%s) after %.1fs",
        args.model_path,
        args.host,
        httpd.server_address[1],
        where,
        time.perf_counter() - t0,
    )
    gc.freeze()  # (the model's and the libraries' objects: no full collection walks them again)
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        if child is not None:
            child.close()
        else:
            engine.shutdown()
        httpd.server_close()
    return exit_code
