"""bench.sync's measurements of a verified sync's parts (`python -m rltrain.bench.sync
--verify-parts`, and the probe's ride in every run): each part timed alone against the engine
that holds the last version, the probe's forward without FSDP (eager and from a CUDA graph),
and what riding the next training step costs the trainer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rltrain.engine.client import EngineClient
    from rltrain.sync.weight_sync import WeightSync
    from rltrain.trainer.fsdp import FSDPTrainer


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: torch.device, after: Callable[[], object] | None = None) -> float:
    """The median of 5 timed calls of `fn`, the device synchronised around each; `after` runs
    untimed after each."""
    runs = []
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        runs.append(time.perf_counter() - t0)
        if after is not None:
            after()
    return statistics.median(runs)


def verification_alone(ws: WeightSync, trainer: FSDPTrainer, client: EngineClient, device: torch.device) -> None:
    """Each part of a verified push's checks timed alone (median of 5, the device synchronised
    around each), against the engine that holds the last version: where the time goes."""
    from rltrain.weights.checksum import Entry, combine, entries, entry

    def timed(fn: Callable[[], object]) -> float:
        return median_seconds(fn, device)

    probe = ws.probe or list(range(1, 34))
    weights = list(trainer.export_weights())
    one_by_one: dict[str, Entry] = {n: entry(t) for n, t in weights}  # (warms both paths' kernels)
    assert combine(one_by_one) == combine(dict(entries(weights))), "the one-launch checksums differ"
    parts = {
        "trainer: probe forward": timed(lambda: ws._trainer_probe(probe)),
        "trainer: probe forward, gathered": timed(lambda: _gathered(trainer, lambda: ws._trainer_probe(probe))),
        "trainer: every weight exported": timed(lambda: sum(1 for _ in trainer.export_weights())),
        "trainer: checksums, a launch per weight": timed(lambda: combine({n: entry(t) for n, t in weights})),
        "trainer: checksums, one launch": timed(lambda: combine(dict(entries(weights)))),
        "engine: probe scored (POST /generate)": timed(lambda: client.score(probe)),
        "engine: checksum report (GET /weights_checksum)": timed(client.weights_checksum),
        "engine: a round trip (GET /health)": timed(client.health),
    }
    if device.type == "cuda":
        parts.update(_probe_floor(trainer.model_path, probe, device, timed))
    print("verification's parts alone, median of 5: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in parts.items()))
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ws._trainer_probe(probe)
            synchronize(device)
        print("the trainer's probe forward, by self CPU time:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def ride_cost(
    trainer: FSDPTrainer, probe: list[int], device: torch.device, rows: int, length: int
) -> tuple[float, float]:
    """Seconds of a training micro-batch's forward and backward (`rows` x `length` random
    tokens), alone and with the probe as one more row (`rl_update.forward_with_probe`): what
    riding the next step costs the trainer. Medians of 9 runs each, alternated, gradients dropped after each."""

    from rltrain.batch import TrainBatch
    from rltrain.trainer import rl_update

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, trainer._hf_config.vocab_size, (rows, length), generator=g)
    mb = TrainBatch(tokens, torch.ones_like(tokens), torch.ones(rows, length)).to(device)
    model = trainer._live_model()
    model.train()

    def plain() -> None:
        logp, _ = trainer.forward_logp(model, mb, with_entropy=True)
        logp.sum().backward()

    def ridden() -> None:
        logp, _, _ = rl_update.forward_with_probe(trainer, model, mb, probe)
        logp.sum().backward()

    runs: dict[Callable[[], None], list[float]] = {plain: [], ridden: []}
    for i in range(2 + 2 * 9):  # alternated, so that drift (clocks, heat) falls on both; two warm up
        fn = (plain, ridden)[i % 2]
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i >= 2:
            runs[fn].append(time.perf_counter() - t0)
        trainer.zero_grad()
    return statistics.median(runs[plain]), statistics.median(runs[ridden])


def _probe_floor(
    path: str, probe: list[int], device: torch.device, timed: Callable[[Callable[[], object]], float]
) -> dict[str, float]:
    """The probe's forward without FSDP (the model as transformers builds it, the engine's
    scoring path): eager, and replayed from a CUDA graph captured once (its floor)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.to(device)  # type: ignore[arg-type]  # (transformers' .to: bench.models.save_random_qwen2 says why)
    model.eval()
    ids = torch.tensor([probe], device=device)

    @torch.no_grad()
    def forward() -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    out = {"plain model: probe forward, eager": timed(forward)}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        out["plain model: probe forward, CUDA graph"] = timed(graph.replay)
    except Exception as e:  # noqa: BLE001 - what a capture of transformers' forward meets, reported
        print(f"the probe's forward could not be captured in a CUDA graph: {type(e).__name__}: {e}")
    return out


def _gathered(trainer: FSDPTrainer, fn: Callable[[], object]) -> None:
    with trainer.gathered():
        fn()
