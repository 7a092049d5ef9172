"""The package's structure holds: no import cycle, the layer contracts (pyproject.toml's
import-linter contracts, run by .ci/run) catch an upward import, and every private internal in
runtime/internals.py is still in the installed torch / transformers / megatron-core."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
import torch

from rltrain.runtime import internals

REPO = Path(__file__).resolve().parents[1]


def _cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import cycle between modules of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.find_modules_directly_imported_by(m)):
            if n not in graph.modules:
                continue
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph.modules):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle(monkeypatch):
    """rltrain and kernels/ (the directory pyproject maps to rltrain.kernels, which grimp does not
    follow: read here as the top-level package it is in the repository)."""
    monkeypatch.syspath_prepend(str(REPO))
    graph = grimp.build_graph("rltrain", "kernels")
    assert any(m.startswith("kernels.") for m in graph.modules)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_an_upward_import_breaks_a_layer_contract_naming_it(tmp_path):
    """A copy of the package where the runtime imports the loop: lint-imports fails and names the import."""
    shutil.copytree(REPO / "rltrain", tmp_path / "rltrain")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path).returncode == 0  # the copy as it is keeps every contract
    ledger = tmp_path / "rltrain" / "runtime" / "ledger.py"
    ledger.write_text(ledger.read_text() + "\nfrom rltrain.loop import run  # noqa\n")
    engine = tmp_path / "rltrain" / "engine" / "client.py"
    engine.write_text(engine.read_text() + "\nimport rltrain.sync.plan  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "rltrain.runtime.ledger -> rltrain.loop" in out.stdout
    assert "rltrain.engine.client -> rltrain.sync.plan" in out.stdout


def _lint(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(exe), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(root), "PATH": str(Path(sys.executable).parent)},
    )


@pytest.mark.parametrize("name", sorted(internals.REGISTRY))
def test_every_private_internal_is_in_this_install(name):
    entry = internals.REGISTRY[name]
    if entry.needs == "cuda" and not torch.backends.cuda.is_built():
        pytest.skip("exists only in CUDA builds of torch (checked on the H200 by test_gpu.py)")
    if entry.needs == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    assert internals.missing(entry) is None, internals.missing(entry)


def test_an_unregistered_or_removed_internal_is_refused_by_name():
    with pytest.raises(KeyError, match="not a registered"):
        internals.get("torch._some_private_thing")
    fake = internals.Internal("torch.distributed._gone_in_this_version", "nowhere", "a test", "torch 0.0")
    assert "torch.distributed._gone_in_this_version is missing" in internals.missing(fake)
    field = internals.Internal("torch.nn.Module._no_such_field", "nowhere", "a test", "torch 0.0", field=True)
    assert "no instance of Module gets '_no_such_field'" in internals.missing(field)
