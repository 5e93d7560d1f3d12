"""The Triton kernels agree with the torch path (run on CPU in the Triton interpreter).

The interpreter has to be switched on (TRITON_INTERPRET=1) before Triton is imported, and
the other test files in the same pytest process must not see it. So the checks run once,
in a subprocess: this file executed as a script computes every comparison and prints a
JSON dict of errors; the tests below each assert on their part of it. To see the numbers:

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_triton_logprobs.py

Shapes are tiny and odd (the interpreter runs each program in numpy); small block sizes
make the kernels walk several tiles along N, V and H, with ragged edges on each.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

REPO = Path(__file__).resolve().parents[1]
SMALL_TILES = dict(block_n=16, block_v=32, block_h=16)


def interpreter_checks() -> dict:
    """All comparisons, as {name: max error}; runs with TRITON_INTERPRET=1 (see __main__)."""
    import torch

    from minscope import grpo, triton_logprobs
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    def inputs(lead, h, v, dtype, seed, weight_grad=False):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(*lead, h, generator=gen).to(dtype).requires_grad_(True)
        weight = (torch.randn(v, h, generator=gen) * 2 / h ** 0.5).to(dtype).requires_grad_(weight_grad)
        targets = torch.randint(0, v, lead, generator=gen)
        return hidden, weight, targets

    def exact_log_softmax(hidden, weight, temperature):     # fp32 maths on the given values
        return torch.log_softmax(hidden.detach().float() @ weight.detach().float().T / temperature, -1)

    def err(got, want):
        return (got.float() - want.float()).abs().max().item()

    def rel(got, want):                                      # error relative to the largest entry
        return err(got, want) / want.float().abs().max().item()

    out = {}
    # --- the kernels themselves, several tiles and 3 vocab splits
    for dtype, temperature in [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)]:
        name = f"kernels/{str(dtype)[6:]}/T={temperature}"
        hidden, weight, targets = inputs((37,), 32, 300, dtype, seed=1)
        x, w = hidden.detach(), weight.detach()
        logp, lse, entropy = triton_logprobs.softmax_stats(x, w, targets, temperature, v_splits=3,
                                                           config=SMALL_TILES)
        log_p = exact_log_softmax(x, w, temperature)
        out[f"{name}/logp"] = err(logp, log_p.gather(1, targets[:, None]).squeeze(1))
        out[f"{name}/lse"] = err(lse, torch.logsumexp(x.float() @ w.float().T / temperature, -1))
        out[f"{name}/entropy"] = err(entropy, -(log_p.exp() * log_p).sum(-1))
        dlogp = torch.randn(37, generator=torch.Generator().manual_seed(2))
        grad = triton_logprobs.logit_grad(x, w, targets, lse, dlogp, temperature, config=SMALL_TILES)
        onehot = torch.nn.functional.one_hot(targets, 300).float()
        out[f"{name}/logit_grad_dtype_ok"] = float(grad.dtype == dtype)
        out[f"{name}/logit_grad_rel"] = rel(grad, dlogp[:, None] * (onehot - log_p.exp()) / temperature)

    # --- token_logprobs: triton backend vs torch backend (fp32 maths on the same values)
    for dtype in (torch.float32, torch.bfloat16):
        name = f"token_logprobs/{str(dtype)[6:]}"
        hidden, weight, targets = inputs((3, 11), 32, 300, dtype, seed=3, weight_grad=True)
        cot = torch.randn(3, 11, generator=torch.Generator().manual_seed(4))
        logp, entropy = token_logprobs(hidden, weight, targets, 0.8, return_entropy=True,
                                       chunk_size=16, backend="triton")
        d_hidden, d_weight = torch.autograd.grad((cot * logp).sum(), (hidden, weight))
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(True)
        ref_logp, ref_entropy = token_logprobs(h32, w32, targets, 0.8, return_entropy=True,
                                               chunk_size=16, backend="torch")
        ref_dh, ref_dw = torch.autograd.grad((cot * ref_logp).sum(), (h32, w32))
        out[f"{name}/shape_ok"] = float(logp.shape == (3, 11) and logp.dtype == torch.float32
                                        and d_hidden.dtype == dtype)
        out[f"{name}/logp"] = err(logp, ref_logp)
        out[f"{name}/entropy"] = err(entropy, ref_entropy)
        out[f"{name}/d_hidden_rel"] = rel(d_hidden, ref_dh)
        out[f"{name}/d_weight_rel"] = rel(d_weight, ref_dw)

    # --- fused GRPO loss: triton vs torch, beta > 0 and some ratios clipped
    for dtype in (torch.float32, torch.bfloat16):
        name = f"fused_grpo/{str(dtype)[6:]}"
        hidden, weight, targets = inputs((29,), 32, 300, dtype, seed=5, weight_grad=True)
        gen = torch.Generator().manual_seed(6)
        logp0 = exact_log_softmax(hidden, weight, 0.8).gather(1, targets[:, None]).squeeze(1)
        old, ref = logp0 + 0.5 * torch.randn(29, generator=gen), logp0 + 0.3 * torch.randn(29, generator=gen)
        adv, token_w = torch.randn(29, generator=gen), torch.rand(29, generator=gen) / 29
        loss, logp, _ = fused_grpo_token_loss(hidden, weight, targets, old, ref, adv, token_w, beta=0.1,
                                              temperature=0.8, chunk_size=16, backend="triton")
        d_hidden, d_weight = torch.autograd.grad(loss, (hidden, weight))
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(True)
        ref_loss, ref_logp, _ = fused_grpo_token_loss(h32, w32, targets, old, ref, adv, token_w, beta=0.1,
                                                      temperature=0.8, chunk_size=16, backend="torch")
        ref_dh, ref_dw = torch.autograd.grad(ref_loss, (h32, w32))
        clipped = grpo.token_loss(ref_logp, old, ref, adv, 0.2, 0.28, 0.1)[2]
        out[f"{name}/some_clipped"] = float(clipped.any() and not clipped.all())
        out[f"{name}/loss"] = err(loss, ref_loss)
        out[f"{name}/logp"] = err(logp, ref_logp)
        out[f"{name}/d_hidden_rel"] = rel(d_hidden, ref_dh)
        out[f"{name}/d_weight_rel"] = rel(d_weight, ref_dw)
    return out


@pytest.fixture(scope="module")
def errors():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Tolerances: fp32 paths agree to rounding. With bf16 inputs, values still use exact fp32
# products of the bf16 numbers; gradients pass through a bf16 G and a bf16 matmul (~1%).
FP32_TOL, BF16_GRAD_REL = 2e-5, 1e-2


@pytest.mark.parametrize("case", ["float32/T=1.0", "float32/T=0.7", "bfloat16/T=0.7"])
def test_forward_kernel_logp_lse_entropy_match_exact_softmax(errors, case):
    for stat in ("logp", "lse", "entropy"):
        assert errors[f"kernels/{case}/{stat}"] < FP32_TOL, stat


@pytest.mark.parametrize("case,tol", [("float32/T=1.0", FP32_TOL), ("float32/T=0.7", FP32_TOL),
                                      ("bfloat16/T=0.7", BF16_GRAD_REL)])
def test_logit_grad_kernel_matches_softmax_gradient(errors, case, tol):
    assert errors[f"kernels/{case}/logit_grad_dtype_ok"] == 1.0
    assert errors[f"kernels/{case}/logit_grad_rel"] < tol


@pytest.mark.parametrize("dtype,grad_tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_triton_token_logprobs_match_torch_path(errors, dtype, grad_tol):
    name = f"token_logprobs/{dtype}"
    assert errors[f"{name}/shape_ok"] == 1.0
    assert errors[f"{name}/logp"] < FP32_TOL
    assert errors[f"{name}/entropy"] < FP32_TOL
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    assert errors[f"{name}/d_weight_rel"] < grad_tol


@pytest.mark.parametrize("dtype,grad_tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_triton_fused_grpo_matches_torch_path(errors, dtype, grad_tol):
    name = f"fused_grpo/{dtype}"
    assert errors[f"{name}/some_clipped"] == 1.0
    assert errors[f"{name}/loss"] < FP32_TOL
    assert errors[f"{name}/logp"] < FP32_TOL
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    assert errors[f"{name}/d_weight_rel"] < grad_tol


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the kernels run in the Triton interpreter on CPU)")
    print(json.dumps(interpreter_checks()))
