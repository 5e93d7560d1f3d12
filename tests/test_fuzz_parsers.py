"""bench/studies/fuzz_parsers.py with a small count: no parser raises, returns the wrong type or
runs over its time limit, on fuzzed inputs or on long adversarial ones. Started as the
README calls it, `python bench/studies/fuzz_parsers.py`, from another folder."""
import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "studies" / "fuzz_parsers.py"


def test_fuzz_script_finds_no_exception_and_no_slow_input(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "fuzz.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--count", "150", "--long-kb", "16",
                          "--max-seconds", "5", "--json", str(out)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-1500:]
    assert "exceptions: toolcalls 0, donation 0, vs 0, vs_fallback 0" in run.stdout
    results = json.loads(out.read_text())
    assert set(results) == {"toolcalls", "donation", "vs", "vs_fallback"}
    for r in results.values():
        assert r["long"]["failures"] == 0 and r["long"]["s_per_kb"] < 0.05   # 50 ms/KB: generous
