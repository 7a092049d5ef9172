"""The World under a real torchrun agent: the base store is torchrun's own TCPStore."""

import json
import subprocess
import sys
from pathlib import Path

from rltrain.runtime.net import free_port

HERE = Path(__file__).resolve().parent


def test_destroy_rebuild_under_torchrun(tmp_path):
    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(HERE / "torchrun_world_script.py"),
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["agent_store"] == "True"  # torchrun hosted the store; ranks were clients
    assert res["sums"] == [3.0, 3.0, 3.0]
    assert res["gens"] == [3, 3]
