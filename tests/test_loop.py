"""The driver loop end to end: torchrun, 2 ranks, embedded engine, disk sync, metrics and plots."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from multiproc import run_torchrun
from rltrain.rollout.step import check_versions
from rltrain.weights.versions import StaleWeightsError

REPO = Path(__file__).resolve().parents[1]


def run_quickstart(
    tmp_path: Path, *overrides: str, torchrun_args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return run_torchrun(
        tmp_path,
        [*torchrun_args, "-m", "rltrain"],
        [
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            f"run.dir={tmp_path}",
            f"model.path={tmp_path / 'base_model'}",
            "loop.steps=3",
            "data.prompts_per_step=8",
            "metrics.progress_bar=false",
            "metrics.plot=false",  # (~3 s of CPU a job; the end-to-end test asks for them and checks them)
            *overrides,
        ],
        env=env,
    )


# Every switch taken, as on GPUs: the world torn down and rebuilt, the engine's memory released
# (weights discarded: every parameter must be rewritten), weights by disk.
FULL_CYCLE = ["world.reload=true", "engine.release=true", "sync.transport=disk"]


@pytest.mark.parametrize("mode", ["colocated", "no-reload"])
def test_quickstart_steps_end_to_end(tmp_path, mode):
    extra = FULL_CYCLE if mode == "colocated" else ["loop.colocate=false", "world.reload=false"]
    r = run_quickstart(tmp_path, *extra, "metrics.plot=true")
    assert r.returncode == 0, r.stderr[-4000:]
    # On the CPU the trainer is built while the engines start (on GPUs after: SGLang sizes its KV
    # pool from the free memory it sees at start-up).
    started, created = r.stderr.index("engine started: pid"), r.stderr.index("trainer created (fsdp), while")
    assert started < created < r.stderr.index("engine healthy at")
    run_dir = tmp_path / "quickstart"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["samples"] == 8 * 8 and row["generation_failed"] == 0 and row["reward_failed"] == 0
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0.0 <= row["pass_rate"] <= 1.0
        for key in (
            "kl",
            "entropy",
            "clip_frac",
            "grad_norm",
            "lr",
            "rollout_tokens_per_s",
            "train_tokens_per_s",
            "response_length",
            "logp_diff_engine_trainer",
        ):
            assert key in row, key
        assert {"rollout", "train", "sync", "world_rebuild", "engine_release"} <= set(row["time"])
        waited, scored = row["rollout_time"]["generate_s"], row["rollout_time"]["score_s"]
        assert 0 < waited < row["time"]["rollout"] and 0 < scored < row["time"]["rollout"]
        # The memory ledger after every phase: the trainer's tensors, this rank's RSS, and the
        # RSS of the engine each rank owns (the embedded engine: one per rank) from its report.
        assert set(row["memory"]) == {"rank0", "rank1"} and row["memory"]["rank1"]["train"]["rss"] > 0
        for rank in ("rank0", "rank1"):
            assert set(row["memory"][rank]) >= {"rollout", "train", "sync", "trainer_offload"}
            assert row["memory"][rank]["train"]["trainer_host"] > 0
        assert (
            row["memory"]["rank0"]["rollout"]["engine_rss"] > 0 and row["memory"]["rank1"]["rollout"]["engine_rss"] > 0
        )
        # Every sync is probed on the engines: they score a fixed sequence as the trainer does.
        assert 0 <= row["sync_probe_diff"] < 1e-3
        # Each engine's checksum compared with the trainer's, also where its weights were released
        # when its capabilities were asked.
        assert row["sync_digests_compared"] == 2 and row["sync_rewrites_checked"] == 0, row
        # Engine and trainer compute the same log-probs for the same weights (fp32, same model).
        assert row["logp_diff_engine_trainer"] < 1e-3
    # Versions 2 and 3 kept (sync.keep_weight_versions=2), published atomically: no temp dirs left.
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["weight_v000002", "weight_v000003"]
    assert (run_dir / "weights" / "weight_v000003" / "model.safetensors").is_file()
    for png in ("reward.png", "phase_time.png", "memory.png"):
        assert (run_dir / png).stat().st_size > 1000
    assert (run_dir / "config.yaml").is_file() and (run_dir / "engine" / "node0-engine0.log").is_file()
    ledger = subprocess.run(
        [sys.executable, "-m", "rltrain.plot", str(run_dir), "--ledger", "2"], capture_output=True, text=True
    )
    assert ledger.returncode == 0 and "memory ledger (GiB) of step 2" in ledger.stdout, ledger.stderr
    assert "trainer_host" in ledger.stdout and "engine_rss" in ledger.stdout
    if mode == "colocated":
        # Run again in the same directory: the quickstart saved at its last step, so the run goes on
        # from there (nothing left to run at 3 of 3) and not one row of its history is lost.
        before = (run_dir / "metrics.jsonl").read_text()
        r = run_quickstart(tmp_path, *FULL_CYCLE)
        assert r.returncode == 0, r.stderr[-4000:]
        assert "resumed from" in r.stderr and "nothing to run: step 3 of 3 is done" in r.stderr, r.stderr[-4000:]
        assert (run_dir / "metrics.jsonl").read_text() == before


def test_on_the_cpu_each_switch_costs_what_it_frees_and_every_sync_is_still_verified(tmp_path):
    """The quickstart's own settings (auto): on the CPU the gloo world stays up, the engines keep
    their memory, the weights go by handle (tensor), and the old log-probs come from the training
    forward; every sync is still checked (version, checksum of every tensor, the probe) and the
    engine's log-probs still match the trainer's."""
    r = run_quickstart(tmp_path, "loop.steps=4")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "sync.transport=auto: tensor" in r.stderr and "world: stays up" in r.stderr, r.stderr[-3000:]
    # The trainer's side of the probe rides the next step's training (the sync runs no forward of
    # its own); every row still has the probe of the weights its rollout came from.
    assert "the trainer's side in the next training step's first micro-batch" in r.stderr, r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["sync_bytes"] > 0 and 0 <= row["sync_probe_diff"] < 1e-3
        assert 0 <= row["logp_diff_engine_trainer"] < 1e-3  # measured in the training forward
        for switch in ("world_rebuild", "world_destroy", "trainer_onload", "engine_release", "engine_resume_kv"):
            assert row["time"][switch] < 0.005, (switch, row["time"])
        assert row["time"]["logprobs"] < row["time"]["train"]  # no separate old-log-prob pass
    assert not (tmp_path / "quickstart" / "weights").exists() or not list(
        (tmp_path / "quickstart" / "weights").iterdir()
    )


@pytest.mark.parametrize("transport", ["tensor", "distributed", "delta"])
def test_the_loop_syncs_by_every_transport(tmp_path, transport):
    extra = ["loop.colocate=false", "sync.delta_full_every=2"] if transport == "delta" else []
    r = run_quickstart(tmp_path, f"sync.transport={transport}", "loop.steps=4", *extra)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and all(row["sync_bytes"] > 0 for row in rows)
    if transport == "delta":  # versions 1, 3 full; 2, 4 deltas rebuilt next to the engine
        kinds = [
            json.loads((tmp_path / "quickstart" / "weights" / f"weight_v{v:06d}" / "rltrain_version.json").read_text())[
                "kind"
            ]
            for v in (3, 4)
        ]
        assert kinds == ["full", "delta"]
        assert rows[3]["sync_bytes"] < rows[2]["sync_bytes"]


def test_a_save_to_disk_dataset_with_its_own_field_names_trains(tmp_path):
    """The quickstart's task as a user's Hugging Face dataset: saved with `save_to_disk`, its
    fields `question` / `solution`, mapped by `data.fields`; the job trains on it and scores
    its answers (no reward fails, some samples pass)."""
    datasets = pytest.importorskip("datasets")
    from rltrain.rollout.synthetic import addition_records

    rows = [{"question": r["prompt"], "solution": r["answer"]} for r in addition_records()]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "addition")
    fields = "data.fields={prompt: question, answer: solution}"
    r = run_quickstart(tmp_path, f"data.path={tmp_path / 'addition'}", fields)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["samples"] == 8 * 8 and row["reward_failed"] == 0 for row in rows)
    assert sum(row["pass_rate"] for row in rows) > 0


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (run-<id>.wandb): a 7-byte header, then
    blocks of 32 KiB holding records framed as LevelDB's log does (crc, length, type; a record
    may span blocks: first, middle..., last)."""
    from wandb.proto import wandb_internal_pb2 as pb2

    data, pos, block, part, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if n == 0 and kind == 0:  # the block's zero padding
            pos += left - 7
            continue
        part, pos = part + data[pos : pos + n], pos + n
        if kind in (1, 4):  # a whole record, or a record's last piece
            record = pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_wandb_offline_holds_every_steps_metrics_and_the_config_and_a_resumed_run_continues_it(tmp_path):
    """metrics.wandb with mode offline: the run's W&B file holds each step's metrics row (phase
    times as time/<phase>) and the resolved config; a job stopped after step 2 and resubmitted
    resumes from its checkpoint into the same W&B run id, logging step 3."""
    pytest.importorskip("wandb")
    args = ("metrics.wandb.project=rltrain-test", "checkpoint.interval=2")
    r = run_quickstart(tmp_path, *args, "loop.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_quickstart(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr, r.stderr[-3000:]
    run_dir = tmp_path / "quickstart"
    run_id = (run_dir / "wandb-run-id").read_text().strip()
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    logged = {}
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                assert rec.run.run_id == run_id and rec.run.project == "rltrain-test"
                config = {u.key: json.loads(u.value_json) for u in rec.run.config.update}
                assert config["run"]["name"] == "quickstart" and config["data"]["prompts_per_step"] == 8
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                logged[items["_step"]] = items
    assert sorted(logged) == [1, 2, 3]
    for step, items in logged.items():
        assert "time/step" in items, sorted(items)
        assert items["reward_mean"] == pytest.approx(rows[step]["reward_mean"])
        assert items["time/step"] == pytest.approx(rows[step]["time"]["step"])


def test_mlflow_holds_every_steps_metrics_and_the_config_and_a_resumed_run_continues_it(tmp_path):
    """metrics.mlflow with a local file store: the run's metrics by step (eval's pass@k as
    pass_at_k), the resolved config as parameters and config.json; a job stopped after step 2
    and resubmitted logs step 3 into the same MLflow run."""
    pytest.importorskip("mlflow")
    store = f"file:{tmp_path / 'mlruns'}"
    args = (f"metrics.mlflow.tracking_uri={store}", "checkpoint.interval=2", *EVAL[:2], "eval.before_train=true")
    r = run_quickstart(tmp_path, *args, "loop.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_quickstart(tmp_path, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr, r.stderr[-3000:]
    import mlflow

    run_dir = tmp_path / "quickstart"
    run_id = (run_dir / "mlflow-run-id").read_text().strip()
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert run.data.params["run.name"] == "quickstart" and run.data.params["data.prompts_per_step"] == "8"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = {m.step: m.value for m in client.get_metric_history(run_id, "reward_mean")}
    assert history == pytest.approx({row["step"]: row["reward_mean"] for row in rows})
    assert sorted(m.step for m in client.get_metric_history(run_id, "time/step")) == [1, 2, 3]
    evals = {m.step: m.value for m in client.get_metric_history(run_id, "eval/pass_at_1")}
    assert evals == pytest.approx({row["step"]: row["eval/pass@1"] for row in _eval_rows(run_dir / "eval.jsonl")})
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config["metrics"]["mlflow"]["tracking_uri"] == store


def test_wandb_asked_for_but_missing_is_a_clear_error_at_start_up(tmp_path):
    """Without the package, metrics.wandb.project is refused when the config is read, naming the
    extra to install (a test that hides the installed package from the job)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "wandb.py").write_text("raise ImportError('hidden by the test')\n")
    (hide / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'wandb' else _find(name, *a)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    r = run_quickstart(tmp_path, "metrics.wandb.project=rltrain-test", env=env)
    assert r.returncode != 0
    assert 'wandb is not installed: pip install "rltrain[wandb]"' in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()


EVAL = ("eval.path=synthetic:addition", "eval.every=2", "eval.before_train=true", "eval.n=4", "eval.temperature=1.0")


def _eval_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_evaluation_runs_as_a_phase_of_its_own_and_a_resumed_run_repeats_it(tmp_path):
    """eval every 2 steps and before training, 4 samples a prompt: eval.jsonl holds the weights
    of steps 0, 2 and 4 judged on all 100 prompts (pass@1, 2, 4 and the reward), the eval phase
    is timed in the rows of the steps it ran before, and eval.png is drawn. A job stopped after
    step 2 and resubmitted evaluates step 2's weights again: the same results as the first
    attempt's (seeded), that row moved aside first."""
    r = run_quickstart(tmp_path, *EVAL, "loop.steps=4", "checkpoint.interval=2", "loop.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    run_dir = tmp_path / "quickstart"
    first = _eval_rows(run_dir / "eval.jsonl")
    assert [row["step"] for row in first] == [0, 2]
    r = run_quickstart(tmp_path, *EVAL, "loop.steps=4", "checkpoint.interval=2", "metrics.plot=true")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr, r.stderr[-3000:]
    rows = _eval_rows(run_dir / "eval.jsonl")
    assert [row["step"] for row in rows] == [0, 2, 4]
    for row in rows:
        assert row["eval/prompts"] == 100 and row["eval/samples"] == 400 and row["eval/generation_failed"] == 0
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1
        assert row["step"] == 0 or row["weight_version"] == str(row["step"])  # (step 0: the engine's first)
    moved = _eval_rows(run_dir / "eval.dropped.jsonl")
    assert [row["step"] for row in moved] == [2]
    same = lambda row: {k: v for k, v in row.items() if k != "eval/seconds"}  # noqa: E731
    assert same(moved[0]) == same(rows[1]) == same(first[1])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert ["eval" in row["time"] for row in metrics] == [True, False, True, False]
    assert (run_dir / "eval.png").is_file()


def test_the_quickstart_evaluated_every_100_steps_rises_from_chance(tmp_path):
    """The README's quickstart (its first 100 steps) with greedy evaluation on the 100 addition
    prompts before training and every 100 steps: pass@1 starts near chance (~1 in 20) and rises
    (0.04 -> 0.42 on the development machine)."""
    r = run_quickstart(
        tmp_path,
        "loop.steps=100",
        "data.prompts_per_step=16",
        "eval.path=synthetic:addition",
        "eval.every=100",
        "eval.before_train=true",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _eval_rows(tmp_path / "quickstart" / "eval.jsonl")
    assert [row["step"] for row in rows] == [0, 100]
    passed = [row["eval/pass@1"] for row in rows]
    assert passed[0] <= 0.15 and passed[1] >= passed[0] + 0.15, passed


def test_bad_dataset_fails_before_training_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 2 =", "answer": "3"}\n{"prompt": \n')
    r = run_quickstart(tmp_path, f"data.path={bad}")
    assert r.returncode != 0
    assert "bad.jsonl:2: not valid JSON" in r.stderr


class _S:
    def __init__(self, v):
        self.completion = type("C", (), {"weight_version": v})()


def test_samples_from_stale_weights_are_refused():
    rollout = type("R", (), {"groups": [[_S("4"), _S("3")]]})()
    with pytest.raises(StaleWeightsError, match=r"weight version\(s\) \['3', '4'\], expected 4"):
        check_versions(rollout, "4", rank=1)
    check_versions(type("R", (), {"groups": [[_S("4")]]})(), "4", rank=0)


@pytest.mark.parametrize(
    "algo",
    [
        # GSPO's sequence ratio (its paper's clip range), DAPO's overlong filter, soft penalty and
        # dynamic sampling, at 3 new tokens so some responses are cut at the limit; packed
        # micro-batches.
        [
            "algo.importance_level=sequence",
            "algo.clip_eps_low=3e-4",
            "algo.clip_eps_high=4e-4",
            "rollout.max_new_tokens=3",
            "algo.overlong_filter=true",
            "algo.overlong_buffer=1",
            "algo.dynamic_sampling=true",
            "algo.dynamic_sampling_max_batches=6",
            "trainer.max_tokens_per_micro_batch=256",  # padding-free, on two sharded ranks
        ],
        # CISPO with MiniMax-M1's one-sided weight clip; REINFORCE++ normalised over both ranks.
        [
            "algo.policy_loss=cispo",
            "algo.clip_eps_low=1.0",
            "algo.clip_eps_high=2.0",
            "algo.advantage=reinforce_plus_plus",
        ],
    ],
    ids=["gspo-dapo", "cispo-reinforce++"],
)
def test_the_quickstart_runs_with_each_algorithm(tmp_path, algo):
    r = run_quickstart(tmp_path, *algo)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["generation_failed"] == 0 and row["logp_diff_engine_trainer"] < 1e-3
        assert math.isfinite(row["loss"]) and row["grad_norm"] >= 0
    if "algo.dynamic_sampling=true" in algo:
        for row in rows:
            # No zero-advantage group in any train batch, and the over-sampling counted.
            assert row["groups_zero_advantage"] == 0, row
            assert row["dynamic_groups_sampled"] == 8 * row["dynamic_batches"], row
            assert row["dynamic_groups_kept"] <= 8 and row["samples_trained"] == 8 * row["dynamic_groups_kept"], row
            parts = ("kept", "zero_advantage", "surplus")
            accounted = sum(row[f"dynamic_groups_{k}"] for k in parts) + row["groups_dropped"]
            assert row["dynamic_groups_sampled"] == accounted, row
            assert row["overlong_filtered"] >= 0 and row["overlong_penalty"] <= 0
        assert any(row["dynamic_batches"] > 1 for row in rows)  # near chance most groups score all 0
