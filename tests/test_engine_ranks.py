"""An engine over several ranks: its leader in step with the others, and the engine it started
checked against the layout it was started for.

The engine's leader maps and unmaps memory on every GPU of its engine. Its resume of the KV
cache and CUDA graphs must wait until every rank of the engine has put its trainer away (and
finished its NCCL teardown); a rank must not bring its trainer back before the engine has let go
of its GPU. A test-only delay (tests/faults: RLTRAIN_TEST_ENGINE_ORDER) makes the non-leader's
put-away and the leader's release slow, and the times each rank recorded show who waited for
whom: with the embedded engine laid out over two ranks, and with real SGLang at --tp-size 2 (on
CPU SGLang frees nothing when asked to release, so a second test-only switch makes the ranks ask
it anyway: the order of the requests is what is tested). world.reload=false (the CPU's default):
nothing else synchronises the ranks between the release and the trainer's return.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import HAVE_SGLANG, SGLANG_CPU_MEM_FRACTION, SGLANG_SHIM, SKIP_SGLANG, engine_config
from multiproc import run_ranks
from rltrain.config import ConfigError
from rltrain.engine.layout import EngineLayout
from test_loop import run_quickstart

HERE = Path(__file__).resolve().parent
DELAY_S = 2.0  # the non-leader's put-away and the leader's release, made this much slower


def _events(record: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]


def _check_leader_waits(record: Path, steps: int) -> None:
    """Rank 0 leads the one engine over ranks 0 and 1; rank 1's put-aways and rank 0's releases
    were made slow."""
    leader, peer = _events(record, 0), _events(record, 1)
    put_away = [e for e in peer if e["what"] in ("make_room", "put_away")]  # start-up, then each step
    kv = [e for e in leader if e["what"] == "resume" and "kv_cache" in e["detail"]]
    assert len(put_away) == len(kv) == steps + 1, (put_away, kv)
    for i, (away, resume) in enumerate(zip(put_away, kv)):
        # The leader asked for the KV cache only once its peer's trainer was off the GPU.
        assert resume["start"] >= away["end"], f"resume {i} began {away['end'] - resume['start']:.2f}s too early"
    releases = [e for e in leader if e["what"] == "release"]
    back = [e for e in peer if e["what"] == "bring_back"]
    assert len(releases) == steps + 1 and len(back) == steps, (releases, back)  # (set-up: a release, no return)
    for i, (release, onload) in enumerate(zip(releases[1:], back)):
        # The peer's trainer came back only once the engine had let go of its GPU.
        assert onload["start"] >= release["end"], f"onload {i} began {release['end'] - onload['start']:.2f}s too early"


def _run(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None, steps: int = 2) -> list[dict]:
    record = tmp_path / "order"
    path = os.pathsep.join([str(HERE / "faults"), str(SGLANG_SHIM), os.environ.get("PYTHONPATH", "")])
    r = run_quickstart(
        tmp_path,
        "engine.gpus_per_engine=2",
        "engine.release=true",
        "world.reload=false",
        f"loop.steps={steps}",
        *overrides,
        env={"PYTHONPATH": path, "RLTRAIN_TEST_ENGINE_ORDER": f"{record}:1:{DELAY_S}", **(env or {})},
    )
    assert r.returncode == 0, r.stderr[-6000:]
    _check_leader_waits(record, steps)
    rows = tmp_path / "quickstart" / "metrics.jsonl"
    return [json.loads(line) for line in rows.read_text().splitlines()]


def test_the_embedded_engine_over_two_ranks_waits_for_both(tmp_path):
    rows = _run(tmp_path, "engine.backend=embedded")
    assert [row["step"] for row in rows] == [1, 2]


@pytest.mark.skipif(not HAVE_SGLANG and SKIP_SGLANG, reason="SGLang not installed and RLTRAIN_SKIP_SGLANG=1")
def test_sglang_at_tp2_over_two_ranks_waits_for_both(tmp_path):
    if not HAVE_SGLANG:
        pytest.fail("SGLang is not installed: install it as the README says, or set RLTRAIN_SKIP_SGLANG=1")
    rows = _run(
        tmp_path,
        "engine.backend=sglang",
        "engine.device=cpu",
        "engine.dtype=float32",
        f"engine.mem_fraction_static={SGLANG_CPU_MEM_FRACTION}",
        "engine.extra_args=[--max-total-tokens,4096]",
        "sync.transport=tensor",
        env={"RLTRAIN_TEST_SGLANG_CPU_RELEASE": "1"},
    )
    assert [row["step"] for row in rows] == [1, 2]
    log = (tmp_path / "quickstart" / "engine" / "node0-engine0.log").read_text()
    assert "'tp_size': 2" in log and "TP1" in log  # one SGLang over both ranks


# ------------------------------------------------------------------ the engine against its layout


def _launch_rank(rank: int, world_size: int, model: str, run_dir: str, per_engine: int, extra: list[str]) -> str:
    from rltrain.engine.launcher import NodeEngine
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=120)
    try:
        cfg = engine_config("embedded", gpus_per_engine=per_engine, extra_args=extra)
        node = NodeEngine.launch(cfg, model, world, Path(run_dir))
        node.shutdown()
        return "launched"
    except ConfigError as e:
        return f"ConfigError: {e}"
    finally:
        world.close()


def test_an_engine_whose_tp_size_is_not_its_layouts_is_refused_on_every_rank(model_a, tmp_path):
    """A dense model's engine started with --tp-size 2 in engine.extra_args over a layout of one
    GPU per engine: the sync would build one payload where the engine reads two. Refused at
    launch, on every rank, with what to set; the engines are stopped."""
    from multiproc import values

    out = values(run_ranks(_launch_rank, 2, str(model_a), str(tmp_path), 1, ["--tp-size", "2"], deadline_s=240))
    assert all(o.startswith("ConfigError: ") for o in out), out
    for name in ("node0-engine0", "node0-engine1"):
        assert any(f"{name} (engine.extra_args or the engine's defaults) reports tp_size=2" in o for o in out), out
    assert "laid out over 1 GPU(s) (engine.gpus_per_engine=1)" in out[0] and "not --tp-size" in out[0]


def test_layouts_the_sync_cannot_route_are_refused_by_what_the_engine_reports():
    """SGLang's /server_info keys: tp_size against the layout for every model; moe_dp_size > 1
    with expert parallelism and an elastic-EP join offset, whose expert placement routing does
    not follow."""
    from rltrain.sync.plan import EngineParallelism

    two = EngineLayout(0, 2, 0, 2)
    sglang = {"tp_size": 2, "ep_size": 1, "dp_size": 1, "moe_dp_size": 1, "ep_join_rank_offset": 0}
    two.check_reported(sglang)
    two.check_reported({"tp_size": 2})  # the embedded engine: no moe_dp_size, no offset
    with pytest.raises(ConfigError, match=r"reports tp_size=4, but it was laid out over 2 GPU\(s\)"):
        two.check_reported({**sglang, "tp_size": 4})
    with pytest.raises(ConfigError, match=r"reports tp_size=None"):
        two.check_reported({})
    two.check_reported({**sglang, "moe_dp_size": 2})  # no expert parallelism: nothing to route
    with pytest.raises(ConfigError, match=r"moe_dp_size=2 with ep_size=2.*--moe-dp-size 1"):
        two.check_reported({**sglang, "moe_dp_size": 2, "ep_size": 2})
    with pytest.raises(ConfigError, match=r"ep_join_rank_offset=4 \(an elastic-EP joiner\)"):
        two.check_reported({**sglang, "ep_join_rank_offset": 4})
    la = EngineParallelism.from_server_info({**sglang, "moe_dp_size": 2, "ep_join_rank_offset": 4})
    assert (la.moe_dp_size, la.ep_offset) == (2, 4)


# ------------------------------------------------------------------ the leader's failure, on every rank


def _leader_fails_rank(rank: int, world_size: int, model: str, run_dir: str) -> list[str]:
    from rltrain.engine.launcher import EnginePhaseError, NodeEngine
    from rltrain.runtime.world import World

    world = World(backend="gloo", timeout=120)
    seen: list[str] = []
    try:
        cfg = engine_config("embedded", gpus_per_engine=2, release=True, retries=0, request_timeout_s=10)
        node = NodeEngine.launch(cfg, model, world, Path(run_dir))
        assert node.engine_ranks is not None and node.is_leader == (rank == 0)
        if node.is_leader:
            assert node.process is not None
            node.process.stop()  # its engine gone: the leader's requests fail, the peer's ask nothing
        for verb in (node.release_memory, node.resume_kv):
            try:
                verb()
                seen.append(f"{verb.__name__}: no error")
            except EnginePhaseError as e:
                seen.append(f"{verb.__name__}: {e}")
        return seen
    finally:
        world.close()


def test_a_leaders_failed_release_or_resume_is_raised_on_every_rank_of_the_engine(model_a, tmp_path):
    """Only the engine's leader talks to it; its peer must not go on as if the engine had let go
    of (or taken back) its GPU. The engine over ranks 0 and 1 is stopped under its leader: the
    release and the KV resume fail on both ranks, with the leader's error and the engine's name,
    within the request's bounds (no rank waits for a world timeout)."""
    from multiproc import values

    out = values(run_ranks(_leader_fails_rank, 2, str(model_a), str(tmp_path), deadline_s=240))
    for rank, seen in enumerate(out):
        assert len(seen) == 2, (rank, seen)
        release, resume = seen
        assert release.startswith("release_memory: engine released failed on the engine's leader rank: "), seen
        assert resume.startswith("resume_kv: engine resume kv failed on the engine's leader rank: "), seen
        assert "node0-engine0" in release and "node0-engine0" in resume, seen
