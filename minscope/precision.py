"""Why the toy computes in float64: its numbers must not depend on the CPU.

A sampled RL run is chaotic: one token drawn differently changes every later step. In
float32 the last bits of a matmul, a softmax or a sum depend on the kernel that computed
them, and the kernel depends on the CPU (ATen picks AVX-512, AVX2 or plain code at start-up,
BLAS libraries pick their own, Apple's chips have others). A difference of one float32 ulp
(~1e-7) in a probability flips a draw whenever the uniform number lands within 1e-7 of a
boundary; a toy run draws ~10^6 tokens, so float32 runs on two CPUs part within a few steps
(measured: RL (Single), seed 0, ended at 0.129 with ATEN_CPU_CAPABILITY=default and at 0.235
with avx512 on the same machine). In float64 the kernels still round differently, but by
~1e-16: a draw flips with odds of about 1e-16 per token, and the whole run is the same on
every CPU (docs/DESIGN_NOTES.md, "The same numbers on every CPU", has the measurements).

The tiny models are 64 wide, so float64 costs little: their time goes to Python overhead,
not arithmetic. Real models stay in float32/bfloat16; nothing here changes them.

This module holds the pieces that make float64 stick:
  `wide(dtype)`      the dtype arithmetic is done in: at least float32, float64 kept. Code
                     that used to write `.float()` (to accumulate bf16 in fp32) uses it, so
                     a float64 model is never rounded down to float32 half-way.
  `to_float64(model)` the model in float64, including the two places where transformers'
                     Llama computes in float32 whatever the weights are (RMSNorm and the
                     rotary embedding's cos/sin tables).
  `work_dtype(model)` the dtype of the tensors built around a model (rewards, advantages).
  `round_parameters`  after every optimiser step, the float64 parameters are rounded to
                     float32's precision. Without it float64 alone is not enough: GRPO with
                     AdamW amplifies a difference in the parameters about 1.9x per step
                     (measured: 1e-16 at step 0, 1e-3 at step 48, then the draws part), so
                     two CPUs' runs drift apart. Rounded, a 1e-16 difference is wiped out at
                     every step unless a value sits within 1e-16 of a rounding boundary
                     (odds ~1e-9 per parameter and step); it never gets to grow.
  `rounded(record)`  what a toy arm logs: 6 significant digits, nothing below 1e-12. The
                     metrics computed from identical parameters and draws still differ
                     between CPUs in the 15th digit (sums in another order), and a quantity
                     that is 0 in exact arithmetic (the log-ratio of a snapshot that equals
                     the live adapter) comes out as CPU-dependent noise of ~1e-16.
"""

from __future__ import annotations

import math
import types

import torch


def wide(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32, integers, bool) is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widen(t: torch.Tensor) -> torch.Tensor:
    """`t` in `wide(t.dtype)` (no copy when it already is)."""
    return t.to(wide(t.dtype))


def work_dtype(model) -> torch.dtype:
    """float64 for a float64 model (the toy's), float32 otherwise."""
    return wide(next(model.parameters()).dtype)


def _rms_norm_forward(self, hidden_states):
    # transformers' RMSNorm casts to float32 before the mean square; here the input's width
    # is kept when it is float64 (for float32 inputs this is the same computation)
    dtype = hidden_states.dtype
    h = widen(hidden_states)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _rotary_forward(self, x, position_ids):
    # the default rotary embedding, with positions, angles and cos/sin in float64
    freqs = position_ids[..., None].double() * self.inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotary_inv_freq(config) -> torch.Tensor:
    """The default RoPE's inverse frequencies, computed in float64 (transformers computes
    them in float32, whose `pow` differs in its last bit between vector units)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def to_float64(model):
    """`model` (a tiny transformers Llama or Qwen3) in float64, every step of its forward in
    float64. Returns the model. Refuses a rotary embedding other than the default one."""
    model.double()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_forward, module)
        elif name.endswith("RotaryEmbedding"):
            if getattr(module, "rope_type", "default") != "default":
                raise ValueError(f"to_float64: only the default rotary embedding, not {module.rope_type!r}")
            module.inv_freq = rotary_inv_freq(module.config).to(module.inv_freq.device)
            module.forward = types.MethodType(_rotary_forward, module)
    return model


@torch.no_grad()
def round_parameters(params) -> None:
    """After an optimiser step: round every float64 parameter to float32's precision (and keep
    it in float64). Others are left alone. See the module's docstring for why."""
    for p in params:
        if p.dtype == torch.float64:
            p.copy_(p.to(torch.float32))


SIGNIFICANT_DIGITS = 6
DECIMALS = 12          # the float64 noise floor of a sum of numbers near 1 is ~1e-16


def rounded(value, digits: int = SIGNIFICANT_DIGITS):
    """`value` (a record: dicts, lists, numbers, strings) with every float rounded to `digits`
    significant digits and to `DECIMALS` decimal places; non-finite floats and everything
    else unchanged."""
    if isinstance(value, float):
        return round(float(f"{value:.{digits}g}"), DECIMALS) + 0.0 if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rounded(v, digits) for v in value)
    return value
