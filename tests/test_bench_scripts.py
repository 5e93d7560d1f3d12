"""Every bench script starts as the README and bench/gpu.sh call it: `python bench/X.py` (a study:
`python bench/studies/X.py`), from any folder, with no install and no PYTHONPATH."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


SCRIPTS = sorted(str(p.relative_to(BENCH)) for p in [*BENCH.glob("*.py"), *BENCH.glob("studies/*.py")])


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_runs_from_anywhere_without_pythonpath(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(BENCH / script), "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]
    assert "usage" in run.stdout.lower()


def test_step_benchmark_compares_the_kept_cache_with_re_prefilling(tmp_path):
    """bench/step.py on CPU, tiny settings: a full step per mode, and the prefill line (prefix
    sharing off: re-prefilling feeds every stream whole, as `generate` does)."""
    import json

    out = tmp_path / "step.json"
    run = subprocess.run([sys.executable, str(BENCH / "step.py"), "--device", "cpu", "--methods", "population",
                          "--turns", "3", "--turn-tokens", "6", "--tasks", "2", "--group-size", "2",
                          "--warmup", "0", "--modes", "kept,reprefill,generate", "--prefix-sharing", "off",
                          "--json", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-1500:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"kept", "reprefill", "generate"}
    assert {r["generated"] for r in rows.values()} == {2 * 2 * 3 * 2 * 6}      # generate too: fixed-length turns
    assert all(0 < r["sim_update_s"] < r["update_s"] and r["policy_update_s"] > 0 for r in rows.values())
    assert rows["kept"]["prefilled"] < 0.7 * rows["reprefill"]["prefilled"] == 0.7 * rows["generate"]["prefilled"]
    assert "re-prefilled (" in run.stdout and "% fewer)" in run.stdout
    assert "population: rollout tokens/s: kept " in run.stdout and "x generate" in run.stdout.splitlines()[-1]


def test_logprob_benchmark_runs_new_path_and_reports_missing_peers(tmp_path):
    """bench/logprobs.py on CPU at a tiny shape: the cublas GRPO path through Triton's
    interpreter, cuBLAS's bound, and a row for every peer, measured or saying why not."""
    import json

    out = tmp_path / "logprobs.json"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, str(BENCH / "logprobs.py"), "--device", "cpu", "--shapes", "32x16",
                          "--vocab", "64", "--chunk-size", "16", "--seq-len", "8",
                          "--methods", "bound-2mm", "grpo-cublas", "trl", "liger-grpo", "--json", str(out)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-1500:]
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"bound-2mm", "grpo-cublas", "trl", "liger-grpo"}
    new = rows["grpo-cublas"]
    assert new["err_logp"] < 1e-3 and new["err_grad"] < 1e-3 and new["err_loss"] < 1e-3
    assert new["x_bound"] > 0 and rows["bound-2mm"]["err_grad"] is None
    for peer in ("trl", "liger-grpo"):      # measured here, or a row that says why not
        assert "time_s" in rows[peer] or rows[peer]["skipped"], peer
        line = next(ln for ln in run.stdout.splitlines() if ln.startswith(peer))
        assert "ms" in line or "unavailable: cannot import" in line or "failed:" in line
    assert "Triton kernels in the interpreter" in run.stdout


def test_every_bench_script_has_a_line_in_bench_readme():
    """bench/README.md says, per script, what it measures and how long it takes (a study: what it
    measured): a new script without its line there fails here."""
    rows = [line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1] for line in rows}
    scripts = {str(p.relative_to(BENCH)) for pattern in ("*.py", "*.sh", "studies/*.py", "studies/*.sh")
               for p in BENCH.glob(pattern)}
    assert scripts - listed == set(), "add a line to bench/README.md for each"
    assert listed - scripts == set(), "bench/README.md lists scripts that no longer exist"


def test_bench_keeps_at_most_twelve_top_level_scripts():
    """bench/ holds the benchmarks a user runs; one-off studies live in bench/studies/."""
    top = [p.name for pattern in ("*.py", "*.sh") for p in BENCH.glob(pattern)]
    assert len(top) <= 12, f"bench/ has {len(top)} scripts: move the one-off studies to bench/studies/"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_top_level_benchmark_prints_the_command_behind_its_figures(script):
    """Each benchmark's output starts (or, for laptop.py, ends) with `command: python bench/X.py ...`,
    so that figures pasted from it say how to reproduce them."""
    assert f'"python", "bench/{script}"' in (BENCH / script).read_text()
