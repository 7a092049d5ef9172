"""The load benchmark (rltrain.bench.load) runs both paths on real ranks and reports them; the
shapes it builds are the released Qwen3 models' (its full runs are recorded in BENCHMARKS.md)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from rltrain.bench.load import PATHS, run
from rltrain.bench.models import QWEN3_SHAPES, cut, qwen3_config

ROW = re.compile(r"^\s*(.+?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+-\s+([\d.]+)\s+([\d.]+)\s+(\S.*)$")


def test_load_bench_reports_both_paths_per_rank_with_equal_shards(tmp_path):
    lines = run("tiny", None, 2, "cpu", "auto", "cold", tmp_path, list(PATHS), timeout=120)
    report = "\n".join(lines)
    assert lines[0].startswith("# rltrain.bench.load"), report
    assert "limits (same run)" in report and "cold cache" in report and "# goals:" in report, report
    rows = [m.groups() for line in lines if (m := ROW.match(line))]
    assert sorted((path, int(rank)) for path, rank, *_ in rows) == sorted(
        (label, r) for label in PATHS.values() for r in range(2)
    ), report
    for path, _, host, anon, shard, seconds, shards in rows:
        assert float(host) > 0 and float(shard) > 0 and float(seconds) > 0, report
        assert float(anon) >= 0, report
        # Each rank's shards from the trainer's own load equal those of the full read.
        assert shards == ("-" if path == PATHS["full"] else "= full"), report
    for label in PATHS.values():  # a summary per path, against the goals
        assert sum(line.lstrip().startswith(f"{label}: host RSS") for line in lines) == 1, report


@pytest.mark.parametrize(
    ("shape", "non_embedding"),
    # The model cards' "Number of Parameters (Non-Embedding)", in billions.
    [("4b", 3.6), ("8b", 6.95), ("14b", 13.2), ("30b-a3b", 29.9)],
)
def test_qwen3_shapes_have_the_released_models_parameter_counts(shape, non_embedding):
    s = QWEN3_SHAPES[shape]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(qwen3_config(s))
    total = sum(p.numel() for p in model.parameters())  # tied weights once
    embedding = model.get_input_embeddings().weight.numel() * (1 if s.tied else 2)
    assert round((total - embedding) / 1e9, 2 if shape == "8b" else 1) == non_embedding
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if shape == "30b-a3b" else "Qwen3ForCausalLM")


def test_a_cut_keeps_the_widths_and_refuses_more_layers_than_the_shape_has():
    four = cut(QWEN3_SHAPES["8b"], 4)
    assert four.layers == 4 and four.hidden == QWEN3_SHAPES["8b"].hidden
    assert cut(QWEN3_SHAPES["8b"], None) is QWEN3_SHAPES["8b"]
    with pytest.raises(ValueError, match="1 to 36"):
        cut(QWEN3_SHAPES["8b"], 37)
