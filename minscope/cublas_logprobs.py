"""cuBLAS logits, then one Triton pass per row: the "cublas" backend of `minscope.logprobs`.

`minscope.logprobs` imports this module only when backend="cublas", so the rest of minscope
never needs Triton. Notation as in `minscope.triton_logprobs`: x [C, H] one chunk of hidden
states, W [V, H] the LM head, y [C] target ids, T the temperature, z = x @ W.T / T.

Why another design. The "triton" backend fuses the softmax into its own matmul kernels; on an
H200 those run at 1.8x (logits) and 2.7x (dx) cuBLAS's time for the same products, because
an elementwise epilogue sits between the tensor-core steps. Here the matmuls are cuBLAS's,
unchanged, and the softmax is one memory-bound pass of its own. Per chunk of C rows:

    1. z = x @ W.T                     cuBLAS, bf16 inputs, fp32 accumulate, fp32 output [C, V]
    2. one Triton program per row      reads the row once: online max / sum-exp, the target
                                       logit, the entropy -> lse, logp; for the GRPO loss also
                                       dloss/dlogp from the row's logp (the loss of a token
                                       depends on its own log-prob only), then reads the row
                                       again and writes G = dlogp (onehot(y) - softmax(z)) / T
                                       over it, in place, in the input dtype
    3. dx = G @ W                      cuBLAS (and dW = G.T @ x for a trainable head)

Cost model at one 1,024-row chunk of Qwen3's head in bf16: the two matmuls, plus reading the
fp32 block twice and writing the bf16 block once, 1.6 GB of memory traffic, about 0.35 ms at an
H200's ~4.8 TB/s. Extra memory: one fp32 [C, V] block (0.62 GB at C = 1,024), reused by G.

Why fp32 logits. A bf16 logit of size 8-16 is rounded to a step of 1/16-1/32, so log-probs
computed from bf16 logits are off by up to ~3e-2 (the naive bf16 path's error, 7.4e-2 on
the H200); fp32 logits keep the error near 1e-5, far inside the 1e-3 the trainer needs. The
fp32 write costs one more 0.3 GB of traffic per chunk than a bf16 one.

In place, in bf16. Row r of G (2 bytes per entry) is written over the first half of row r
of the fp32 logits (4 bytes per entry): entry v of G lands on the bytes of logit v / 2, which
some other warp of the same program may still have to read. A barrier between each block's
read and its write orders that: when any warp writes block k, every warp has read blocks
0..k, and block k's writes cover only logits below the end of block k. Later blocks are
never touched early. G is then a strided view (row stride 2V entries) that cuBLAS reads
directly. For fp32 inputs G simply replaces z entry by entry.

Forward only (evaluation, reference log-probs): steps 1 and 2 without the gradient, nothing
kept but three numbers per row.

Launch settings (`launch_config`): 4,096 columns per block step and 8 warps per row program,
on every GPU. They are a guess for a memory-bound row pass, NOT measured on any GPU yet
(neither on the H200 nor on consumer sm_86 / sm_89 cards); bench/logprobs.py says so in its
output until a sweep replaces them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch.torch_version import TorchVersion

MODE_STATS, MODE_GRAD, MODE_GRPO = 0, 1, 2

# Unmeasured on every GPU (see the module docstring); printed by bench/logprobs.py.
LAUNCH_NOTE = "cublas row pass: block_v=4096, num_warps=8 on every GPU, never measured (a guess)"

_CUDA_MM_OUT_DTYPE = TorchVersion(torch.__version__) >= (2, 8)


@triton.jit
def _logit_rows_kernel(z_ptr, g_ptr, y_ptr, lse_ptr, logp_ptr, ent_ptr, dlogp_ptr,
                       old_ptr, ref_ptr, adv_ptr, tw_ptr,
                       V, stride_z, stride_g, inv_temp, eps_low, eps_high, beta,
                       MODE: tl.constexpr, WANT_ENTROPY: tl.constexpr, HAS_REF: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """One row of raw logits z_ptr (x @ W.T, before the temperature) per program.

    MODE_STATS: write lse, logp (and entropy).  MODE_GRAD: read lse and dlogp, write G.
    MODE_GRPO: the statistics, then dlogp of the GRPO token loss (written to dlogp_ptr),
    then G. G = dlogp * (onehot(y) - softmax(z)) / T goes to g_ptr, which may alias z_ptr."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    g_row = g_ptr + row * stride_g
    offs = tl.arange(0, BLOCK_V)
    y = tl.load(y_ptr + row)

    if MODE == 1:   # gradient only (backward of token_logprobs): lse and dlogp are known
        lse = tl.load(lse_ptr + row)
        dlogp = tl.load(dlogp_ptr + row)
    else:
        # online softmax over the row: running max m, sum exp(z - m), sum exp(z - m) * z
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        t = tl.zeros((), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, axis=0))      # finite: every block has a real column
            rescale = tl.exp(m - m_new)                   # 0 on the first block
            p = tl.exp(z - m_new)                         # 0 on padded columns
            s = s * rescale + tl.sum(p, axis=0)
            if WANT_ENTROPY:
                t = t * rescale + tl.sum(p * tl.where(ok, z, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(s)
        logp = tl.load(z_row + y).to(tl.float32) * inv_temp - lse
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, logp)
        if WANT_ENTROPY:
            tl.store(ent_ptr + row, lse - t / s)
        if MODE == 2:
            # d/dlogp of w * (-min(r A, clip(r) A) + beta * (exp(d) - d - 1)), r = exp(logp - old),
            # d = ref - logp, both log-ratios 0 where w == 0 (as grpo.token_loss with mask=w).
            # The min passes the gradient unless the clipped branch is strictly smaller.
            w = tl.load(tw_ptr + row)
            adv = tl.load(adv_ptr + row)
            trained = w != 0
            ratio = tl.exp(tl.where(trained, logp - tl.load(old_ptr + row), 0.0))
            clipped = tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
            dlogp = tl.where(clipped * adv < ratio * adv, 0.0, -adv * ratio)
            if HAS_REF:
                d = tl.where(trained, tl.load(ref_ptr + row) - logp, 0.0)
                dlogp += beta * (1.0 - tl.exp(d))
            dlogp = tl.where(trained, w * dlogp, 0.0)
            tl.store(dlogp_ptr + row, dlogp)

    if MODE != 0:
        coef = dlogp * inv_temp
        v_read = tl.where(coef != 0, V, 0)      # untrained tokens: no read, a row of zeros
        tl.debug_barrier()        # the statistics pass is done by every warp before G overwrites z
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            z = tl.load(z_row + cols, mask=cols < v_read, other=float("-inf")).to(tl.float32) * inv_temp
            g = tl.where(cols == y, coef, 0.0) - coef * tl.exp(z - lse)
            # in place over the logits: every warp has read this block (and all before it)
            # before any warp writes it; see "In place, in bf16" above
            tl.debug_barrier()
            tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------ launchers
def launch_config(device: torch.device) -> dict:
    """Columns per block step and warps per row program. On CUDA: a guess, never measured on
    any GPU (H200 and consumer sm_86 / sm_89 alike; LAUNCH_NOTE). Off CUDA (the interpreter):
    small blocks, so the tests walk several blocks with a ragged end."""
    if device.type == "cuda":
        return dict(block_v=4096, num_warps=8)
    return dict(block_v=32, num_warps=1)


def chunk_logits(x, weight):
    """x @ W.T as a fresh fp32 [C, V] block (not scaled by T): cuBLAS with fp32 accumulation
    and, for bf16/fp16 inputs, an fp32 result (torch >= 2.8 on CUDA). Elsewhere the inputs are
    widened first, which gives the same exact products of bf16 numbers (CPU tests)."""
    if x.dtype == torch.float32:
        return x @ weight.T
    if x.is_cuda and _CUDA_MM_OUT_DTYPE:
        return torch.mm(x, weight.T, out_dtype=torch.float32)
    return x.float() @ weight.float().T


def grad_view(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """G [C, V] in `dtype`, stored over the fp32 logits z [C, V] (row r at the start of z's row r)."""
    if dtype == z.dtype:
        return z
    if z.dtype != torch.float32 or dtype.itemsize != 2 or not z.is_contiguous():
        raise ValueError(f"in-place gradient needs contiguous fp32 logits and a 2-byte dtype; "
                         f"got {z.dtype} logits and {dtype}")
    return z.view(dtype)[:, :z.shape[1]]              # [C, 2V] -> the first V entries of each row


def _launch(z, targets, temperature, mode, want_entropy=False, grad_dtype=None, lse=None, dlogp=None,
            grpo=None, config=None):
    cfg = {**launch_config(z.device), **(config or {})}
    c, v = z.shape
    if z.stride(1) != 1:
        raise ValueError("logits must have a contiguous last dim")
    f32 = dict(dtype=torch.float32, device=z.device)
    out_lse = lse if lse is not None else torch.empty(c, **f32)
    out_dlogp = dlogp if dlogp is not None else torch.empty(c, **f32)
    logp = torch.empty(c, **f32) if mode != MODE_GRAD else out_lse
    entropy = torch.empty(c, **f32) if want_entropy else out_lse
    g = grad_view(z, grad_dtype) if mode != MODE_STATS else z
    old, ref, adv, tw, eps_low, eps_high, beta = grpo or (out_lse,) * 4 + (0.0, 0.0, 0.0)
    has_ref = mode == MODE_GRPO and bool(beta)
    _logit_rows_kernel[(c,)](
        z, g, targets.contiguous(), out_lse, logp, entropy, out_dlogp,
        old, ref if has_ref else out_lse, adv, tw,
        v, z.stride(0), g.stride(0), 1.0 / temperature, float(eps_low), float(eps_high), float(beta),
        MODE=mode, WANT_ENTROPY=bool(want_entropy), HAS_REF=has_ref, BLOCK_V=cfg["block_v"],
        num_warps=cfg["num_warps"], num_stages=1)
    return dict(logp=logp, lse=out_lse, entropy=entropy if want_entropy else None, dlogp=out_dlogp, grad=g)


def row_stats(z, targets, temperature: float = 1.0, want_entropy: bool = True, config=None):
    """(logp [C], lse [C], entropy [C] or None) in fp32 from raw logits z [C, V] (x @ W.T)."""
    r = _launch(z, targets, temperature, MODE_STATS, want_entropy, config=config)
    return r["logp"], r["lse"], r["entropy"]


def grad_in_place(z, targets, lse, dlogp, temperature: float = 1.0, dtype=torch.float32, config=None):
    """G = dlogp * (onehot(y) - softmax(z / T)) / T [C, V] in `dtype`, written over z (returned as a view)."""
    r = _launch(z, targets, temperature, MODE_GRAD, grad_dtype=dtype, lse=lse.float().contiguous(),
                dlogp=dlogp.float().contiguous(), config=config)
    return r["grad"]


def grpo_in_place(z, targets, old_logp, ref_logp, advantages, token_weights, eps_low, eps_high, beta,
                  temperature: float = 1.0, want_entropy: bool = True, dtype=torch.float32, config=None):
    """The GRPO token loss's statistics and logit gradient from raw logits z [C, V], in one pass.

    old_logp, ref_logp (None when beta == 0), advantages, token_weights: fp32 [C]. Returns
    (logp, lse, entropy or None, dlogp = d sum(w * token_loss) / dlogp, G [C, V] in `dtype`
    written over z)."""
    if beta and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    side = [t.float().contiguous() for t in (old_logp, ref_logp if beta else old_logp, advantages, token_weights)]
    r = _launch(z, targets, temperature, MODE_GRPO, want_entropy, grad_dtype=dtype,
                grpo=(*side, eps_low, eps_high, beta), config=config)
    return r["logp"], r["lse"], r["entropy"], r["dlogp"], r["grad"]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
