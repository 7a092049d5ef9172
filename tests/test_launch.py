"""launch/: two torchrun agents as two "nodes" on one machine; the sbatch script on a real Slurm.

The Slurm tests need a running cluster (`sbatch` on PATH and `sinfo` answering): the test
harness `launch/slurm/test-cluster.sh` installs Debian's slurm-wlm and munge and starts a
one-node cluster on this machine. Without one they skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICK = ["data.prompts_per_step=8", "metrics.progress_bar=false", "metrics.plot=false"]


def _env() -> dict[str, str]:
    # The launch scripts call torchrun / python3 from PATH: this interpreter's first.
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHON": sys.executable,
    }


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_two_agents_as_two_nodes_each_with_its_engine_complete_the_quickstart(tmp_path):
    cmd = [
        "bash",
        str(REPO / "launch" / "local-multinode.sh"),
        "2",
        "1",
        str(REPO / "configs" / "quickstart.yaml"),
        f"run.dir={tmp_path}",
        f"model.path={tmp_path / 'base_model'}",
        "loop.steps=3",
        *QUICK,
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"two agents did not finish in 240 s:\n{err[-4000:]}") from None
    assert proc.returncode == 0, err[-4000:]
    run_dir = tmp_path / "quickstart"
    assert _steps(run_dir) == [1, 2, 3]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["memory"]) == {"rank0", "rank1"} and all(r["generation_failed"] == 0 for r in rows)
    # Each "node" (agent) started its own engine from its local rank 0.
    assert (run_dir / "engine" / "node0-engine0.log").is_file() and (run_dir / "engine" / "node1-engine0.log").is_file()


# ---------------------------------------------------------------------------------------- Slurm


def _cluster_up() -> bool:
    if not shutil.which("sbatch"):
        return False
    try:
        return subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def slurm(test):
    """Marked `slurm` (select with -m slurm) and skipped without a cluster."""
    skip = pytest.mark.skipif(
        not _cluster_up(), reason="no Slurm cluster here (start one: launch/slurm/test-cluster.sh)"
    )
    return pytest.mark.slurm(skip(test))


def _submit(tmp_path: Path, run_dir: Path, *overrides: str) -> str:
    env = {**_env(), "RLTRAIN_NPROC_PER_NODE": "2", "RLTRAIN_RUN_DIR": str(run_dir)}
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={REPO}",
            f"--output={tmp_path}/slurm-%j.out",
            "--job-name=rltrain-test",
            str(REPO / "launch" / "slurm" / "rltrain.sbatch"),
            "configs/quickstart.yaml",
            f"model.path={tmp_path / 'base_model'}",
            *QUICK,
            *overrides,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _state(job: str) -> str:
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=10)
    for field in r.stdout.split():
        if field.startswith("JobState="):
            return field.removeprefix("JobState=")
    return "GONE"


def _wait(job: str, until: float, done=lambda: False) -> str:
    while time.time() < until:
        state = _state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") or done():
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=10)
    raise AssertionError(f"Slurm job {job} still {_state(job)} at the deadline")


@slurm
def test_sbatch_runs_the_quickstart_and_writes_metrics_and_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(tmp_path, run_dir, "loop.steps=4", "checkpoint.interval=2")
    state = _wait(job, time.time() + 300)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert f"rltrain: job {job}, 1 node(s) x 2 rank(s)" in log
    assert _steps(run_dir / "quickstart") == [1, 2, 3, 4]
    assert (run_dir / "quickstart" / "checkpoints" / "step_000004").is_dir()


@slurm
def test_scancel_mid_run_then_resubmission_resumes_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "quickstart" / "checkpoints"
    args = ("loop.steps=60", "checkpoint.interval=3")
    job = _submit(tmp_path, run_dir, *args)
    has_ckpt = lambda: ckpts.is_dir() and any((p / "manifest.json").is_file() for p in ckpts.glob("step_*"))  # noqa: E731
    assert _wait(job, time.time() + 300, has_ckpt) == "RUNNING", (tmp_path / f"slurm-{job}.out").read_text()[-4000:]
    subprocess.run(["scancel", job], check=True, timeout=10)
    _wait(job, time.time() + 120)
    # A clean exit: no rank, agent or engine of the job is left (each has the run's path in its command line).
    for _ in range(30):
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(1)
    assert not left, f"processes of the cancelled job still running: {left}"
    assert _steps(run_dir / "quickstart")[-1] < 60, "the first job was not stopped mid-run"
    recorded = _steps(run_dir / "quickstart")[-1]
    # The newest checkpoint of a recorded step (a step saved but not yet recorded runs again).
    saved = max(
        s
        for s in (int(p.name.removeprefix("step_")) for p in ckpts.glob("step_*") if (p / "manifest.json").is_file())
        if s <= recorded
    )

    again = _submit(tmp_path, run_dir, *args)
    state = _wait(again, time.time() + 300)
    log = (tmp_path / f"slurm-{again}.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert "resumed from" in log and f"step {saved}" in log, log[-4000:]
    assert _steps(run_dir / "quickstart") == list(range(1, 61))  # no step twice, none missing
