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


def _submit(
    tmp_path: Path, run_dir: Path, *overrides: str, sbatch: tuple[str, ...] = (), nproc: str | None = "2"
) -> str:
    env = {**_env(), "RLTRAIN_RUN_DIR": str(run_dir)}
    if nproc is not None:
        env["RLTRAIN_NPROC_PER_NODE"] = nproc
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={REPO}",
            f"--output={tmp_path}/slurm-%j.out",
            "--job-name=rltrain-test",
            *sbatch,
            str(REPO / "launch" / "slurm" / "rltrain.sbatch"),
            "configs/quickstart.yaml",
            f"model.path={tmp_path / 'base_model'}",
            "data.prompts_per_step=8",
            "metrics.plot=false",
            *overrides,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _log(run_dir: Path, job: str) -> str:
    """The job's log in its run directory (every attempt appended), or Slurm's file before it."""
    path = run_dir / f"slurm-{job}.log"
    return path.read_text() if path.is_file() else "(no job log yet)"


def _scontrol(job: str) -> dict[str, str]:
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=10)
    return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)


def _state(job: str) -> str:
    return _scontrol(job).get("JobState", "GONE")


def _wait(job: str, until: float, done=lambda: False) -> str:
    while time.time() < until:
        state = _state(job)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED") or done():
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=10)
    raise AssertionError(f"Slurm job {job} still {_state(job)} at the deadline")


def _rows_at_least(run_dir: Path, n: int):
    metrics = run_dir / "quickstart" / "metrics.jsonl"
    return lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= n


def _no_process_left(tmp_path: Path) -> None:
    """No rank, agent or engine of a job is left (each has the test's path in its command line)."""
    for _ in range(30):
        left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
        if not left:
            return
        time.sleep(1)
    raise AssertionError(f"processes of the job still running: {left}")


@slurm
def test_sbatch_runs_the_quickstart_on_a_whole_node_with_every_cpu_and_logs_in_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(tmp_path, run_dir, "loop.steps=4", "checkpoint.interval=2")
    state = _wait(job, time.time() + 300)
    log = _log(run_dir, job)
    assert state == "COMPLETED", log[-4000:]
    cpus = len(os.sched_getaffinity(0))  # the node's: the test cluster is this machine
    assert f"job {job} attempt 1: 1 node(s) x 2 rank(s), {cpus} CPU(s) per node" in log, log[-4000:]
    # What the ranks may run on, as Slurm pinned them: all of the node's CPUs, not one.
    assert f"node 0: 2 rank(s) on {cpus} CPU(s)" in log, log[-4000:]
    assert "\r" not in log and "step 4/4: reward" in log  # a line per step, no progress-bar frames
    assert (
        tmp_path / f"slurm-{job}.out"
    ).read_text().strip() == f"rltrain: job {job} logs to {run_dir}/slurm-{job}.log"
    assert _steps(run_dir / "quickstart") == [1, 2, 3, 4]
    assert (run_dir / "quickstart" / "checkpoints" / "step_000004").is_dir()


@slurm
def test_ranks_per_node_are_the_gpus_asked_for(tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(tmp_path, run_dir, "loop.steps=2", sbatch=("--gpus-per-node=2",), nproc=None)
    state = _wait(job, time.time() + 300)
    log = _log(run_dir, job)
    assert state == "COMPLETED", log[-4000:]
    assert "1 node(s) x 2 rank(s)" in log, log[-4000:]
    rows = [json.loads(x) for x in (run_dir / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert set(rows[-1]["memory"]) == {"rank0", "rank1"}


@slurm
@pytest.mark.timeout(900)
def test_a_time_limit_stops_the_job_after_a_checkpoint_and_the_requeued_job_resumes(tmp_path):
    """--time=2 with the warning 60 s before: every rank stops after a verified checkpoint (no
    checkpoint interval), the script requeues the job, and the job's second attempt (given more
    time while it waits) resumes from that checkpoint: every step recorded once."""
    run_dir = tmp_path / "run"
    steps = 250
    job = _submit(
        tmp_path, run_dir, f"loop.steps={steps}", "checkpoint.interval=0", sbatch=("--time=2", "--signal=USR1@60")
    )
    requeued = lambda: "requeued; it resumes" in _log(run_dir, job)  # noqa: E731
    _wait(job, time.time() + 240, requeued)
    assert requeued(), _log(run_dir, job)[-4000:]
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=15"], check=True, timeout=10)
    state = _wait(job, time.time() + 600)
    log = _log(run_dir, job)
    assert state == "COMPLETED", log[-4000:]
    marker = log.split("stopped on request: ", 1)[1].splitlines()[0]
    stopped = json.loads(marker)
    assert stopped["reason"] == "SIGUSR1" and stopped["job"] == job and 0 < stopped["step"] < steps, marker
    assert f"job {job} attempt 2:" in log and f"step {stopped['step']}, weight version {stopped['step']}" in log
    assert _steps(run_dir / "quickstart") == list(range(1, steps + 1))  # no step twice, none missing
    assert not (run_dir / "quickstart" / "stopped.json").exists()


@slurm
@pytest.mark.timeout(900)
def test_scancel_signal_term_stops_after_a_checkpoint_and_the_job_requeues_and_completes(tmp_path):
    run_dir = tmp_path / "run"
    steps = 120
    job = _submit(tmp_path, run_dir, f"loop.steps={steps}")
    assert _wait(job, time.time() + 300, _rows_at_least(run_dir, 5)) == "RUNNING", _log(run_dir, job)[-4000:]
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=10)
    state = _wait(job, time.time() + 600, lambda: False)
    log = _log(run_dir, job)
    assert state == "COMPLETED", log[-4000:]
    assert '"reason": "SIGTERM"' in log and f"job {job} attempt 2:" in log, log[-4000:]
    assert _steps(run_dir / "quickstart") == list(range(1, steps + 1))


@slurm
@pytest.mark.timeout(900)
def test_a_restart_in_a_run_directory_without_checkpoints_is_refused_and_the_history_stays(tmp_path):
    run_dir = tmp_path / "run"
    first = _submit(tmp_path, run_dir, "loop.steps=3", "checkpoint.interval=0")  # nothing to resume from
    assert _wait(first, time.time() + 300) == "COMPLETED", _log(run_dir, first)[-4000:]
    metrics = run_dir / "quickstart" / "metrics.jsonl"
    before = metrics.read_text()
    again = _submit(tmp_path, run_dir, "loop.steps=6", "checkpoint.interval=0")
    state = _wait(again, time.time() + 300)
    log = _log(run_dir, again)
    assert state == "FAILED", log[-4000:]
    assert "refusing to start" in log and "run.start_over=true" in log, log[-4000:]
    assert metrics.read_text() == before


@slurm
def test_a_config_error_or_a_missing_environment_fails_the_job_once_before_srun(tmp_path):
    run_dir = tmp_path / "run"
    job = _submit(tmp_path, run_dir, "loop.stesp=3")
    assert _wait(job, time.time() + 120) == "FAILED"
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert out.count("unknown config key loop.'stesp'; did you mean 'steps'?") == 1, out
    assert not (run_dir / f"slurm-{job}.log").exists()  # nothing started
    env = {**_env(), "PATH": "/usr/bin:/bin", "RLTRAIN_RUN_DIR": str(run_dir)}
    r = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={tmp_path}/slurm-%j.out",
         str(REPO / "launch" / "slurm" / "rltrain.sbatch"), "configs/quickstart.yaml"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    job = r.stdout.strip().split(";")[0]
    assert _wait(job, time.time() + 120) == "FAILED"
    assert "activate rltrain's environment" in (tmp_path / f"slurm-{job}.out").read_text()


@slurm
@pytest.mark.timeout(900)
def test_scancel_mid_run_then_resubmission_resumes_from_the_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "quickstart" / "checkpoints"
    args = ("loop.steps=60", "checkpoint.interval=3")
    job = _submit(tmp_path, run_dir, *args)
    has_ckpt = lambda: ckpts.is_dir() and any((p / "manifest.json").is_file() for p in ckpts.glob("step_*"))  # noqa: E731
    assert _wait(job, time.time() + 300, has_ckpt) == "RUNNING", _log(run_dir, job)[-4000:]
    subprocess.run(["scancel", job], check=True, timeout=10)
    assert _wait(job, time.time() + 120) == "CANCELLED"  # a cancelled job is not requeued
    _no_process_left(tmp_path)
    recorded = _steps(run_dir / "quickstart")[-1]
    assert recorded < 60, "the first job was not stopped mid-run"
    # The newest checkpoint of a recorded step (a step saved but not yet recorded runs again).
    saved = max(
        s
        for s in (int(p.name.removeprefix("step_")) for p in ckpts.glob("step_*") if (p / "manifest.json").is_file())
        if s <= recorded
    )

    again = _submit(tmp_path, run_dir, *args)
    state = _wait(again, time.time() + 300)
    log = _log(run_dir, again)
    assert state == "COMPLETED", log[-4000:]
    assert "resumed from" in log and f"step {saved}" in log, log[-4000:]
    assert _steps(run_dir / "quickstart") == list(range(1, 61))  # no step twice, none missing
