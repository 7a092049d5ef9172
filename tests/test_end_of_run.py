"""A job that fails after its last step is recorded: the failing part is named, torchrun's
restart does not refuse (nothing to run) and ends with the first error instead of success,
and the benchmarks print a failed run's first error, not its log's last lines. Real torchrun
jobs (the CPU quickstart, 3 steps, no checkpoint) with a fault injected at the end
(tests/faults/sitecustomize.py: RLTRAIN_TEST_END_FAULT)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rltrain.bench import quickstart as quickstart_bench
from rltrain.bench.first_error import first_error
from test_loop import REPO, run_quickstart

FAULTS = Path(__file__).parent / "faults"


def _fault_env(**faults: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]), **faults}


def _ends_with(tmp_path: Path, fault: str, interval: int = 0):
    """The quickstart with `fault` at its end, under torchrun --max-restarts=1; by default
    without checkpoints, as the e2e benchmark runs (a restart has none to resume)."""
    return run_quickstart(
        tmp_path,
        f"checkpoint.interval={interval}",
        "world.timeout_s=60",
        torchrun_args=("--max-restarts=1",),
        env=_fault_env(RLTRAIN_TEST_END_FAULT=fault),
    )


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("interval", [0, 1], ids=["no-checkpoint", "checkpoint"])
def test_a_failure_after_the_last_step_is_named_and_the_restart_ends_with_it(tmp_path, interval):
    """Rank 1's weight sync fails to close after step 3 is recorded: the part is named;
    torchrun's restart has nothing to run (no refusal, no step run again; with a checkpoint of
    step 3, after resuming from it) and exits non-zero with that error and its traceback, not
    with success; the first error in the log is that one."""
    r = _ends_with(tmp_path, "1:rltrain.sync.weight_sync:WeightSync.close:raise", interval)
    assert r.returncode != 0, r.stderr[-3000:]
    named = "rank 1 failed in the weight sync's close at the end of the run, after step 3"
    assert named in r.stderr, r.stderr[-3000:]
    assert _steps(tmp_path / "quickstart") == [1, 2, 3]
    assert not (tmp_path / "quickstart" / "metrics.dropped.jsonl").exists()
    assert "refusing to start" not in r.stderr, r.stderr[-3000:]
    restart = r.stderr.index("nothing to run: step 3 of 3 is done")
    assert ("resumed from" in r.stderr[:restart]) == (interval == 1), r.stderr[-3000:]
    said = r.stderr.index("restart 1 of this job has nothing left to run, but the job failed after step 3", restart)
    assert named in r.stderr[said:] and "fault injected by the test in WeightSync.close" in r.stderr[said:]
    # A benchmark's report: the first failure, not the restart's lines or torchrun's report.
    found = first_error(r.stderr)
    assert found is not None and found.splitlines()[0].endswith(
        named + ": RuntimeError: fault injected by the test in WeightSync.close at the end of the run"
    ), found
    assert "[rank1]: RuntimeError: fault injected by the test" in found and "nothing left to run" not in found
    assert "torchrun saw first: failed (exitcode: 1) local_rank: 1" in found


def test_a_rank_killed_after_the_last_step_is_named_by_the_restart_as_the_rank_without_an_error(tmp_path):
    """Rank 1 is SIGKILLed while its engine shuts down (as the out-of-memory killer would): it
    writes nothing; the restart has nothing to run, names it, and exits non-zero."""
    r = _ends_with(tmp_path, "1:rltrain.engine.launcher:NodeEngine.shutdown:kill")
    assert r.returncode != 0, r.stderr[-3000:]
    assert _steps(tmp_path / "quickstart") == [1, 2, 3]
    assert "refusing to start" not in r.stderr and "nothing to run: step 3 of 3 is done" in r.stderr, r.stderr[-3000:]
    assert "restart 1 of this job has nothing left to run" in r.stderr, r.stderr[-3000:]
    assert "rank(s) 1 recorded no error: killed" in r.stderr, r.stderr[-3000:]
    found = first_error(r.stderr)
    assert found is not None and "torchrun saw first: failed (exitcode: -9) local_rank: 1" in found, found


def test_the_quickstart_benchmark_prints_the_first_error_of_a_failed_run(tmp_path, monkeypatch):
    """Rank 1 raises in the train phase of step 2; rank 0 fails after it, waiting for it. The
    benchmark (python -m rltrain.bench.quickstart) says rank 1's error and traceback."""
    for k, v in _fault_env(RLTRAIN_TEST_FAULT="1:train:2:raise").items():
        monkeypatch.setenv(k, v)
    overrides = ["data.prompts_per_step=8", "metrics.plot=false", "checkpoint.interval=0", "world.timeout_s=60"]
    with pytest.raises(SystemExit) as e:
        quickstart_bench.run(tmp_path, 3, overrides)
    said = str(e.value.code)
    lines = said.splitlines()
    assert lines[0] == f"the quickstart failed (exit 1); the first error in {tmp_path / 'quickstart.log'}:", said
    assert lines[1].endswith(
        "rank 1 failed in phase train of step 2: RuntimeError: fault injected by the test in phase train of step 2"
    ), said
    assert "[rank1]: Traceback (most recent call last):" in said and "ChildFailedError" not in said, said


def test_a_new_job_over_a_finished_run_without_checkpoints_has_nothing_to_run(tmp_path):
    """history.begin: every step recorded and no checkpoint: nothing to run (Finished), not a
    refusal; one step short, still refused (as tests/test_checkpoint.py checks)."""
    from rltrain.config import load_config  # noqa: PLC0415
    from rltrain.history import Finished, HistoryError, begin  # noqa: PLC0415

    def cfg(steps: int, *more: str):
        overrides = [f"run.dir={tmp_path}", f"loop.steps={steps}", *more]
        return load_config(str(REPO / "configs" / "quickstart.yaml"), overrides)

    run_dir = cfg(3).run_dir
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert begin(cfg(3), run_dir / "checkpoints") == Finished(3)
    assert begin(cfg(5, "loop.stop_after=3"), run_dir / "checkpoints") == Finished(3)
    with pytest.raises(HistoryError, match="records steps up to 3"):
        begin(cfg(4), run_dir / "checkpoints")
