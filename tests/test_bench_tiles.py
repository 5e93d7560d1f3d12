"""bench/tiles.py in Triton's interpreter: every candidate config runs and reproduces the default."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
REPO = Path(__file__).resolve().parents[1]


def test_tile_sweep_runs_in_the_interpreter(tmp_path):
    out = tmp_path / "tiles.json"
    # run as bench/gpu.sh runs it: `python bench/tiles.py`, no PYTHONPATH, from any folder
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "bench" / "tiles.py"), "--device", "cpu", "--tokens", "8", "--hidden", "40",
           "--vocab", "300", "--dtype", "float32", "--max-configs", "3", "--reps", "1", "--json", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    for kernel in ("stats", "dx"):
        rows = res[kernel]
        assert len(rows) == 3 and all("ms" in r for r in rows), rows
        assert max(r["rel_err"] for r in rows) < 1e-5          # every config computes the same thing
        assert res[f"best_{kernel}"]["ms"] == min(r["ms"] for r in rows)
    assert "| dx kernel config |" in run.stdout and "best stats" in run.stdout
