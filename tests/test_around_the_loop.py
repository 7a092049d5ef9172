"""What a researcher expects around the loop (#53), end to end under torchrun: evaluation during
training, experiment trackers (W&B offline, MLflow on a local store), datasets as users have them.
(Apart from test_loop.py so that the test runner's two workers share the jobs.)"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from test_loop import run_quickstart


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


def test_a_parquet_dataset_with_a_prompt_too_long_on_one_ranks_share_stops_every_rank(tmp_path):
    """A parquet dataset goes through its Arrow copy in the run directory; the prompts' check is
    shared over the ranks, and a prompt too long in rank 1's share stops both ranks before any
    engine starts, each naming the record."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from rltrain.rollout.synthetic import addition_records

    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in addition_records()]
    rows[41]["question"] = " + ".join(["1"] * 12) + " ="
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "addition.parquet", row_group_size=16)
    r = run_quickstart(
        tmp_path,
        f"data.path={tmp_path / 'addition.parquet'}",
        "data.fields={prompt: question}",
        "data.max_prompt_tokens=16",
    )
    assert r.returncode != 0
    message = "addition.parquet record 41: prompt has 25 tokens, more than data.max_prompt_tokens=16"
    assert r.stderr.count(message) >= 2, r.stderr[-4000:]
    assert len(list((tmp_path / "quickstart" / "data" / "cache").glob("addition.*.arrow"))) == 1
    assert not (tmp_path / "quickstart" / "metrics.jsonl").exists()


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


def test_evaluation_and_the_trackers_through_a_stop_and_a_resume(tmp_path):
    """eval every 2 steps and before training, 4 samples a prompt at temperature 1, with W&B
    (offline) and MLflow (a local store); the job stopped after step 2 and resubmitted.

    - eval.jsonl holds the weights of steps 0, 2 and 4 judged on all 100 prompts (pass@1, 2, 4
      and the reward); the resumed job evaluated step 2's weights again with the same results
      as the first attempt (seeded), that row moved aside first; the eval phase is timed in the
      rows of the steps it ran before; eval.png is drawn.
    - W&B's offline run file holds each step's row (phase times as time/<phase>), the evals and
      the resolved config; the resumed job logged into the same run id.
    - MLflow holds the same by step (pass@k as pass_at_k), the config as parameters and
      config.json, in the same run for both attempts."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    store = f"file:{tmp_path / 'mlruns'}"
    args = (
        *EVAL,
        "loop.steps=4",
        "checkpoint.interval=2",
        "metrics.wandb.project=rltrain-test",
        f"metrics.mlflow.tracking_uri={store}",
    )
    r = run_quickstart(tmp_path, *args, "loop.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    run_dir = tmp_path / "quickstart"
    first = _eval_rows(run_dir / "eval.jsonl")
    assert [row["step"] for row in first] == [0, 2]
    r = run_quickstart(tmp_path, *args, "metrics.plot=true")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "resumed from" in r.stderr, r.stderr[-3000:]

    evals = _eval_rows(run_dir / "eval.jsonl")
    assert [row["step"] for row in evals] == [0, 2, 4]
    for row in evals:
        assert row["eval/prompts"] == 100 and row["eval/samples"] == 400 and row["eval/generation_failed"] == 0
        assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= row["eval/pass@4"] <= 1
        assert row["step"] == 0 or row["weight_version"] == str(row["step"])  # (step 0: the engine's first)
    moved = _eval_rows(run_dir / "eval.dropped.jsonl")
    assert [row["step"] for row in moved] == [2]
    same = lambda row: {k: v for k, v in row.items() if k != "eval/seconds"}  # noqa: E731
    assert same(moved[0]) == same(evals[1]) == same(first[1])
    rows = {json.loads(line)["step"]: json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert ["eval" in rows[step]["time"] for step in (1, 2, 3, 4)] == [True, False, True, False]
    assert (run_dir / "eval.png").is_file()

    run_id = (run_dir / "wandb-run-id").read_text().strip()
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2
    logged: dict[int, dict] = {}
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                assert rec.run.run_id == run_id and rec.run.project == "rltrain-test"
                config = {u.key: json.loads(u.value_json) for u in rec.run.config.update}
                assert config["run"]["name"] == "quickstart" and config["data"]["prompts_per_step"] == 8
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                logged.setdefault(items["_step"], {}).update(items)
    assert sorted(logged) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert logged[step]["reward_mean"] == pytest.approx(rows[step]["reward_mean"])
        assert logged[step]["time/step"] == pytest.approx(rows[step]["time"]["step"])
    for row in evals:
        assert logged[row["step"]]["eval/pass@1"] == pytest.approx(row["eval/pass@1"])

    import mlflow

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    run_id = (run_dir / "mlflow-run-id").read_text().strip()
    params = client.get_run(run_id).data.params
    assert params["run.name"] == "quickstart" and params["data.prompts_per_step"] == "8"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "reward_mean")}
    assert history == pytest.approx({step: row["reward_mean"] for step, row in rows.items()})
    assert sorted(m.step for m in client.get_metric_history(run_id, "time/step")) == [1, 2, 3, 4]
    by_step = {m.step: m.value for m in client.get_metric_history(run_id, "eval/pass_at_1")}
    assert by_step == pytest.approx({row["step"]: row["eval/pass@1"] for row in evals})
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(tmp_path))).read_text())
    assert config["metrics"]["mlflow"]["tracking_uri"] == store


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
