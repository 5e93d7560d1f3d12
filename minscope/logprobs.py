"""Per-token log-probs (and entropy) from final hidden states and the LM head, without [N, V] logits.

For N tokens with hidden states x [N, H], LM head W [V, H], target ids y [N], temperature T:

    z       = x @ W.T / T                            [N, V]  (151,936 columns for Qwen3)
    logp    = z[y] - logsumexp(z)                    [N]
    entropy = logsumexp(z) - sum_v softmax(z)_v z_v  [N]
    d logp / dx = (onehot(y) - softmax(z)) @ W / T   (and d logp / dW = (...).T @ x / T)

At N = 16,384 and Qwen3's vocabulary, z alone is 10 GB in fp32, and autograd through
`log_softmax(x @ W.T).gather(...)` keeps several such tensors. Here a custom autograd
Function walks the rows in chunks of `chunk_size`: the forward keeps only logsumexp per
row, and the backward recomputes each chunk's logits. Peak extra memory is a few
[chunk_size, V] blocks instead of a few [N, V] ones.

Three backends compute the same thing:
  "torch"  plain PyTorch chunks (every device; the reference path);
  "triton" fused kernels from `minscope.triton_logprobs` (CUDA; on CPU only under
           TRITON_INTERPRET=1, for tests): the forward never writes a [chunk, V] block.
  "cublas" per chunk, cuBLAS writes fp32 logits, one Triton pass per row turns them into the
           statistics and (in place, in the input dtype) the logit gradient, cuBLAS does dx
           (`minscope.cublas_logprobs`; CUDA, or TRITON_INTERPRET=1 on CPU for tests).
  "auto"   triton when the hidden states are on CUDA and Triton imports, else torch. (Which of
           triton and cublas is faster is for bench/logprobs.py on a GPU to say; until it has,
           auto keeps the measured triton path.)

Without a gradient to compute (torch.no_grad(), or neither hidden nor weight requires grad:
evaluation, the reference model's log-probs) `token_logprobs` runs the forward chunks only
and keeps nothing for a backward pass.

bf16/fp16 inputs: the matmuls run in the input dtype, the softmax maths in fp32, and the
outputs (log-probs, entropy) are fp32. fp64 inputs (the toy's models, minscope/precision.py)
stay fp64 throughout.

`fused_grpo_token_loss` goes one step further for the GRPO loss. The loss is a sum over
tokens of a function of each token's own log-prob, so its derivative g = dloss/dlogp is
known as soon as a chunk's log-probs are: the forward computes the gradient w.r.t. x
(and W) on the spot and the backward only scales it. With the torch backend that is two
matmuls per chunk (logits, dx) instead of three (logits, recomputed logits, dx), at the
price of holding the fp32 logits of one chunk. The triton backend goes further: its
statistics kernel also writes each tile's exp(z - running max) in the input dtype, and
the dx matmul makes the gradient from them tile by tile inside its own loop, so no
gradient block [chunk, V] is ever written (see `minscope.triton_logprobs`). Nothing
besides dx (and dW) has to be kept for the backward.
The cublas backend gets the same two matmuls from cuBLAS itself: its row pass works out
dloss/dlogp of each row inside the kernel, right after the row's log-prob, and writes G over
that chunk's logits (see `minscope.cublas_logprobs`).

The gradient w.r.t. W is summed over row chunks in fp32 and only cast to W's dtype at the
end. The weight is usually frozen (LoRA); tiny models trained from scratch do need it.

One file, though long: the forward and the backward of the chunked log-prob must agree chunk
for chunk, so they stay side by side.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch.torch_version import TorchVersion

from . import grpo
from .precision import wide, widen

BACKENDS = ("auto", "torch", "triton", "cublas")


# --------------------------------------------------------------------------- public API
def token_logprobs(hidden, weight, targets, temperature: float = 1.0, return_entropy: bool = False,
                   chunk_size: int = 1024, backend: str = "auto"):
    """Log-probs of `targets` under softmax(hidden @ weight.T / temperature).

    hidden [..., H] (e.g. [B, T, H] or [N, H]); weight [V, H] (the LM head, see
    `adapters.output_embedding`); targets [...] int ids in [0, V). Returns fp32 log-probs
    [...], and with `return_entropy` also the fp32 entropy [...] of each token's
    distribution (detached). Differentiable w.r.t. hidden and, when it requires grad, weight.
    """
    lead_shape = targets.shape
    x, y = _flatten(hidden, weight, targets, chunk_size, temperature)
    use = resolve_backend(backend, x)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        logp, entropy = _ChunkedTokenLogProbs.apply(x, weight, y, float(temperature), int(chunk_size),
                                                    use, bool(return_entropy))
    else:   # forward only: no autograd node, nothing saved
        logp, _, entropy = _forward_stats(x, weight, y, float(temperature), int(chunk_size), use,
                                          bool(return_entropy))
    if return_entropy:
        return logp.view(lead_shape), entropy.view(lead_shape)
    return logp.view(lead_shape)


def fused_grpo_token_loss(hidden, weight, targets, old_logp, ref_logp, advantages, token_weights,
                          eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0,
                          temperature: float = 1.0, backend: str = "auto",
                          return_entropy: bool = True, chunk_size: int = 1024):
    """GRPO loss = sum(token_weights * grpo.token_loss(logp, ...)) with the LM head fused in.

    hidden [..., H], weight [V, H], targets [...]; old_logp, ref_logp (None when beta == 0),
    advantages and token_weights are per-token [...] tensors, already broadcast and masked
    (token_weights carry the mask and the normaliser, see `grpo.aggregation_weights`); they
    are constants (no gradient flows into them). Returns (loss scalar, logp [...] detached,
    entropy [...] detached or None when return_entropy is False).
    """
    lead_shape = targets.shape
    x, y = _flatten(hidden, weight, targets, chunk_size, temperature)
    if ref_logp is None and beta:
        raise ValueError("beta > 0 needs ref_logp (the reference model's log-probs)")

    def per_token(name, t):
        if t is None:
            return None
        if t.shape != lead_shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but targets have {tuple(lead_shape)}; "
                             "broadcast per-sequence values to tokens first")
        return widen(t.detach().reshape(-1))

    consts = [per_token(n, t) for n, t in (("old_logp", old_logp), ("ref_logp", ref_logp),
                                           ("advantages", advantages), ("token_weights", token_weights))]
    use = resolve_backend(backend, x)
    loss, logp, entropy = _FusedGRPOTokenLoss.apply(
        x, weight, y, *consts, float(eps_low), float(eps_high), float(beta), float(temperature),
        int(chunk_size), use, bool(return_entropy))
    return loss, logp.view(lead_shape), (entropy.view(lead_shape) if return_entropy else None)


def resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """"torch", "triton" or "cublas" for `backend` in BACKENDS and these hidden states."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS} "
                         "('auto' picks triton on CUDA when a tiny Triton launch works, torch otherwise)")
    if backend == "auto":
        return "triton" if hidden.is_cuda and triton_available() and triton_launches(hidden.device) else "torch"
    if backend in ("triton", "cublas"):   # both run Triton kernels
        if not triton_available():
            raise ValueError(f"backend={backend!r} but Triton does not import; pip install triton, "
                             "or use backend='torch'")
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend={backend!r} needs CUDA tensors (got {hidden.device}); on CPU "
                             "use backend='torch', or set TRITON_INTERPRET=1 before importing "
                             "triton to run the kernels in the (slow) interpreter")
    return backend


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether `import triton` works here (checked once per process)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def _tiny_launch(device) -> None:
    """One small Triton kernel launch: the first launch builds Triton's C launcher, which needs a
    C compiler, Python.h and libcuda (found through ldconfig; on WSL2 it is in /usr/lib/wsl/lib)."""
    from . import triton_logprobs

    x = torch.randn(4, 16, device=device)
    w = torch.randn(32, 16, device=device)
    triton_logprobs.softmax_stats(x, w, torch.zeros(4, dtype=torch.long, device=device))
    if x.is_cuda:
        torch.cuda.synchronize(device)


_LAUNCHES: dict = {}     # device -> whether a Triton kernel launches there (tried once per process)


def triton_launches(device, note=None) -> bool:
    """Whether a tiny Triton launch works on `device` (tried once per process and device); when
    it fails, "auto" falls back to torch with a one-line note (`note`, default: stderr)."""
    key = str(device)
    if key not in _LAUNCHES:
        try:
            _tiny_launch(device)
            _LAUNCHES[key] = True
        except Exception as e:   # noqa: BLE001 - no compiler, no Python.h, no libcuda, a driver error ...
            cause = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            (note or (lambda m: print(m, file=sys.stderr)))(
                f"note: Triton cannot launch a kernel here ({type(e).__name__}: {cause}); log-probs use the torch "
                "backend (Triton needs a C compiler, the Python headers (python3-dev) and libcuda; "
                "--logprob-backend torch skips this try)")
            _LAUNCHES[key] = False
    return _LAUNCHES[key]


def backend_for(backend: str, device) -> str:
    """The backend `resolve_backend` picks for hidden states on `device` (the run's start-up line)."""
    if torch.device(device).type != "cuda":
        return "torch" if backend == "auto" else backend
    return resolve_backend(backend, _OnDevice(device))


class _OnDevice:
    """Stands for hidden states on a CUDA device (is_cuda, device) without allocating any."""
    is_cuda = True

    def __init__(self, device):
        self.device = torch.device(device)


# ------------------------------------------------------------------------------- checks
def _flatten(hidden, weight, targets, chunk_size, temperature):
    """hidden [..., H] -> [N, H] with a contiguous last dim, targets [...] -> [N] int64."""
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden [..., H] and weight [V, H] must share H; got hidden "
                         f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}; "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # The LM head's dtype decides the matmul dtype (the cast is differentiable).
    x = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, targets.reshape(-1).long().contiguous()


# ------------------------------------------------------------------- torch chunk helpers
# torch >= 2.8 lets a bf16/fp16 GEMM on CUDA write an fp32 result (`out_dtype`), so the
# logits and the summed weight gradient are never rounded to 8 bits of mantissa.
_CUDA_MM_OUT_DTYPE = TorchVersion(torch.__version__) >= (2, 8)


def _mm_fp32(a, b):
    """a @ b as fp32 (fp64 for fp64 inputs), the product computed in the inputs' dtype with
    fp32 accumulation."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda and _CUDA_MM_OUT_DTYPE:
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()          # CPU: no fp32-output kernel for bf16; round then widen


_ADDMM_OUT_DTYPE = [True]           # until a torch build refuses an fp32 `acc` with bf16 factors


def _addmm_fp32_(acc, a, b):
    """acc += a @ b with acc fp32 [V, H] (the weight gradient, summed over row chunks; fp64 for fp64)."""
    if a.dtype in (torch.float32, torch.float64):
        acc.addmm_(a, b)
    elif a.is_cuda and _CUDA_MM_OUT_DTYPE:
        if _ADDMM_OUT_DTYPE[0]:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                return
            except RuntimeError:     # some builds want self and mat2 in one dtype
                _ADDMM_OUT_DTYPE[0] = False
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))     # one fp32 [V, H] temporary
    else:
        acc.addmm_(a.float(), b.float())


def _chunk_logits(x_chunk, weight, temperature):
    """z = x @ W.T / T as fp32 [C, V]: matmul in the input dtype, a fresh tensor we may overwrite."""
    z = _mm_fp32(x_chunk, weight.T)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _torch_softmax_stats(z, y_chunk, want_entropy, want_probs):
    """logp [C], lse [C], entropy [C] or None, softmax(z) [C, V] or None, from fp32 logits z.

    z [C, V] is overwritten: each elementwise pass over a [C, V] block costs memory traffic,
    so we make as few as we can and allocate a second block only for the entropy.
    """
    z_target = z.gather(1, y_chunk[:, None]).squeeze(1)               # [C]
    row_max = z.amax(dim=-1, keepdim=True)                            # [C, 1]
    z.sub_(row_max)                                                   # z - m <= 0: exp is safe
    if want_entropy:
        # sum_v p_v z_v needs z and exp(z) side by side: the one extra block
        e = z.exp()
        sumexp = e.sum(dim=-1)
        entropy = torch.log(sumexp) - torch.linalg.vecdot(e, z) / sumexp   # = lse - sum p z
    else:
        e = z.exp_()
        sumexp = e.sum(dim=-1)
        entropy = None
    lse = row_max.squeeze(1) + torch.log(sumexp)
    probs = e.div_(sumexp[:, None]) if want_probs else None
    return z_target - lse, lse, entropy, probs


def _probs_to_logit_grad(probs, y_chunk, dlogp, temperature, dtype):
    """d(sum dlogp * logp)/d(x @ W.T) = dlogp * (onehot - probs) / T, overwriting probs."""
    scale = (dlogp / temperature)[:, None]                            # [C, 1]
    grad = probs.mul_(-scale)
    grad.scatter_add_(1, y_chunk[:, None], scale)
    return grad.to(dtype)


def _chunk_stats(x_chunk, weight, y_chunk, temperature, want_entropy, backend):
    """logp, lse, entropy (or None) for one chunk of rows; no [C, V] survives."""
    if backend == "triton":
        from . import triton_logprobs
        logp, lse, entropy = triton_logprobs.softmax_stats(x_chunk, weight, y_chunk, temperature)
        return logp, lse, (entropy if want_entropy else None)
    if backend == "cublas":
        from . import cublas_logprobs
        z = cublas_logprobs.chunk_logits(x_chunk, weight)               # [C, V] fp32, raw
        return cublas_logprobs.row_stats(z, y_chunk, temperature, want_entropy)
    z = _chunk_logits(x_chunk, weight, temperature)
    logp, lse, entropy, _ = _torch_softmax_stats(z, y_chunk, want_entropy, want_probs=False)
    return logp, lse, entropy


def _chunk_logit_grad(x_chunk, weight, y_chunk, lse, dlogp, temperature, backend):
    """G [C, V] in the input dtype, from recomputed logits."""
    if backend == "triton":
        from . import triton_logprobs
        return triton_logprobs.logit_grad(x_chunk, weight, y_chunk, lse, dlogp, temperature)
    if backend == "cublas":
        from . import cublas_logprobs
        z = cublas_logprobs.chunk_logits(x_chunk, weight)
        return cublas_logprobs.grad_in_place(z, y_chunk, lse, dlogp, temperature, x_chunk.dtype)
    z = _chunk_logits(x_chunk, weight, temperature)
    probs = z.sub_(lse[:, None]).exp_()                                # [C, V] softmax, in place
    return _probs_to_logit_grad(probs, y_chunk, dlogp, temperature, x_chunk.dtype)


class _GradAccumulator:
    """dx [N, H] row block by row block; dW [V, H] summed over chunks in fp32."""

    def __init__(self, x, weight, need_dx, need_dw):
        self.dx = torch.empty_like(x) if need_dx else None
        self.dw = torch.zeros(weight.shape, dtype=wide(weight.dtype), device=weight.device) if need_dw else None
        self.weight = weight

    def add(self, rows: slice, x_chunk, grad_chunk):                   # grad_chunk [C, V]
        if self.dx is not None:
            self.dx[rows] = grad_chunk @ self.weight                   # [C, H]
        if self.dw is not None:
            _addmm_fp32_(self.dw, grad_chunk.T, x_chunk)               # [V, H]

    def result(self):
        return self.dx, (self.dw.to(self.weight.dtype) if self.dw is not None else None)


# ------------------------------------------------------------------- autograd functions
def _forward_stats(x, weight, targets, temperature, chunk_size, backend, want_entropy):
    """(logp [N], lse [N], entropy [N] or None), chunk by chunk; nothing else survives."""
    n, dtype = x.shape[0], wide(x.dtype)
    logp = torch.empty(n, dtype=dtype, device=x.device)
    entropy = torch.empty(n, dtype=dtype, device=x.device) if want_entropy else None
    lse = torch.empty(n, dtype=dtype, device=x.device)
    # The triton forward holds no [C, V] block, so it takes all rows in one launch.
    step = n if backend == "triton" else chunk_size
    for start in range(0, n, max(step, 1)):
        rows = slice(start, start + step)
        lp, ls, ent = _chunk_stats(x[rows], weight, targets[rows], temperature, want_entropy, backend)
        logp[rows], lse[rows] = lp, ls
        if want_entropy:
            entropy[rows] = ent
    return logp, lse, entropy


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """(logp [N], entropy [N] or None); saves x, W, y and lse [N] only."""

    @staticmethod
    def forward(ctx, x, weight, targets, temperature, chunk_size, backend, want_entropy):
        logp, lse, entropy = _forward_stats(x, weight, targets, temperature, chunk_size, backend,
                                            want_entropy)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.settings = (temperature, chunk_size, backend)
        if want_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, weight, targets, lse = ctx.saved_tensors
        temperature, chunk_size, backend = ctx.settings
        grads = _GradAccumulator(x, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        grad_logp = widen(grad_logp)
        for start in range(0, x.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            g = _chunk_logit_grad(x[rows], weight, targets[rows], lse[rows], grad_logp[rows],
                                  temperature, backend)
            grads.add(rows, x[rows], g)
            del g           # free this chunk's [C, V] block before the next one is made
        dx, dw = grads.result()
        return dx, dw, None, None, None, None, None


def _grpo_dloss_dlogp(logp, old_logp, ref_logp, advantages, token_weights, eps_low, eps_high, beta):
    """(sum(w * token_loss), d/dlogp of it [C]) by autograd on the [C] vector of log-probs."""
    with torch.enable_grad():
        lp = logp.detach().requires_grad_(True)
        # token_weights carry the mask: no KL (no exp) where a token is not trained
        per_token, _, _ = grpo.token_loss(lp, old_logp, ref_logp, advantages, eps_low, eps_high, beta,
                                          mask=token_weights)
        loss = (token_weights * per_token).sum()
        (dlogp,) = torch.autograd.grad(loss, lp)
    return loss.detach(), dlogp


class _FusedGRPOTokenLoss(torch.autograd.Function):
    """(loss, logp, entropy) with d loss/dx (and dW) computed during the forward."""

    @staticmethod
    def forward(ctx, x, weight, targets, old_logp, ref_logp, advantages, token_weights,
                eps_low, eps_high, beta, temperature, chunk_size, backend, want_entropy):
        n = x.shape[0]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = _GradAccumulator(x, weight, need_dx, need_dw)
        dtype = wide(x.dtype)        # fp32, or fp64 for the toy's fp64 models (precision.py)
        logp = torch.empty(n, dtype=dtype, device=x.device)
        entropy = torch.empty(n, dtype=dtype, device=x.device) if want_entropy else None
        loss = torch.zeros((), dtype=dtype, device=x.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            x_c, y_c = x[rows], targets[rows]
            if backend == "cublas":
                # cuBLAS logits, one Triton pass (statistics, dloss/dlogp, G over the logits), cuBLAS dx
                from . import cublas_logprobs
                z = cublas_logprobs.chunk_logits(x_c, weight)               # [C, V] fp32, raw
                ref_c = ref_logp[rows] if ref_logp is not None else None
                lp, _, ent, _, g = cublas_logprobs.grpo_in_place(
                    z, y_c, old_logp[rows], ref_c, advantages[rows], token_weights[rows], eps_low,
                    eps_high, beta, temperature, want_entropy, x.dtype)
                logp[rows] = lp
                if want_entropy:
                    entropy[rows] = ent
                if need_dx or need_dw:
                    grads.add(rows, x_c, g)
                del z, g     # the next chunk's logits reuse this block
                continue
            if backend == "torch":
                # one logits matmul serves the statistics and the gradient
                z = _chunk_logits(x_c, weight, temperature)            # [C, V] fp32
                lp, _, ent, probs = _torch_softmax_stats(z, y_c, want_entropy, want_probs=True)
                if want_entropy:
                    entropy[rows] = ent
                del z
            else:
                # the kernel stores the chunk's exp(z - m) from the tiles it computes anyway
                from . import triton_logprobs
                lp, lse, ent, stored = triton_logprobs.softmax_stats(x_c, weight, y_c, temperature,
                                                                     store_probs=True)
                if want_entropy:
                    entropy[rows] = ent
            logp[rows] = lp
            ref_c = ref_logp[rows] if ref_logp is not None else None
            chunk_loss, dlogp = _grpo_dloss_dlogp(lp, old_logp[rows], ref_c, advantages[rows],
                                                  token_weights[rows], eps_low, eps_high, beta)
            loss += chunk_loss
            if backend == "triton" and need_dx and not need_dw:
                # frozen LM head (LoRA): dx straight from the stored p, G never in memory
                grads.dx[rows] = triton_logprobs.dx_from_probs(stored, y_c, lse, dlogp, weight, temperature)
            elif need_dx or need_dw:
                if backend == "torch":
                    g = _probs_to_logit_grad(probs, y_c, dlogp, temperature, x.dtype)
                else:
                    g = triton_logprobs.grad_from_probs(stored, y_c, lse, dlogp, temperature)
                grads.add(rows, x_c, g)
                del g
            probs = stored = None    # free this chunk's [C, V] block before the next one is made
        if backend == "cublas":      # the kernel made dloss/dlogp; the loss value from all log-probs
            per_token, _, _ = grpo.token_loss(logp, old_logp, ref_logp, advantages, eps_low, eps_high,
                                              beta, mask=token_weights)
            loss = (token_weights * per_token).sum()
        dx, dw = grads.result()
        ctx.save_for_backward(dx, dw)
        ctx.mark_non_differentiable(*([logp, entropy] if want_entropy else [logp]))
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, grad_entropy):
        dx, dw = ctx.saved_tensors
        dx = dx * grad_loss.to(dx.dtype) if dx is not None else None
        dw = dw * grad_loss.to(dw.dtype) if dw is not None else None
        return (dx, dw) + (None,) * 12

