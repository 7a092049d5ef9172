"""The memory ledger (rltrain/runtime/ledger.py) on CPU: what it sizes is what the trainer holds.
The device side (trainer, NCCL, engine and context on one GPU, with the unexplained rest) is
tested in test_gpu.py on the H200, and in the quickstart's metrics (test_loop.py)."""

from __future__ import annotations

import torch

from rltrain.runtime.ledger import GIB, MemoryLedger, format_ledger, storage_bytes
from test_trainer import fixed_batch, make_trainer, one_step


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(1000)
    seen: set = set()
    assert storage_bytes([a, a[10:20], a.view(10, 100), None], seen) == {"device": 0, "pinned": 0, "host": 4000}
    assert storage_bytes([a, torch.ones(3, dtype=torch.float64)], seen)["host"] == 24  # a was counted already


def test_the_ledger_sizes_the_trainers_weights_and_optimizer_state(model_a):
    trainer = make_trainer(model_a, micro=4)
    ledger = MemoryLedger(torch.device("cpu"), trainer.held_tensors)
    before = ledger.read()
    weights = sum(t.untyped_storage().nbytes() for t in [*trainer.model.parameters(), *trainer.model.buffers()])
    assert before["trainer_host"] * GIB == weights  # no optimizer state before the first step
    one_step(trainer, fixed_batch())
    state = sum(
        v.untyped_storage().nbytes()
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    assert state > 2 * weights * 0.99  # Adam's two moments (and step counters)
    after = ledger.read()
    assert after["trainer_host"] * GIB == weights + state
    assert after["rss"] > after["trainer_host"]
    table = format_ledger({"rank0": {"train": after}}, step=1)
    assert "trainer_host" in table and "rank0" in table and f"{after['rss']:.3f}" in table
    trainer.release()
    assert ledger.read()["trainer_host"] == 0


def test_reading_the_ledger_keeps_nothing_of_a_released_trainer_alive(model_a):
    """What the ledger reads after every phase must not hold the trainer's modules or tensors:
    a released trainer's model is freed (a cache of its module tree once kept it, and its
    25 MiB, on the H200's device after the release)."""
    import gc
    import weakref

    trainer = make_trainer(model_a, micro=4)
    one_step(trainer, fixed_batch())
    ledger = MemoryLedger(torch.device("cpu"), trainer.held_tensors)
    ledger.read()
    model, first = weakref.ref(trainer.model), weakref.ref(next(iter(trainer.model.parameters())))
    trainer.release()
    ledger.read()
    gc.collect()
    assert model() is None and first() is None
