"""Triton kernels for `logprobs` on CUDA: LM-head matmul tiles fused with the softmax math.

`minscope.logprobs` imports this module only when backend="triton" (or "auto" on CUDA), so
the rest of minscope never needs Triton. Notation, for N rows, hidden size H, vocab V:

    x [N, H] hidden states, W [V, H] LM head, y [N] target ids, T temperature
    z = x @ W.T / T                         [N, V]   stored only for the fused GRPO loss
    lse = logsumexp(z)                      [N]
    logp = z[y] - lse                       [N]
    entropy = lse - sum_v softmax(z)_v z_v  [N]

Four kernels:

* `_softmax_stats_kernel` (forward). One program owns BLOCK_N rows and one slice of the
  vocabulary. For each [BLOCK_N, BLOCK_V] tile it computes z with `tl.dot` over H, then,
  while the tile is still in registers, updates the online softmax state of each row:
  running max m, sum of exp(z - m), sum of exp(z - m) * z (for the entropy) and the target
  logit. Nothing of size [N, V] touches memory (unless STORE_P, below). Splitting the
  vocabulary over programs keeps the GPU busy when N is small; the per-split states [N, S]
  are merged in PyTorch (tiny).

* `_logit_grad_kernel` (backward of `token_logprobs`). One program owns one
  [BLOCK_N, BLOCK_V] tile: it recomputes z with `tl.dot`, and in the same registers forms
  the gradient w.r.t. the raw logits x @ W.T,

      G = dlogp[:, None] * (onehot(y) - exp(z - lse)) / T

  stored once in the input dtype. The caller then runs two cuBLAS matmuls, dx = G @ W and
  dW = G.T @ x. Why not accumulate dx in the kernel like flash attention does: a row block's
  dx is [BLOCK_N, H] with H = 1024..4096 here, far more than fits in registers (attention
  gets away with it because its head dim is <= 256). So the backward holds one [chunk, V]
  tile of G in the input dtype; `logprobs` walks the rows chunk by chunk.
  Logits, recomputed logits, dx: three matmuls.

* `_dx_from_probs_kernel` (fused GRPO loss, frozen LM head). There the upstream gradient
  dlogp is known in the forward pass, right after a chunk's statistics, so nothing needs
  recomputing if the statistics kernel leaves something behind. It stores (STORE_P), from
  the tiles it has in registers anyway, p = exp(z - m) in the input dtype with m the
  running max after the tile (so p <= 1, and exactly 1 at a row's maximum), plus m itself
  per row and tile. Then softmax(z) = p * exp(m - lse), and dx = G @ W is a GEMM over the
  vocabulary whose A operand is made in registers, tile by tile, from p: the gradient
  epilogue lives inside the matmul, and no [N, V] gradient is ever written. Two matmuls
  (logits, dx); memory traffic beyond them: p written once and read once (2 + 2 bytes per
  logit in bf16); extra memory: p, 0.31 GB at 1,024 x 151,936 in bf16.
  Rounding: G is rounded to bf16 for the tensor cores anyway; p's own bf16 rounding
  adds about as much again, relative to each entry. A confident target (p(y) -> 1) is
  the row's max, so its p is exactly 1 and 1 - p(y) keeps its precision (tested).

* `_grad_from_probs_kernel` (fused GRPO loss, trainable LM head). dW = G.T @ x needs G
  itself: this elementwise kernel writes it from p (one read, one write) and cuBLAS does
  dx and dW. Tiny models trained from scratch use this; LoRA never does.

Tile sizes come from `tile_config`. Where shared memory allows (Hopper, A100), bf16 uses
the fastest sizes of bench/tiles.py's first sweep on an H200: 128 x 128 logit tiles with
4 pipeline stages for the statistics kernel, 64 x 256 output tiles of dx for the dx
kernel. Elsewhere (consumer GPUs with ~100 KB per block, fp32) they are chosen by shared
memory and not measured. The tests compile every kernel ahead of time for sm_86 and sm_90 (no GPU needed)
and check that they use tensor-core MMAs and fit in shared memory.

Under TRITON_INTERPRET=1 (CPU tests) the interpreter cannot multiply bfloat16 tiles (it
stores them as raw uint16), so there the tiles are upcast to float32 before `tl.dot`.
The products of two bf16 numbers are exact in fp32, so this does not change the maths.

One file, though long: the kernels, their launch grid and the autograd function that calls
them share tile sizes that must agree.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _logits_tile(x_ptr, w_ptr, rows, cols, N, V, H, stride_x, stride_w, inv_temp,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """z = x[rows] @ W[cols].T / T as a [BLOCK_N, BLOCK_V] fp32 tile (rows/cols are int64)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + rows[:, None] * stride_x + hs[None, :],
                    mask=(rows[:, None] < N) & (hs[None, :] < H), other=0.0)   # [BLOCK_N, BLOCK_H]
        w = tl.load(w_ptr + cols[:, None] * stride_w + hs[None, :],
                    mask=(cols[:, None] < V) & (hs[None, :] < H), other=0.0)   # [BLOCK_V, BLOCK_H]
        if DOT_FP32:  # interpreter only: it cannot multiply bf16 tiles
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:      # fp32 inputs: exact fp32 products, like torch.matmul (no TF32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:         # bf16/fp16 inputs: tensor cores, fp32 accumulation
            acc = tl.dot(x, tl.trans(w), acc)
    return acc * inv_temp


@triton.jit
def _softmax_stats_kernel(x_ptr, w_ptr, y_ptr, max_ptr, sumexp_ptr, sumexpz_ptr, target_ptr,
                          p_ptr, tmax_ptr, N, V, H, stride_x, stride_w, stride_p, stride_t, inv_temp,
                          v_per_split, n_splits,
                          BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                          DOT_FP32: tl.constexpr, IEEE: tl.constexpr, STORE_P: tl.constexpr):
    """Online softmax state of BLOCK_N rows over one vocab slice -> partials [N, n_splits].

    STORE_P (for the fused GRPO loss): also write each tile's exp(z - m), m the running max
    after the tile, to p_ptr in p's dtype, and m to tmax_ptr[row, tile index]; then
    softmax(z) = p * exp(m - lse) needs no second logits matmul."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)     # [BLOCK_N]
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)                  # [BLOCK_N] target ids

    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)          # running max of z
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)                        # sum exp(z - m)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)                        # sum exp(z - m) * z
    z_target = tl.zeros((BLOCK_N,), dtype=tl.float32)                 # z[y] (0 if y elsewhere)

    # v_per_split is a multiple of BLOCK_V and every split is non-empty, so each tile below
    # has at least one real column and the running max stays finite after the first tile.
    v_start = split.to(tl.int64) * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)                             # [BLOCK_V]
        col_ok = cols < v_end
        z = _logits_tile(x_ptr, w_ptr, rows, cols, N, V, H, stride_x, stride_w, inv_temp,
                         BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, IEEE)   # [BLOCK_N, BLOCK_V]
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # the softmax epilogue, on the tile still in registers
        m_new = tl.maximum(m, tl.max(z, axis=1))
        rescale = tl.exp(m - m_new)                                   # 0 on the first tile
        p = tl.exp(z - m_new[:, None])                                # 0 on padded columns
        if STORE_P:   # p <= 1, and exactly 1 at the running max (e.g. a confident target)
            tl.store(p_ptr + rows[:, None] * stride_p + cols[None, :], p.to(p_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
            tl.store(tmax_ptr + rows * stride_t + v0 // BLOCK_V, m_new, mask=row_ok)
        s = s * rescale + tl.sum(p, axis=1)
        t = t * rescale + tl.sum(p * tl.where(col_ok[None, :], z, 0.0), axis=1)
        is_target = cols[None, :] == y[:, None]
        z_target += tl.sum(tl.where(is_target, z, 0.0), axis=1)
        m = m_new

    out = rows * n_splits + split
    tl.store(max_ptr + out, m, mask=row_ok)
    tl.store(sumexp_ptr + out, s, mask=row_ok)
    tl.store(sumexpz_ptr + out, t, mask=row_ok)
    tl.store(target_ptr + out, z_target, mask=row_ok)


@triton.jit
def _logit_grad_kernel(x_ptr, w_ptr, y_ptr, lse_ptr, dlogp_ptr, g_ptr,
                       N, V, H, stride_x, stride_w, stride_g, inv_temp,
                       BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """G[rows, cols] = dlogp * (onehot(y) - softmax(z)) / T for one tile, in G's dtype."""
    # Row blocks vary fastest: programs running together read the same W tile, so each
    # tile of the (large) LM head comes from HBM about once per chunk; the chunk's rows of
    # x are small enough to stay in L2.
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    dlogp = tl.load(dlogp_ptr + rows, mask=row_ok, other=0.0)

    z = _logits_tile(x_ptr, w_ptr, rows, cols, N, V, H, stride_x, stride_w, inv_temp,
                     BLOCK_N, BLOCK_V, BLOCK_H, DOT_FP32, IEEE)
    probs = tl.exp(z - lse[:, None])
    onehot = (cols[None, :] == y[:, None]).to(tl.float32)
    grad = (dlogp * inv_temp)[:, None] * (onehot - probs)
    tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], grad.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _probs_tile_grad(p_ptr, tmax_ptr, rows, v0, y, lse, coef, N, V, stride_p, stride_t,
                     BLOCK_V: tl.constexpr, BLOCK_V_STATS: tl.constexpr):
    """G = coef * (onehot(y) - softmax(z)) on columns v0 .. v0 + BLOCK_V, fp32 [BLOCK_N, BLOCK_V].

    From the stored p = exp(z - m) and the stats kernel's tile maxes m: softmax = p * exp(m - lse).
    BLOCK_V divides BLOCK_V_STATS and v0 is a multiple of BLOCK_V, so these columns share one m."""
    offs = tl.arange(0, BLOCK_V)                                      # int32 column offsets
    cols = v0 + offs
    row_ok = rows < N
    p = tl.load(p_ptr + rows[:, None] * stride_p + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < V), other=0.0).to(tl.float32)
    tmax = tl.load(tmax_ptr + rows * stride_t + v0 // BLOCK_V_STATS, mask=row_ok, other=0.0)
    # per element: one multiply, and an add on the target's column (few ops per element,
    # since this runs inside the matmul loop)
    g = p * (-coef * tl.exp(tmax - lse))[:, None]                     # -coef * softmax
    is_target = offs[None, :] == (y - v0).to(tl.int32)[:, None]
    return tl.where(is_target, g + coef[:, None], g)


@triton.jit
def _grad_from_probs_kernel(p_ptr, tmax_ptr, y_ptr, lse_ptr, coef_ptr, g_ptr,
                            N, V, stride_p, stride_t, stride_g,
                            BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_V_STATS: tl.constexpr):
    """G [N, V] in g's dtype (only when the LM head itself needs a gradient)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    v0 = tl.program_id(1).to(tl.int64) * BLOCK_V
    cols = v0 + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    grad = _probs_tile_grad(p_ptr, tmax_ptr, rows, v0, y, lse, coef, N, V, stride_p, stride_t,
                            BLOCK_V, BLOCK_V_STATS)
    tl.store(g_ptr + rows[:, None] * stride_g + cols[None, :], grad.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < V))


@triton.jit
def _dx_from_probs_kernel(p_ptr, tmax_ptr, y_ptr, lse_ptr, coef_ptr, w_ptr, out_ptr,
                          N, V, H, stride_p, stride_t, stride_w, v_per_split,
                          BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_V_STATS: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """out[split, rows, hs] = sum over the split's vocab of G[rows, v] * W[v, hs], fp32.

    A GEMM over the vocabulary whose A operand, G, is made tile by tile in registers from
    the stored p (the gradient epilogue fused into the matmul): no [N, V] G in memory."""
    pid_n = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    hs = pid_h.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < N
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    v_start = split.to(tl.int64) * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        g = _probs_tile_grad(p_ptr, tmax_ptr, rows, v0, y, lse, coef, N, V, stride_p, stride_t,
                             BLOCK_V, BLOCK_V_STATS)                           # [BLOCK_N, BLOCK_V]
        w = tl.load(w_ptr + cols[:, None] * stride_w + hs[None, :],
                    mask=(cols[:, None] < V) & (hs[None, :] < H), other=0.0)    # [BLOCK_V, BLOCK_H]
        if DOT_FP32:    # interpreter: round G as the GPU would, multiply in fp32
            acc += tl.dot(g.to(w_ptr.dtype.element_ty).to(tl.float32), w.to(tl.float32))
        elif IEEE:
            acc = tl.dot(g, w, acc, input_precision="ieee")
        else:           # G rounded to W's dtype for the tensor cores, fp32 accumulation
            acc = tl.dot(g.to(w_ptr.dtype.element_ty), w, acc)
    out = out_ptr + split.to(tl.int64) * N * H + rows[:, None] * H + hs[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & (hs[None, :] < H))


# ------------------------------------------------------------------------------ launchers
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_flags(dtype: torch.dtype):
    """(DOT_FP32, IEEE) constexprs for the tile dtype."""
    return dtype != torch.float32 and _interpreting(), dtype == torch.float32


def _unit_stride(t):
    """The kernels index rows by stride(0) and assume consecutive elements along H."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tile_config(shared_memory_bytes: int, dtype: torch.dtype) -> dict:
    """Tile sizes and launch settings for a GPU with this much shared memory per block.

    Keys without a prefix are the statistics (and logit-gradient) kernel's; dx_* are the dx
    kernel's. The bf16 sizes for GPUs with >= 160 KB (Hopper, A100) are the fastest of
    bench/tiles.py's first sweep on an H200 (docs/BENCHMARKS.md, "Fused log-probs"); the others are unmeasured.
    """
    # A pipeline stage of the statistics kernel holds a [block_n, block_h] tile of hidden
    # and a [block_v, block_h] tile of W: 32 KB at 128 x 128 x 64 in bf16, so 4 stages need
    # 128 KB (Hopper: 227 KB, A100: 163 KB) and 64-row tiles with 3 stages ~48 KB, which
    # fits the ~100 KB of consumer GPUs. fp32 tiles take twice the bytes per element, so
    # they step through H half as far. The dx kernel is a GEMM over the vocabulary: a stage
    # holds a [dx_block_n, dx_block_v] tile of p and a [dx_block_v, dx_block_h] tile of W
    # (40 KB at 64 x 64 x 256); dx_block_v must divide block_v (one tile max per row and step).
    big = shared_memory_bytes >= 160 * 1024
    # Measured: only the bf16 sizes for >= 160 KB (H200 sweep). The fp32 sizes and everything
    # below 160 KB (consumer sm_86 / sm_89 GPUs, ~100 KB per block) are chosen by shared memory
    # and NEVER MEASURED on such a GPU; `tile_config_note` says so in the benchmarks' output.
    if dtype == torch.float32:
        rows = 128 if big else 64
        return dict(block_n=rows, block_v=128, block_h=32, num_warps=8, num_stages=3,
                    dx_block_n=rows, dx_block_v=32, dx_block_h=128, dx_num_warps=8, dx_num_stages=3)
    if big:
        return dict(block_n=128, block_v=128, block_h=64, num_warps=8, num_stages=4,
                    dx_block_n=64, dx_block_v=64, dx_block_h=256, dx_num_warps=8, dx_num_stages=3)
    return dict(block_n=64, block_v=128, block_h=64, num_warps=8, num_stages=3,
                dx_block_n=64, dx_block_v=64, dx_block_h=128, dx_num_warps=8, dx_num_stages=3)


def tile_config_note(shared_memory_bytes: int, dtype: torch.dtype) -> str:
    """One line for benchmark output: where `tile_config`'s choice for this GPU comes from."""
    if shared_memory_bytes == 0:
        return "triton tiles: the small ones used off CUDA (interpreter); no GPU here"
    if shared_memory_bytes >= 160 * 1024 and dtype != torch.float32:
        return "triton tiles: measured (bench/tiles.py sweep on an H200)"
    kind = ("fp32" if dtype == torch.float32
            else f"{shared_memory_bytes // 1024} KB shared memory (consumer GPUs: sm_86, sm_89)")
    return f"triton tiles: UNMEASURED for {kind}, chosen by shared memory only"


def kernel_config(device: torch.device, dtype: torch.dtype) -> dict:
    """`tile_config` for `device` (the small tiles off CUDA, e.g. in the interpreter)."""
    shared = 0
    if device.type == "cuda":
        shared = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)
    return tile_config(shared, dtype)


def _vocab_splits(programs: int, n_vocab: int, device: torch.device, block_v: int) -> int:
    """Vocab splits of a launch of `programs` programs per split, so that about two programs
    run per SM (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(n_vocab, block_v)))


class StoredProbs(NamedTuple):
    """What the statistics kernel leaves for the fused GRPO gradient (STORE_P)."""
    p: torch.Tensor          # [N, V] exp(z - m) in the input dtype
    tile_max: torch.Tensor   # [N, ceil(V / block_v)] fp32: m, per row and vocab tile
    block_v: int             # the statistics kernel's vocab tile


def softmax_stats(hidden, weight, targets, temperature: float = 1.0, v_splits: int | None = None,
                  config: dict | None = None, store_probs: bool = False):
    """(logp [N], lse [N], entropy [N]) in fp32, without building [N, V] logits.

    hidden [N, H] and weight [V, H] share a dtype and have a contiguous last dim;
    targets [N] int64 ids in [0, V). `config` overrides entries of `kernel_config`.
    store_probs: also return a `StoredProbs`, written by the same kernel from the tiles it
    computes anyway: what `dx_from_probs` and `grad_from_probs` need.
    """
    cfg = {**kernel_config(hidden.device, hidden.dtype), **(config or {})}
    hidden, weight, targets = _unit_stride(hidden), _unit_stride(weight), targets.contiguous()
    n, h = hidden.shape
    v = weight.shape[0]
    splits = v_splits or _vocab_splits(triton.cdiv(n, cfg["block_n"]), v, hidden.device, cfg["block_v"])
    # every split gets a whole number of vocab tiles, and none is empty
    v_per_split = triton.cdiv(triton.cdiv(v, splits), cfg["block_v"]) * cfg["block_v"]
    splits = triton.cdiv(v, v_per_split)
    partial = torch.empty(4, n, splits, dtype=torch.float32, device=hidden.device)
    run_max, sumexp, sumexpz, z_target = partial                       # each [N, S]
    if store_probs:
        stored = StoredProbs(torch.empty(n, v, dtype=hidden.dtype, device=hidden.device),
                             torch.empty(n, triton.cdiv(v, cfg["block_v"]), dtype=torch.float32,
                                         device=hidden.device), cfg["block_v"])
        p, tile_max = stored.p, stored.tile_max
    else:   # dummies the kernel never touches (STORE_P=False)
        p = tile_max = run_max
    dot_fp32, ieee = _dot_flags(hidden.dtype)
    grid = (triton.cdiv(n, cfg["block_n"]), splits)
    _softmax_stats_kernel[grid](
        hidden, weight, targets, run_max, sumexp, sumexpz, z_target, p, tile_max,
        n, v, h, hidden.stride(0), weight.stride(0), p.stride(0), tile_max.stride(0), 1.0 / temperature,
        v_per_split, splits, BLOCK_N=cfg["block_n"], BLOCK_V=cfg["block_v"], BLOCK_H=cfg["block_h"],
        DOT_FP32=dot_fp32, IEEE=ieee, STORE_P=store_probs,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    # merge the per-split states: bring every split to the common max, then add up
    m = run_max.max(dim=1).values                                      # [N]
    scale = torch.exp(run_max - m[:, None])                            # [N, S]
    s = (sumexp * scale).sum(dim=1)
    t = (sumexpz * scale).sum(dim=1)
    lse = m + torch.log(s)
    logp = z_target.sum(dim=1) - lse
    entropy = lse - t / s
    if store_probs:
        return logp, lse, entropy, stored
    return logp, lse, entropy


def dx_from_probs(stored: StoredProbs, targets, lse, dlogp, weight, temperature: float = 1.0,
                  v_splits: int | None = None, config: dict | None = None):
    """dx [N, H] = G @ weight in weight's dtype, G = d(sum dlogp * logp)/d(logits) made on the fly.

    The gradient epilogue runs inside the matmul's tiles (`_dx_from_probs_kernel`), so this
    reads the stored p once and writes nothing of size [N, V]. Vocab splits (partial sums in
    fp32, added here) keep the GPU busy when N x H has few output tiles.
    """
    cfg = {**kernel_config(weight.device, weight.dtype), **(config or {})}
    if stored.block_v % cfg["dx_block_v"]:
        raise ValueError(f"dx_block_v={cfg['dx_block_v']} must divide the stats tile {stored.block_v}")
    weight, targets = _unit_stride(weight), targets.contiguous()
    n, v = stored.p.shape
    h = weight.shape[1]
    if v_splits is None:
        tiles = triton.cdiv(n, cfg["dx_block_n"]) * triton.cdiv(h, cfg["dx_block_h"])
        v_splits = _vocab_splits(tiles, v, weight.device, stored.block_v)
    # every split starts on a stats tile, so each dx step sees one tile max per row
    v_per_split = triton.cdiv(triton.cdiv(v, v_splits), stored.block_v) * stored.block_v
    v_splits = triton.cdiv(v, v_per_split)
    out = torch.empty(v_splits, n, h, dtype=torch.float32, device=weight.device)
    coef = (dlogp.float() / temperature).contiguous()
    dot_fp32, ieee = _dot_flags(weight.dtype)
    grid = (triton.cdiv(n, cfg["dx_block_n"]), triton.cdiv(h, cfg["dx_block_h"]), v_splits)
    _dx_from_probs_kernel[grid](
        stored.p, stored.tile_max, targets, lse.float().contiguous(), coef, weight, out,
        n, v, h, stored.p.stride(0), stored.tile_max.stride(0), weight.stride(0), v_per_split,
        BLOCK_N=cfg["dx_block_n"], BLOCK_V=cfg["dx_block_v"], BLOCK_H=cfg["dx_block_h"],
        BLOCK_V_STATS=stored.block_v, DOT_FP32=dot_fp32, IEEE=ieee,
        num_warps=cfg["dx_num_warps"], num_stages=cfg["dx_num_stages"])
    return (out[0] if v_splits == 1 else out.sum(dim=0)).to(weight.dtype)


def grad_from_probs(stored: StoredProbs, targets, lse, dlogp, temperature: float = 1.0, block_n: int = 32):
    """G [N, V] in p's dtype: `logit_grad`'s result from stored probabilities (no matmul).

    Only for a trainable LM head, whose dW = G.T @ hidden needs G itself."""
    n, v = stored.p.shape
    block_v = stored.block_v
    grad = torch.empty_like(stored.p)
    grid = (triton.cdiv(n, block_n), triton.cdiv(v, block_v))
    _grad_from_probs_kernel[grid](stored.p, stored.tile_max, targets.contiguous(), lse.float().contiguous(),
                                  (dlogp.float() / temperature).contiguous(), grad, n, v,
                                  stored.p.stride(0), stored.tile_max.stride(0), grad.stride(0),
                                  BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_V_STATS=stored.block_v,
                                  num_warps=4)
    return grad


def logit_grad(hidden, weight, targets, lse, dlogp, temperature: float = 1.0,
               config: dict | None = None):
    """G [N, V] in hidden's dtype: d(sum dlogp * logp) / d(hidden @ weight.T).

    lse [N] from `softmax_stats` (same temperature); dlogp [N] fp32 upstream gradient.
    The caller forms dx = G @ weight and dW = G.T @ hidden.
    """
    cfg = {**kernel_config(hidden.device, hidden.dtype), **(config or {})}
    hidden, weight, targets = _unit_stride(hidden), _unit_stride(weight), targets.contiguous()
    n, h = hidden.shape
    v = weight.shape[0]
    grad = torch.empty(n, v, dtype=hidden.dtype, device=hidden.device)
    dot_fp32, ieee = _dot_flags(hidden.dtype)
    grid = (triton.cdiv(n, cfg["block_n"]), triton.cdiv(v, cfg["block_v"]))
    _logit_grad_kernel[grid](
        hidden, weight, targets, lse.float().contiguous(), dlogp.float().contiguous(), grad,
        n, v, h, hidden.stride(0), weight.stride(0), grad.stride(0), 1.0 / temperature,
        BLOCK_N=cfg["block_n"], BLOCK_V=cfg["block_v"], BLOCK_H=cfg["block_h"],
        DOT_FP32=dot_fp32, IEEE=ieee, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return grad
