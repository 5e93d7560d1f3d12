"""The "cublas" backend (cuBLAS logits + one Triton row pass + cuBLAS dx) agrees with PyTorch.

As in tests/test_triton_logprobs.py, the numeric checks run once, in a subprocess: on a CPU
machine in Triton's interpreter (TRITON_INTERPRET=1 must be set before Triton is imported, and
the other test files must not see it), on a CUDA machine with the compiled kernel. Shapes are
tiny and ragged (V = 70 against 32-column blocks: three block steps, the last one part empty).
A second subprocess compiles the row kernel for sm_86 and sm_90 ahead of time (no GPU needed).

    TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_cublas_logprobs.py       # CPU numbers
    PYTHONPATH=. python tests/test_cublas_logprobs.py cuda                      # GPU numbers
    PYTHONPATH=. python tests/test_cublas_logprobs.py compile
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
EPS_LOW, EPS_HIGH = 0.2, 0.28


def numeric_checks(device: str = "cpu") -> dict:
    """{name: value} of every comparison; inputs drawn on the CPU, then moved to `device`."""
    import torch

    from minscope import cublas_logprobs as cl
    from minscope import grpo
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    v = 70

    def draw(n, h, seed, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, h, generator=gen).to(device, dtype)
        w = (torch.randn(v, h, generator=gen) * 2 / h ** 0.5).to(device, dtype)
        return x, w, torch.randint(0, v, (n,), generator=gen).to(device), gen

    def err(got, want):
        return (got.float() - want.float()).abs().max().item()

    def rel(got, want):
        return err(got, want) / want.float().abs().max().item()

    out = {}
    # --- the row kernel on its own: statistics, gradient in place (fp32 and bf16 over fp32)
    x, w, y, gen = draw(9, 16, seed=1)
    temperature = 0.7
    log_p = torch.log_softmax(x @ w.T / temperature, -1)
    logp, lse, entropy = cl.row_stats(cl.chunk_logits(x, w), y, temperature)
    out["rows/logp"] = err(logp, log_p.gather(1, y[:, None]).squeeze(1))
    out["rows/lse"] = err(lse, torch.logsumexp(x @ w.T / temperature, -1))
    out["rows/entropy"] = err(entropy, -(log_p.exp() * log_p).sum(-1))
    dlogp = torch.randn(9, generator=gen).to(device)
    dlogp[3] = 0.0                                              # an untrained token
    want = dlogp[:, None] * (torch.nn.functional.one_hot(y, v) - log_p.exp()) / temperature
    for dtype in (torch.float32, torch.bfloat16):
        name = f"rows/grad/{str(dtype)[6:]}"
        z = cl.chunk_logits(x, w)
        g = cl.grad_in_place(z, y, lse, dlogp, temperature, dtype)
        out[f"{name}/in_place"] = float(g.data_ptr() == z.data_ptr() and g.dtype == dtype
                                        and g.shape == (9, v))
        out[f"{name}/rel"] = rel(g, want)
        out[f"{name}/zero_row"] = float((g[3] == 0).all())

    # --- dloss/dlogp of the GRPO token loss, worked out in the kernel: against autograd.
    # Some ratios clipped, some not; untrained tokens (weight 0) with a wild reference there.
    n = 16
    x, w, y, gen = draw(n, 16, seed=2)
    logp0 = torch.log_softmax(x @ w.T, -1).gather(1, y[:, None]).squeeze(1)
    old = logp0 + 0.5 * torch.randn(n, generator=gen).to(device)
    tw = (torch.rand(n, generator=gen) > 0.25).float().to(device) / n
    ref = torch.where(tw == 0, logp0 + 200.0, logp0 + 0.3 * torch.randn(n, generator=gen).to(device))
    adv = torch.randn(n, generator=gen).to(device)
    out["grpo_dlogp/untrained_count"] = float((tw == 0).sum())
    for beta in (0.0, 0.1):
        lp = logp0.clone().requires_grad_(True)
        per_token, _, clipped = grpo.token_loss(lp, old, ref, adv, EPS_LOW, EPS_HIGH, beta, mask=tw)
        (want_dlogp,) = torch.autograd.grad((tw * per_token).sum(), lp)
        *_, got_dlogp, g = cl.grpo_in_place(cl.chunk_logits(x, w), y, old, ref if beta else None, adv, tw,
                                           EPS_LOW, EPS_HIGH, beta)
        trained = tw != 0
        out[f"grpo_dlogp/beta={beta}/some_clipped"] = float(clipped[trained].any() and not clipped[trained].all())
        out[f"grpo_dlogp/beta={beta}/err"] = err(got_dlogp, want_dlogp)
        out[f"grpo_dlogp/beta={beta}/untrained_zero"] = float((g[~trained] == 0).all() and (got_dlogp[~trained] == 0).all())

    # --- token_logprobs: cublas against torch, [3, 7] tokens in chunks of 8
    for dtype in (torch.float32, torch.bfloat16):
        name = f"token_logprobs/{str(dtype)[6:]}"
        x, w, _, gen = draw(21, 16, seed=3, dtype=dtype)
        hidden = x.view(3, 7, 16).requires_grad_(True)
        weight = w.requires_grad_(True)
        targets = torch.randint(0, v, (3, 7), generator=gen).to(device)
        cot = torch.randn(3, 7, generator=gen).to(device)
        logp, entropy = token_logprobs(hidden, weight, targets, 0.8, return_entropy=True, chunk_size=8,
                                       backend="cublas")
        d_hidden, d_weight = torch.autograd.grad((cot * logp).sum(), (hidden, weight))
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(True)
        ref_logp, ref_entropy = token_logprobs(h32, w32, targets, 0.8, return_entropy=True, chunk_size=8,
                                               backend="torch")
        ref_dh, ref_dw = torch.autograd.grad((cot * ref_logp).sum(), (h32, w32))
        out[f"{name}/shape_ok"] = float(logp.shape == (3, 7) and logp.dtype == torch.float32
                                        and d_hidden.dtype == dtype)
        out[f"{name}/logp"] = err(logp, ref_logp)
        out[f"{name}/entropy"] = err(entropy, ref_entropy)
        out[f"{name}/d_hidden_rel"] = rel(d_hidden, ref_dh)
        out[f"{name}/d_weight_rel"] = rel(d_weight, ref_dw)
        with torch.no_grad():                              # forward only: no autograd node
            fwd = token_logprobs(hidden, weight, targets, 0.8, chunk_size=8, backend="cublas")
        out[f"{name}/forward_only_logp"] = err(fwd, ref_logp)
        out[f"{name}/forward_only_no_graph"] = float(fwd.grad_fn is None and not fwd.requires_grad)

    # --- fused GRPO loss: cublas against torch (beta > 0, clipped tokens, untrained tokens)
    for dtype, head in [(torch.float32, "trainable"), (torch.bfloat16, "frozen")]:
        name = f"fused_grpo/{str(dtype)[6:]}/{head}"
        trainable = head == "trainable"
        x, w, y, gen = draw(n, 16, seed=2, dtype=dtype)
        hidden, weight = x.requires_grad_(True), w.requires_grad_(trainable)
        loss, logp, entropy = fused_grpo_token_loss(hidden, weight, y, old, ref, adv, tw, beta=0.1,
                                                    temperature=0.8, chunk_size=16, backend="cublas")
        d_hidden, *d_weight = torch.autograd.grad(loss, (hidden, weight) if trainable else (hidden,))
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(trainable)
        ref_loss, ref_logp, ref_entropy = fused_grpo_token_loss(h32, w32, y, old, ref, adv, tw, beta=0.1,
                                                                temperature=0.8, chunk_size=16, backend="torch")
        ref_dh, *ref_dw = torch.autograd.grad(ref_loss, (h32, w32) if trainable else (h32,))
        out[f"{name}/loss"] = err(loss, ref_loss)
        out[f"{name}/logp"] = err(logp, ref_logp)
        out[f"{name}/entropy"] = err(entropy, ref_entropy)
        out[f"{name}/d_hidden_rel"] = rel(d_hidden, ref_dh)
        out[f"{name}/untrained_rows_zero"] = float((d_hidden[tw == 0] == 0).all())
        if trainable:
            out[f"{name}/d_weight_rel"] = rel(d_weight[0], ref_dw[0])
    return out


# Shared memory per block (opt-in maximum) of the GPUs we compile for.
SHARED_MEMORY = {86: 99 * 1024, 90: 227 * 1024}


def compile_checks() -> dict:
    """Compile the row kernel in each mode for sm_86 and sm_90 with the CUDA launch settings:
    fp32 logits, a bf16 gradient. Returns shared memory and the count of barriers in the PTX."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minscope import cublas_logprobs as cl

    cfg = cl.launch_config(torch.device("cuda"))
    sig = dict(z_ptr="*fp32", g_ptr="*bf16", y_ptr="*i64", lse_ptr="*fp32", logp_ptr="*fp32",
               ent_ptr="*fp32", dlogp_ptr="*fp32", old_ptr="*fp32", ref_ptr="*fp32", adv_ptr="*fp32",
               tw_ptr="*fp32", V="i32", stride_z="i32", stride_g="i32", inv_temp="fp32",
               eps_low="fp32", eps_high="fp32", beta="fp32", MODE="constexpr", WANT_ENTROPY="constexpr",
               HAS_REF="constexpr", BLOCK_V="constexpr")
    aligned = {"z_ptr", "g_ptr", "V", "stride_z", "stride_g"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig) if arg in aligned}
    out = {}
    for arch in SHARED_MEMORY:
        for mode, name in ((cl.MODE_STATS, "stats"), (cl.MODE_GRAD, "grad"), (cl.MODE_GRPO, "grpo")):
            src = ASTSource(fn=cl._logit_rows_kernel, signature=sig, attrs=attrs, constexprs=dict(
                MODE=mode, WANT_ENTROPY=True, HAS_REF=mode == cl.MODE_GRPO, BLOCK_V=cfg["block_v"]))
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=cfg["num_warps"], num_stages=1))
            ptx = compiled.asm["ptx"]
            out[f"sm{arch}/{name}/shared"] = compiled.metadata.shared
            out[f"sm{arch}/{name}/barriers"] = ptx.count("bar.sync") + ptx.count("barrier.sync")
    return out


def run_script(mode: str, interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, __file__, mode], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{mode} checks failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def errors():
    import torch
    if torch.cuda.is_available():      # the compiled kernel on the GPU, not the interpreter
        return run_script("cuda", interpret=False)
    return run_script("interpret", interpret=True)


@pytest.fixture(scope="module")
def compiled():
    return run_script("compile", interpret=False)


FP32_TOL, BF16_GRAD_REL = 2e-5, 1e-2


def test_row_pass_statistics_match_exact_softmax(errors):
    for stat in ("logp", "lse", "entropy"):
        assert errors[f"rows/{stat}"] < FP32_TOL, stat


@pytest.mark.parametrize("dtype,tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_gradient_is_written_over_the_logits(errors, dtype, tol):
    assert errors[f"rows/grad/{dtype}/in_place"] == 1.0
    assert errors[f"rows/grad/{dtype}/rel"] < tol
    assert errors[f"rows/grad/{dtype}/zero_row"] == 1.0


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_kernel_grpo_derivative_matches_autograd_of_token_loss(errors, beta):
    name = f"grpo_dlogp/beta={beta}"
    assert errors[f"{name}/some_clipped"] == 1.0
    assert errors["grpo_dlogp/untrained_count"] >= 2          # and those rows are zeros, below
    assert errors[f"{name}/err"] < 1e-6
    assert errors[f"{name}/untrained_zero"] == 1.0


@pytest.mark.parametrize("dtype,grad_tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_cublas_token_logprobs_match_torch_path(errors, dtype, grad_tol):
    name = f"token_logprobs/{dtype}"
    assert errors[f"{name}/shape_ok"] == 1.0
    # the bar for log-probs is 1e-3 against fp32; fp32 logits keep it near rounding
    for stat in ("logp", "entropy", "forward_only_logp"):
        assert errors[f"{name}/{stat}"] < FP32_TOL, stat
    assert errors[f"{name}/forward_only_no_graph"] == 1.0
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    assert errors[f"{name}/d_weight_rel"] < grad_tol


@pytest.mark.parametrize("case,grad_tol", [("float32/trainable", FP32_TOL), ("bfloat16/frozen", BF16_GRAD_REL)])
def test_cublas_fused_grpo_matches_torch_path(errors, case, grad_tol):
    name = f"fused_grpo/{case}"
    for stat in ("loss", "logp", "entropy"):
        assert errors[f"{name}/{stat}"] < FP32_TOL, stat
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    assert errors[f"{name}/untrained_rows_zero"] == 1.0
    if case.endswith("trainable"):
        assert errors[f"{name}/d_weight_rel"] < grad_tol


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
@pytest.mark.parametrize("mode", ["stats", "grad", "grpo"])
def test_row_kernel_compiles_and_fits(compiled, arch, mode):
    assert compiled[f"sm{arch}/{mode}/shared"] <= SHARED_MEMORY[arch]


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
@pytest.mark.parametrize("mode", ["grad", "grpo"])
def test_in_place_gradient_keeps_its_barriers(compiled, arch, mode):
    """The two barriers before G overwrites the logits (after the statistics pass, and between
    each block's read and write) survive compilation: the gradient-only mode has no reduction,
    so its barriers are those two; the GRPO mode has them on top of the statistics pass's."""
    ours = 2
    if mode == "grad":
        assert compiled[f"sm{arch}/grad/barriers"] >= ours
    else:
        assert compiled[f"sm{arch}/grpo/barriers"] >= compiled[f"sm{arch}/stats/barriers"] + ours


def test_cublas_matches_torch_path_on_cuda():
    """The compiled row pass on a GPU at a ragged, realistic-width shape (skipped elsewhere)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 301, 256, 5003
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype).requires_grad_(True)
        weight = (torch.randn(v, h, device="cuda", generator=gen) / 8).to(dtype).requires_grad_(True)
        targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
        h32, w32 = hidden.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
        cot = torch.randn(n, device="cuda", generator=gen)
        logp = token_logprobs(hidden, weight, targets, 0.7, chunk_size=128, backend="cublas")
        ref_logp = token_logprobs(h32, w32, targets, 0.7, chunk_size=128, backend="torch")
        torch.testing.assert_close(logp, ref_logp, atol=1e-3, rtol=1e-4)
        for g, w in zip(torch.autograd.grad((cot * logp).sum(), (hidden, weight)),
                        torch.autograd.grad((cot * ref_logp).sum(), (h32, w32))):
            assert (g.float() - w).abs().max() <= 2e-2 * w.abs().max()
        old = ref_logp.detach() + 0.3 * torch.randn(n, device="cuda", generator=gen)
        adv, tw = torch.randn(n, device="cuda", generator=gen), torch.full((n,), 1.0 / n, device="cuda")
        loss, _, _ = fused_grpo_token_loss(hidden, weight.detach(), targets, old, old, adv, tw, beta=0.1,
                                           temperature=0.7, chunk_size=128, backend="cublas")
        ref_loss, _, _ = fused_grpo_token_loss(h32, w32.detach(), targets, old, old, adv, tw, beta=0.1,
                                               temperature=0.7, chunk_size=128, backend="torch")
        torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-3)
        (got,), (want,) = torch.autograd.grad(loss, (hidden,)), torch.autograd.grad(ref_loss, (h32,))
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "interpret"
    if mode in ("compile", "cuda"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit(f"{mode} checks need the real Triton: unset TRITON_INTERPRET")
        print(json.dumps(compile_checks() if mode == "compile" else numeric_checks("cuda")))
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run with TRITON_INTERPRET=1 (the kernel runs in the Triton interpreter on CPU)")
        print(json.dumps(numeric_checks("cpu")))
