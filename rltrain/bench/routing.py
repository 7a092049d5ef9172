"""Benchmark: bytes each engine TP rank receives per weight sync, with and without expert routing.

    python -m rltrain.bench.routing                      # CPU: EP 2, 4, 8 at 1/16 of the width (~240 MB)
    python -m rltrain.bench.routing --eps 2 --width 8    # wider, fewer EP sizes

A Qwen3-30B-A3B-shaped MoE (128 experts, top 8, every layer sparse) at 1/`width` of its width
in every dimension (hidden, expert and attention sizes, vocabulary), so dense, expert and
embedding weights keep the real model's shares of the bytes. Per EP size `ep`: `ep` trainer
ranks (real processes, FSDP2 over a gloo world) and one embedded engine laid out as SGLang lays
out `--tp-size ep --ep-size ep` (its TP ranks take SGLang's per-rank payloads; engine/embedded).
The loop's own `WeightSync` pushes a version by `sync.transport=tensor` (one warm-up, then timed),
verified as in the loop (each TP rank's checksum, the version). Reported per TP rank:

    engine    bytes the engine counted in that rank's payloads (what it actually received)
    senders   bytes the trainer rank building that payload put in it
    plan      what the sync plan says the rank gets (dense + its EP rank's experts)
    unrouted  the same engine with --ep-size 1: every rank gets every expert (measured)

and the push's seconds both ways. The limit is the plan's bytes (nothing smaller carries every
weight a rank needs), and the time to copy them once at the memory-copy rate measured in the
same run (`bench.sync.raw_copy_gbps`). The whole model's plan at full width is printed by
`python -m rltrain.bench.sync` (its routing table).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from rltrain.bench.models import QWEN3_30B_A3B, MoeShape


def narrowed(width: int, layers: int) -> MoeShape:
    """Qwen3-30B-A3B at 1/`width` of its width in every dimension, with `layers` layers."""
    full = QWEN3_30B_A3B
    assert full.head_dim is not None
    return replace(
        full,
        vocab=full.vocab // width,
        hidden=full.hidden // width,
        intermediate=full.intermediate // width,
        expert_intermediate=full.expert_intermediate // width,
        layers=layers,
        head_dim=max(2, full.head_dim // width),
        max_positions=512,
    )


def build(path: Path, width: int, layers: int) -> Path:
    import transformers

    shape = narrowed(width, layers)
    cfg = transformers.Qwen3MoeConfig(
        **shape.config_kwargs(), decoder_sparse_step=1, mlp_only_layers=[], eos_token_id=shape.vocab - 1
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]  # (transformers' .to: bench.models.save_random_qwen2 says why)
    model.save_pretrained(path)
    return path


def _rank(rank: int, ep: int, port: int, model: str, url: str, repeats: int, out: str) -> None:
    from rltrain.runtime.env import single_node_variables

    os.environ.update(single_node_variables(rank, ep, port))
    torch.set_num_threads(1)
    import pickle

    from rltrain.config import AlgoConfig, EngineConfig, TrainerConfig, load_config
    from rltrain.engine.client import EngineClient
    from rltrain.engine.layout import EngineLayout
    from rltrain.runtime.world import World
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer

    world = World(backend="gloo", timeout=600)
    cfg = load_config(
        None,
        [f"model.path={model}", "data.path=synthetic:addition", "sync.transport=tensor", "sync.probe_tokens=0"],
    )
    client = EngineClient(url, request_timeout_s=600)
    trainer = FSDPTrainer(TrainerConfig(dtype="bfloat16"), AlgoConfig(), model, torch.device("cpu"))
    trainer.create()
    layout = EngineLayout.of(EngineConfig(backend="embedded", gpus_per_engine=ep), "embedded", world.env, None)
    sync = WeightSync(cfg, world, trainer, [client], model, engine=layout)
    seconds = []
    for i in range(repeats + 1):
        world.bridge.barrier(phase="bench push")
        t0 = time.perf_counter()
        sync.push(f"v{i}")
        if i:
            seconds.append(time.perf_counter() - t0)
    result: dict[str, Any] = {
        "routed": sync.plan.routed,
        "reason": sync.plan.fallback_reason,
        "sent": dict(getattr(sync.transport, "rank_bytes", {})),
        "plan": [sync.plan.rank_bytes(k) for k in range(ep)],
        "full": sum(w.nbytes for w in sync.plan.weights),
        "seconds": min(seconds),
    }
    sync.close()
    client.close()
    world.close()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)


def measure(model: Path, ep: int, routed: bool, repeats: int, log_dir: Path) -> dict[str, Any]:
    """One engine over `ep` TP ranks (experts split over them, or not), `ep` trainer ranks."""
    import pickle

    from rltrain.config import EngineConfig
    from rltrain.engine.client import EngineClient
    from rltrain.engine.command import server_command
    from rltrain.engine.layout import EngineLayout
    from rltrain.engine.process import EngineProcess
    from rltrain.runtime.env import DistEnv
    from rltrain.runtime.net import free_port

    cfg = EngineConfig(backend="embedded", device="cpu", dtype="bfloat16", gpus_per_engine=ep, startup_timeout_s=600)
    cfg.extra_args = ["--ep-size", str(ep)] if routed else []
    layout = EngineLayout.of(cfg, "embedded", DistEnv(0, ep, 0, ep, 0, None, None, False), None)
    port = free_port()
    proc = EngineProcess.start(
        server_command(cfg, str(model), port, layout=layout),
        f"http://127.0.0.1:{port}",
        log_dir / f"engine-ep{ep}-{'routed' if routed else 'full'}.log",
    )
    client = EngineClient(proc.url, request_timeout_s=600)
    try:
        client.wait_healthy(600, alive=lambda: proc.alive)
        with tempfile.TemporaryDirectory() as out:
            ctx = mp.get_context("spawn")
            world_port = free_port()
            ranks = [
                ctx.Process(target=_rank, args=(r, ep, world_port, str(model), proc.url, repeats, out))
                for r in range(ep)
            ]
            for p in ranks:
                p.start()
            # Poll the pids, not join(): join waits on a pipe that torch's shared-memory manager
            # (CPU tensor handles) keeps open after the rank exited.
            end = time.monotonic() + 1800
            while any(p.is_alive() for p in ranks) and time.monotonic() < end:
                time.sleep(0.05)
            for p in ranks:
                if p.is_alive():
                    p.kill()
                    p.join()
            if any(p.exitcode != 0 for p in ranks):
                raise RuntimeError(f"a trainer rank failed at ep {ep}: exit codes {[p.exitcode for p in ranks]}")
            result = pickle.loads(Path(out, "rank0.pkl").read_bytes())
        engine = client.weights_checksum()["ranks"]
        # The engine counted every push: warm-up and timed ones alike.
        result["engine"] = [e["bytes_loaded"] // (repeats + 1) for e in engine]
        return result
    finally:
        client.close()
        proc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", default="2,4,8", help="EP sizes (each: one engine over that many TP ranks)")
    ap.add_argument("--width", type=int, default=16, help="1/width of Qwen3-30B-A3B's width in every dimension")
    ap.add_argument("--layers", type=int, default=48, help="layers (as the real model; fewer: embeddings weigh more)")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    from rltrain.bench.sync import raw_copy_gbps

    eps = [int(x) for x in a.eps.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build(root / "moe", a.width, a.layers)
        for ep in eps:
            routed = measure(model, ep, True, a.repeats, root)
            if not routed["routed"]:
                raise RuntimeError(f"ep {ep}: the sync did not route: {routed['reason']}")
            full = measure(model, ep, False, a.repeats, root)
            rows.append((ep, routed, full))
        gbps = raw_copy_gbps(max(r["plan"][0] for _, r, _ in rows), torch.device("cpu"))
    shape = narrowed(a.width, a.layers)
    print(
        f"Qwen3-30B-A3B shape at 1/{a.width} width ({shape.hidden} hidden, {shape.experts} experts of "
        f"{shape.expert_intermediate}, top {shape.experts_per_token}, vocab {shape.vocab}), {a.layers} layers, bf16; "
        "whole model "
        f"{rows[0][1]['full'] / 1e6:.1f} MB; memory copy {gbps:.1f} GB/s (this machine, this run)"
    )
    print("per engine TP rank, MB per sync (engine: counted by the engine; senders: by the trainer rank; plan)")
    print(
        f"{'ep':>3s} {'engine':>8s} {'senders':>8s} {'plan':>8s} {'unrouted':>9s} {'saved':>6s} "
        f"{'routed s':>9s} {'unrouted s':>10s} {'copy floor s':>12s}"
    )
    for ep, r, f in rows:
        if not r["engine"] == [r["sent"][k] for k in range(ep)] == r["plan"]:
            raise RuntimeError(f"ep {ep}: engine {r['engine']}, senders {r['sent']}, plan {r['plan']} disagree")
        mb = r["engine"][0] / 1e6
        floor = max(r["plan"]) / (gbps * 1e9)
        print(
            f"{ep:>3d} {mb:8.2f} {r['sent'][0] / 1e6:8.2f} {r['plan'][0] / 1e6:8.2f} {f['engine'][0] / 1e6:9.2f} "
            f"{1 - r['engine'][0] / f['engine'][0]:6.0%} {r['seconds']:9.3f} {f['seconds']:10.3f} {floor:12.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
