"""The Triton kernels agree with the torch path, and compile for real GPUs.

Two kinds of checks, neither needing a GPU:

* Numerics. On a machine without a GPU they run in the Triton interpreter, which has to be
  switched on (TRITON_INTERPRET=1) before Triton is imported, and the other test files in
  the same pytest process must not see it. So the checks run once, in a subprocess: this
  file run as a script computes every comparison and prints a JSON dict of errors; the
  tests below each assert on their part of it. Shapes are tiny and odd (the interpreter
  runs each program in numpy); small tiles make the kernels walk several tiles along N, V
  and H, with ragged edges on each. On a machine with a CUDA GPU the same checks run on
  the compiled kernels instead (and the interpreter is not used). To see the numbers:

      TRITON_INTERPRET=1 PYTHONPATH=. python tests/test_triton_logprobs.py      # CPU
      PYTHONPATH=. python tests/test_triton_logprobs.py cuda                     # GPU

* Compilation. Triton ships its own ptxas, so the kernels can be compiled ahead of time
  for sm_86 (consumer Ampere) and sm_90 (Hopper) on a CPU-only machine: this catches what
  the interpreter cannot (type errors in the GPU lowering, shared memory overflow, a
  bf16 dot falling back from tensor cores).

      PYTHONPATH=. python tests/test_triton_logprobs.py compile
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
SMALL_TILES = dict(block_n=16, block_v=32, block_h=16, dx_block_n=16, dx_block_h=16, dx_block_v=16)


def numeric_checks(device: str = "cpu") -> dict:
    """All comparisons, as {name: max error}: on "cpu" in the interpreter (TRITON_INTERPRET=1),
    on "cuda" with the compiled kernels (see __main__). Inputs are drawn on the CPU, so both
    see the same numbers."""
    import torch

    from minscope import grpo, triton_logprobs
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    def randn(*shape, seed):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)

    def inputs(lead, h, v, dtype, seed, weight_grad=False):
        gen = torch.Generator().manual_seed(seed)
        hidden = torch.randn(*lead, h, generator=gen).to(device, dtype).requires_grad_(True)
        weight = (torch.randn(v, h, generator=gen) * 2 / h ** 0.5).to(device, dtype).requires_grad_(weight_grad)
        targets = torch.randint(0, v, lead, generator=gen).to(device)
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
        dlogp = randn(37, seed=2)
        grad = triton_logprobs.logit_grad(x, w, targets, lse, dlogp, temperature, config=SMALL_TILES)
        onehot = torch.nn.functional.one_hot(targets, 300).float()
        out[f"{name}/logit_grad_dtype_ok"] = float(grad.dtype == dtype)
        out[f"{name}/logit_grad_rel"] = rel(grad, dlogp[:, None] * (onehot - log_p.exp()) / temperature)
        # the fused GRPO path: the same kernel also stores exp(z - m) and the tile maxes m
        *stats, stored = triton_logprobs.softmax_stats(x, w, targets, temperature, v_splits=3,
                                                       config=SMALL_TILES, store_probs=True)
        out[f"{name}/stored_dtype_ok"] = float(stored.p.dtype == dtype)
        out[f"{name}/stored_stats_same"] = max(err(a, b) for a, b in zip(stats, (logp, lse, entropy)))
        block_v = SMALL_TILES["block_v"]
        scale = torch.exp(stored.tile_max - lse[:, None]).repeat_interleave(block_v, 1)[:, :300]
        out[f"{name}/stored_probs"] = err(stored.p.float() * scale, log_p.exp())
        want = dlogp[:, None] * (onehot - log_p.exp()) / temperature
        grad2 = triton_logprobs.grad_from_probs(stored, targets, lse, dlogp, temperature, block_n=8)
        out[f"{name}/grad_from_probs_rel"] = rel(grad2, want)
        for splits in (1, 3):   # dx = G @ W with G made inside the matmul, whole vocab or 3 slices
            dx = triton_logprobs.dx_from_probs(stored, targets, lse, dlogp, w, temperature,
                                               v_splits=splits, config=SMALL_TILES)
            out[f"{name}/dx_from_probs_dtype_ok/{splits}"] = float(dx.dtype == dtype and dx.shape == x.shape)
            out[f"{name}/dx_from_probs_rel/{splits}"] = rel(dx, want @ w.float())

    # --- a confident row (p(target) ~ 0.999): G's target entry, dlogp * (1 - p) / T, is small
    # next to p and must not drown in the rounding of the stored p (the target is the row's
    # max, so its stored exp(z - m) is exactly 1 in any dtype)
    for dtype in (torch.float32, torch.bfloat16):
        hidden, weight, targets = inputs((5,), 32, 300, dtype, seed=7)
        x, w = hidden.detach().clone(), weight.detach()
        x[0] = (w[targets[0]].float() * 6).to(dtype)
        log_p = exact_log_softmax(x, w, 1.0)
        _, lse, _, stored = triton_logprobs.softmax_stats(x, w, targets, config=SMALL_TILES, store_probs=True)
        g = triton_logprobs.grad_from_probs(stored, targets, lse, torch.ones(5, device=device), block_n=8)
        want = 1 - log_p[0, targets[0]].exp()
        out[f"confident/{str(dtype)[6:]}/p_target"] = log_p[0, targets[0]].exp().item()
        out[f"confident/{str(dtype)[6:]}/target_grad_rel"] = abs(g[0, targets[0]].item() - want.item()) / want.item()

    # --- token_logprobs: triton backend vs torch backend (fp32 maths on the same values)
    for dtype in (torch.float32, torch.bfloat16):
        name = f"token_logprobs/{str(dtype)[6:]}"
        hidden, weight, targets = inputs((3, 11), 32, 300, dtype, seed=3, weight_grad=True)
        cot = randn(3, 11, seed=4)
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
    for dtype, head in [(torch.float32, "trainable"), (torch.bfloat16, "trainable"),
                        (torch.float32, "frozen"), (torch.bfloat16, "frozen")]:
        # trainable head: G is made (grad_from_probs) for dW; frozen head (LoRA): dx_from_probs
        name = f"fused_grpo/{str(dtype)[6:]}/{head}"
        trainable = head == "trainable"
        hidden, weight, targets = inputs((29,), 32, 300, dtype, seed=5, weight_grad=trainable)
        gen = torch.Generator().manual_seed(6)
        logp0 = exact_log_softmax(hidden, weight, 0.8).gather(1, targets[:, None]).squeeze(1)
        old = logp0 + 0.5 * torch.randn(29, generator=gen).to(device)
        ref = logp0 + 0.3 * torch.randn(29, generator=gen).to(device)
        adv, token_w = torch.randn(29, generator=gen).to(device), torch.rand(29, generator=gen).to(device) / 29
        loss, logp, _ = fused_grpo_token_loss(hidden, weight, targets, old, ref, adv, token_w, beta=0.1,
                                              temperature=0.8, chunk_size=16, backend="triton")
        params = (hidden, weight) if trainable else (hidden,)
        d_hidden, *d_weight = torch.autograd.grad(loss, params)
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(trainable)
        ref_loss, ref_logp, _ = fused_grpo_token_loss(h32, w32, targets, old, ref, adv, token_w, beta=0.1,
                                                      temperature=0.8, chunk_size=16, backend="torch")
        ref_dh, *ref_dw = torch.autograd.grad(ref_loss, (h32, w32) if trainable else (h32,))
        clipped = grpo.token_loss(ref_logp, old, ref, adv, 0.2, 0.28, 0.1)[2]
        out[f"{name}/some_clipped"] = float(clipped.any() and not clipped.all())
        out[f"{name}/loss"] = err(loss, ref_loss)
        out[f"{name}/logp"] = err(logp, ref_logp)
        out[f"{name}/d_hidden_rel"] = rel(d_hidden, ref_dh)
        if trainable:
            out[f"{name}/d_weight_rel"] = rel(d_weight[0], ref_dw[0])
    return out


# Shared memory per block (opt-in maximum) of the GPUs we compile for.
SHARED_MEMORY = {86: 99 * 1024, 90: 227 * 1024}


def compile_checks() -> dict:
    """Compile every kernel for sm_86 and sm_90 with the tiles `tile_config` picks for them."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minscope import triton_logprobs

    ints = dict(N="i32", V="i32", H="i32", stride_x="i32", stride_w="i32")
    flags = dict(DOT_FP32="constexpr", IEEE="constexpr")
    tiles = dict(BLOCK_N="constexpr", BLOCK_V="constexpr", BLOCK_H="constexpr", **flags)
    stats_sig = lambda t: dict(  # noqa: E731
            x_ptr=f"*{t}", w_ptr=f"*{t}", y_ptr="*i64", max_ptr="*fp32", sumexp_ptr="*fp32",
            sumexpz_ptr="*fp32", target_ptr="*fp32", p_ptr=f"*{t}", tmax_ptr="*fp32", **ints,
            stride_p="i32", stride_t="i32", inv_temp="fp32", v_per_split="i32", n_splits="i32",
            **tiles, STORE_P="constexpr")
    probs_args = lambda t: dict(  # noqa: E731
            p_ptr=f"*{t}", tmax_ptr="*fp32", y_ptr="*i64", lse_ptr="*fp32", coef_ptr="*fp32")
    # name: (kernel, signature, constexprs from the config)
    kernels = {
        "stats": (triton_logprobs._softmax_stats_kernel, stats_sig, lambda c: dict(
            BLOCK_N=c["block_n"], BLOCK_V=c["block_v"], BLOCK_H=c["block_h"], STORE_P=False)),
        "stats_store_p": (triton_logprobs._softmax_stats_kernel, stats_sig, lambda c: dict(
            BLOCK_N=c["block_n"], BLOCK_V=c["block_v"], BLOCK_H=c["block_h"], STORE_P=True)),
        "grad": (triton_logprobs._logit_grad_kernel, lambda t: dict(
            x_ptr=f"*{t}", w_ptr=f"*{t}", y_ptr="*i64", lse_ptr="*fp32", dlogp_ptr="*fp32",
            g_ptr=f"*{t}", **ints, stride_g="i32", inv_temp="fp32", **tiles), lambda c: dict(
            BLOCK_N=c["block_n"], BLOCK_V=c["block_v"], BLOCK_H=c["block_h"])),
        "dx_from_probs": (triton_logprobs._dx_from_probs_kernel, lambda t: dict(
            **probs_args(t), w_ptr=f"*{t}", out_ptr="*fp32", N="i32", V="i32", H="i32",
            stride_p="i32", stride_t="i32", stride_w="i32", v_per_split="i32", **tiles,
            BLOCK_V_STATS="constexpr"), lambda c: dict(
            BLOCK_N=c["dx_block_n"], BLOCK_V=c["dx_block_v"], BLOCK_H=c["dx_block_h"],
            BLOCK_V_STATS=c["block_v"])),
    }
    # what Triton's launcher assumes at real shapes (H, V, strides multiples of 16)
    aligned = {"x_ptr", "w_ptr", "g_ptr", "p_ptr", "out_ptr", "H", "V", "stride_x", "stride_w",
               "stride_g", "stride_p", "v_per_split"}

    def compile_one(key, kernel, sig, constexprs, cfg, arch, dtype):
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig) if arg in aligned}
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs, constexprs=dict(
            DOT_FP32=False, IEEE=dtype == torch.float32, **constexprs))
        pre = "dx_" if "dx_from_probs" in key else ""
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(
            num_warps=cfg[pre + "num_warps"], num_stages=cfg[pre + "num_stages"]))
        return {f"{key}/shared": compiled.metadata.shared, f"{key}/mma": compiled.asm["ptx"].count("mma")}

    out = {}
    # bench/tiles.py's candidate configs, for the GPU its sweep runs on (H200: sm_90, bf16)
    spec = importlib.util.spec_from_file_location("bench_tiles", REPO / "bench" / "tiles.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    default = triton_logprobs.tile_config(SHARED_MEMORY[90], torch.bfloat16)
    for name, keys, candidates in (("stats_store_p", sweep.STATS_KEYS, sweep.STATS),
                                   ("dx_from_probs", sweep.DX_KEYS, sweep.DX)):
        kernel, signature, constexprs = kernels[name]
        for i, cand in enumerate(candidates):
            cfg = {**default, **dict(zip(keys, cand))}
            out.update(compile_one(f"sm90/bf16/candidate/{name}/{i}", kernel, signature("bf16"),
                                   constexprs(cfg), cfg, 90, torch.bfloat16))
    for arch, shared in SHARED_MEMORY.items():
        for dtype, ttype in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            cfg = triton_logprobs.tile_config(shared, dtype)
            for name, (kernel, signature, constexprs) in kernels.items():
                out.update(compile_one(f"sm{arch}/{ttype}/{name}", kernel, signature(ttype),
                                       constexprs(cfg), cfg, arch, dtype))
            # the elementwise kernel for a trainable head: no dot, just that it lowers
            src = ASTSource(fn=triton_logprobs._grad_from_probs_kernel, signature=dict(
                **probs_args(ttype), g_ptr=f"*{ttype}", N="i32", V="i32", stride_p="i32",
                stride_t="i32", stride_g="i32", BLOCK_N="constexpr", BLOCK_V="constexpr",
                BLOCK_V_STATS="constexpr"), constexprs=dict(BLOCK_N=32, BLOCK_V=cfg["block_v"],
                                                           BLOCK_V_STATS=cfg["block_v"]))
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
            out[f"sm{arch}/{ttype}/grad_from_probs/ptx_lines"] = compiled.asm["ptx"].count("\n")
    return out


def run_script(mode: str, interpret: bool) -> dict:
    """Run this file as a script in a fresh process (see __main__); its JSON dict."""
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
    if torch.cuda.is_available():      # the compiled kernels on the GPU, not the interpreter
        return run_script("cuda", interpret=False)
    return run_script("interpret", interpret=True)


@pytest.fixture(scope="module")
def compiled():
    return run_script("compile", interpret=False)


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


@pytest.mark.parametrize("case,tol", [("float32/T=1.0", FP32_TOL), ("float32/T=0.7", FP32_TOL),
                                      ("bfloat16/T=0.7", BF16_GRAD_REL)])
def test_stored_probs_give_the_gradient_without_a_second_logits_matmul(errors, case, tol):
    name = f"kernels/{case}"
    assert errors[f"{name}/stored_dtype_ok"] == 1.0
    assert errors[f"{name}/stored_stats_same"] == 0.0
    assert errors[f"{name}/stored_probs"] < (1e-6 if case.startswith("float32") else 4e-3)
    assert errors[f"{name}/grad_from_probs_rel"] < tol
    for splits in (1, 3):
        assert errors[f"{name}/dx_from_probs_dtype_ok/{splits}"] == 1.0
        assert errors[f"{name}/dx_from_probs_rel/{splits}"] < tol


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_confident_target_keeps_its_small_gradient(errors, dtype):
    assert errors[f"confident/{dtype}/p_target"] > 0.998
    # 1 - p to within about one bf16 step of itself (fp32: the lse's own rounding, ~1e-6
    # absolute, is already 1e-3 of 1 - p), not of p: that would be an error of 400% here
    assert errors[f"confident/{dtype}/target_grad_rel"] < (2e-3 if dtype == "float32" else 1e-2)


@pytest.mark.parametrize("dtype,grad_tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_triton_token_logprobs_match_torch_path(errors, dtype, grad_tol):
    name = f"token_logprobs/{dtype}"
    assert errors[f"{name}/shape_ok"] == 1.0
    assert errors[f"{name}/logp"] < FP32_TOL
    assert errors[f"{name}/entropy"] < FP32_TOL
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    assert errors[f"{name}/d_weight_rel"] < grad_tol


@pytest.mark.parametrize("head", ["trainable", "frozen"])
@pytest.mark.parametrize("dtype,grad_tol", [("float32", FP32_TOL), ("bfloat16", BF16_GRAD_REL)])
def test_triton_fused_grpo_matches_torch_path(errors, dtype, grad_tol, head):
    name = f"fused_grpo/{dtype}/{head}"
    assert errors[f"{name}/some_clipped"] == 1.0
    assert errors[f"{name}/loss"] < FP32_TOL
    assert errors[f"{name}/logp"] < FP32_TOL
    assert errors[f"{name}/d_hidden_rel"] < grad_tol
    if head == "trainable":
        assert errors[f"{name}/d_weight_rel"] < grad_tol


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", ["stats", "stats_store_p", "grad", "dx_from_probs"])
def test_kernels_compile_and_fit_in_shared_memory(compiled, arch, dtype, kernel):
    assert 0 < compiled[f"sm{arch}/{dtype}/{kernel}/shared"] <= SHARED_MEMORY[arch]


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_elementwise_gradient_kernel_compiles(compiled, arch, dtype):
    assert compiled[f"sm{arch}/{dtype}/grad_from_probs/ptx_lines"] > 10


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY))
@pytest.mark.parametrize("kernel", ["stats", "stats_store_p", "grad", "dx_from_probs"])
def test_bf16_kernels_use_tensor_core_mma(compiled, arch, kernel):
    assert compiled[f"sm{arch}/bf16/{kernel}/mma"] > 0


@pytest.mark.parametrize("kernel,count", [("stats_store_p", 8), ("dx_from_probs", 8)])
def test_tile_sweep_candidates_fit_an_h200(compiled, kernel, count):
    """Every config bench/tiles.py times on the GPU compiles, fits and uses the tensor cores."""
    for i in range(count):
        key = f"sm90/bf16/candidate/{kernel}/{i}"
        assert 0 < compiled[f"{key}/shared"] <= SHARED_MEMORY[90] and compiled[f"{key}/mma"] > 0, key


def test_triton_matches_torch_path_on_cuda():
    """The real kernels on a real GPU (skipped elsewhere): values and gradients, fp32 and bf16."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 301, 256, 5003                     # ragged against every tile size
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(n, h, device="cuda", generator=gen).to(dtype).requires_grad_(True)
        weight = (torch.randn(v, h, device="cuda", generator=gen) / 8).to(dtype).requires_grad_(True)
        targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
        h32 = hidden.detach().float().requires_grad_(True)
        w32 = weight.detach().float().requires_grad_(True)
        cot = torch.randn(n, device="cuda", generator=gen)
        for temperature in (1.0, 0.7):
            logp, ent = token_logprobs(hidden, weight, targets, temperature, return_entropy=True,
                                       chunk_size=128, backend="triton")
            ref_logp, ref_ent = token_logprobs(h32, w32, targets, temperature, return_entropy=True,
                                               chunk_size=128, backend="torch")
            torch.testing.assert_close(logp, ref_logp, atol=1e-3, rtol=1e-4)
            torch.testing.assert_close(ent, ref_ent, atol=1e-3, rtol=1e-4)
            got = torch.autograd.grad((cot * logp).sum(), (hidden, weight))
            want = torch.autograd.grad((cot * ref_logp).sum(), (h32, w32))
            for g, w in zip(got, want):
                assert (g.float() - w).abs().max() <= 2e-2 * w.abs().max()
        old = ref_logp.detach() + 0.3 * torch.randn(n, device="cuda", generator=gen)
        adv, tw = torch.randn(n, device="cuda", generator=gen), torch.full((n,), 1.0 / n, device="cuda")
        loss, _, _ = fused_grpo_token_loss(hidden, weight, targets, old, old, adv, tw, beta=0.1,
                                           temperature=0.7, chunk_size=128, backend="triton")
        ref_loss, _, _ = fused_grpo_token_loss(h32, w32, targets, old, old, adv, tw, beta=0.1,
                                               temperature=0.7, chunk_size=128, backend="torch")
        torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-3)
        got = torch.autograd.grad(loss, (hidden, weight))
        want = torch.autograd.grad(ref_loss, (h32, w32))
        for g, w in zip(got, want):
            assert (g.float() - w).abs().max() <= 2e-2 * w.abs().max()
        # frozen LM head: dx straight from the stored probabilities (the LoRA case)
        loss, _, _ = fused_grpo_token_loss(hidden, weight.detach(), targets, old, old, adv, tw, beta=0.1,
                                           temperature=0.7, chunk_size=128, backend="triton")
        (got,) = torch.autograd.grad(loss, (hidden,))
        assert (got.float() - want[0]).abs().max() <= 2e-2 * want[0].abs().max()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "interpret"
    if mode in ("compile", "cuda"):
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit(f"{mode} checks need the real Triton: unset TRITON_INTERPRET")
        print(json.dumps(compile_checks() if mode == "compile" else numeric_checks("cuda")))
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("run with TRITON_INTERPRET=1 (the kernels run in the Triton interpreter on CPU)")
        print(json.dumps(numeric_checks("cpu")))
