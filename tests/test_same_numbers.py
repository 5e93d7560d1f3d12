"""The toy's numbers are a function of code, settings and seed only: the same records whatever
the CPU's vector unit (ATEN_CPU_CAPABILITY) and the number of threads (minscope/precision.py).

Each configuration trains the tiny models and runs short sampled arms in a process of its own
(torch reads ATEN_CPU_CAPABILITY once, at import); the records must be identical, timings aside.
On a CPU whose best kernels are the plain ones the capabilities coincide and the threads remain."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ARM = Path(__file__).parent / "_same_numbers_arm.py"
METHODS = ("single", "vs", "population")      # sampled policies; VS's parsed distribution; a trained pool


def run(tmp_path, name, capability, threads):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "PYTHONHASHSEED": str(len(name))}
    done = subprocess.run([sys.executable, str(ARM), str(tmp_path / name), str(threads), *METHODS],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_same_records_on_every_vector_unit_and_thread_count(tmp_path):
    # plain kernels on one thread against the machine's own (avx512, avx2, ...) on two: both
    # differences at once (the two processes run side by side)
    best = torch.backends.cpu.get_cpu_capability().lower()
    with ThreadPoolExecutor(2) as pool:
        plain, native = pool.map(lambda c: run(tmp_path, *c), [("plain", "default", 1), (best, best, 2)])
    assert len(plain) > 10 and {r["kind"] for r in plain} >= {"train", "eval", "pool"}
    assert {r["method"] for r in plain if r["kind"] == "train"} == set(METHODS)
    assert len(native) == len(plain)
    for a, b in zip(plain, native):
        assert a == b, f"{a.get('method')} step {a.get('step')} ({a['kind']}): " + ", ".join(
            f"{k}: {a[k]!r} vs {b.get(k)!r}" for k in a if a[k] != b.get(k))[:600]
