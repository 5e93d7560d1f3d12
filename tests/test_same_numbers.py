"""The toy's numbers are a function of code, settings and seed only: the same records and the
same trained parameters, bit for bit, whatever the CPU's vector unit, its BLAS code path and
the number of threads (minscope/precision.py).

Each configuration trains the tiny models and runs short sampled arms in a process of its own
(torch reads ATEN_CPU_CAPABILITY, and MKL reads MKL_CBWR, once, at start-up). Two knobs reach
different kernels: ATEN_CPU_CAPABILITY picks ATen's own vectorized kernels (softmax, exp,
sums), but not the BLAS, whose float64 matmuls are bit-identical under `default` and `avx512`;
MKL_CBWR=COMPATIBLE makes MKL take its plain code path, as on another CPU, and does change
them (docs/DESIGN_NOTES.md, "The same numbers on every CPU"). Where torch's BLAS is not MKL,
MKL_CBWR is left out (it would do nothing). The records must be identical, timings aside, and so
must every trained parameter (torch.equal): without `round_parameters` the parameters drift
apart by ~1e-7 while the 6-digit records may still agree. (The initial LoRA A matrices, which
torch's float32 `uniform_` draws one ulp apart on different vector units, are drawn by the
harness the same on every CPU: tests/_same_numbers_arm.py.)"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ARM = Path(__file__).parent / "_same_numbers_arm.py"
METHODS = ("single", "vs", "population")      # sampled policies; VS's parsed distribution; a trained pool


def blas_is_mkl() -> bool:
    return torch.backends.mkl.is_available() and "BLAS_INFO=mkl" in torch.__config__.show()


def run(tmp_path, name, capability, threads, cbwr=None):
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env.update(ATEN_CPU_CAPABILITY=capability, PYTHONHASHSEED=str(len(name)), **({"MKL_CBWR": cbwr} if cbwr else {}))
    done = subprocess.run([sys.executable, str(ARM), str(tmp_path / name), str(threads), *METHODS],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _tensors(obj, name: str, out: dict) -> None:
    if isinstance(obj, torch.Tensor):
        out[name] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{name}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{name}[{i}]", out)


def parameters(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter a configuration trained and saved: the tiny models in its cache, and
    each arm's adapters (the policy's, a trained simulator's, a population's snapshots)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(folder.rglob("*.safetensors")):
        _tensors(load_file(path), str(path.relative_to(folder)), out)
    for path in sorted(folder.rglob("*.pt")):
        state = torch.load(path, weights_only=False)
        for key in ("policy", "simulator", "population"):
            _tensors(state.get(key), f"{path.relative_to(folder)}:{key}", out)
    return out


def test_the_same_records_and_parameters_on_every_vector_unit_blas_path_and_thread_count(tmp_path):
    # plain ATen kernels, MKL's plain code path and one thread against the machine's own (avx512,
    # avx2, ...) on two: every difference at once (the two processes run side by side)
    best = torch.backends.cpu.get_cpu_capability().lower()
    plain_blas = "COMPATIBLE" if blas_is_mkl() else None
    with ThreadPoolExecutor(2) as pool:
        plain, native = pool.map(lambda c: run(tmp_path, *c), [("plain", "default", 1, plain_blas),
                                                               (best, best, 2)])
    assert len(plain) > 10 and {r["kind"] for r in plain} >= {"train", "eval", "pool"}
    assert {r["method"] for r in plain if r["kind"] == "train"} == set(METHODS)
    assert len(native) == len(plain)
    for a, b in zip(plain, native):
        assert a == b, f"{a.get('method')} step {a.get('step')} ({a['kind']}): " + ", ".join(
            f"{k}: {a[k]!r} vs {b.get(k)!r}" for k in a if a[k] != b.get(k))[:600]
    ours, theirs = parameters(tmp_path / "plain"), parameters(tmp_path / best)
    assert len(ours) > 100 and ours.keys() == theirs.keys()
    differ = {k: (ours[k].double() - theirs[k].double()).abs().max().item() for k in ours
              if not torch.equal(ours[k], theirs[k])}
    assert not differ, (f"{len(differ)} of {len(ours)} parameter tensors differ, by up to "
                        f"{max(differ.values()):.2g}: " + ", ".join(list(differ)[:5]))
