"""Every bench script starts as the README and bench/gpu.sh call it: `python bench/X.py`,
from any folder, with no install and no PYTHONPATH."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_runs_from_anywhere_without_pythonpath(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(BENCH / script), "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]
    assert "usage" in run.stdout.lower()
