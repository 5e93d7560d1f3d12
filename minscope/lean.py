"""A lean forward pass for Llama models on the CPU, used by `sampling.sample`.

The toy's models are 64 wide and 2 layers deep: one decode step of 64 conversations is
about a millisecond of arithmetic, and the general forward of transformers + peft spends
several times that in Python (argument handling, hooks, output objects, per-layer checks).
A real Llama on the CPU (SmolLM2-135M: 30 layers, 7 LoRA layers each) pays the same overhead
per layer, and most where rows carry different adapters (Population's pool): peft's mixed
batch rebuilds every adapter's row list, with a Python loop over the rows, in each of its
210 LoRA layers, and gathers and scatters each sub-batch through Python-list indices
(docs/BENCHMARKS.md, "Where a decode step goes": ~50 ms of a 172 ms step).

This module runs the SAME operations on the same weights in the same order, without that
machinery: the embedding, rotary embedding, RMSNorm, attention through the kept KV cache
(`kvcache.KVCache.update`) with sdpa, the MLP, the LM head of the last position, and
peft's vanilla LoRA (one active adapter, or one adapter per row as peft's mixed batches do:
each adapter's product on its own sub-batch, added to the base product of its rows). The
rows of each adapter are found once per forward, as one index tensor, not once per layer as
Python lists. So its logits are bit-identical to the general path's
(tests/test_lean.py checks it, on a tiny Llama and on SmolLM2).

For float32 models on an MKL CPU its products of a few rows (the decode steps) read packed
weights instead (minscope/packed.py: faster, the same tokens, logits within float32 rounding);
`packed.PACKED = False` gives the bit-identical path above.

`lean_forward(model)` returns None for anything else (other architectures, eager attention,
merged or non-vanilla LoRA, LoRA dropout, 4-bit layers, forward hooks on any module, a model on a GPU,
rope scaling...): those keep the general path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import packed
from .precision import wide, widen


def lean_forward(model):
    """A function (input_ids, mask, position_ids, cache, adapter_names, keep=1) -> last logits [B, V]
    (or the last `keep` positions' [B, keep, V])
    equivalent to `model(...)` as `sampling._Forward` calls it, or None if `model` is not a
    Llama (with or without vanilla LoRA adapters) on the CPU."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import Linear as LoraLinear
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    peft_model = model if isinstance(model, PeftModel) else None
    base = model.get_base_model() if peft_model is not None else model
    if not isinstance(base, LlamaForCausalLM):
        return None
    cfg = base.config
    if (getattr(cfg, "_attn_implementation", None) != "sdpa"
            or cfg.rope_parameters.get("rope_type", "default") != "default" or cfg.hidden_act != "silu"
            or getattr(cfg, "pretraining_tp", 1) != 1 or cfg.attention_bias or cfg.mlp_bias
            or next(base.parameters()).device.type != "cpu"):
        return None
    if type(base.model.embed_tokens) is not torch.nn.Embedding:
        return None
    hooks = torch.nn.modules.module
    if (hooks._global_forward_hooks or hooks._global_forward_pre_hooks
            or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())):
        return None       # someone watches or changes a module's output: the general path calls them
    if any(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for m in base.modules()):
        return None       # a quantized layer (bitsandbytes' Linear4bit packs its weight): its own forward
    linears = [m for m in base.modules() if isinstance(m, LoraLinear)]
    for m in linears:
        if m.merged or m.lora_variant or any(not isinstance(d, torch.nn.Identity) for d in m.lora_dropout.values()):
            return None
    return _LeanLlama(base)


def _linear(mod, x, groups, store=None):
    """nn.Linear, or peft's lora.Linear exactly as its forward computes it; with a packed
    `store` (minscope/packed.py) and few rows, the same products from packed weights (one
    active adapter: its merged weight, one product)."""
    few_rows = store is not None and store.fits(x)
    base = getattr(mod, "base_layer", None)
    if base is None:
        return store.product(x, store.base_weight(mod), mod.weight) if few_rows else F.linear(x, mod.weight, mod.bias)
    if few_rows and groups is None and not mod.disable_adapters:
        active = [n for n in mod.active_adapters if n in mod.lora_A]
        if len(active) == 1 and mod.lora_A[active[0]].bias is None and mod.lora_B[active[0]].bias is None:
            return store.product(x, store.merged_weight(mod, active[0]), base.weight)
    result = store.product(x, store.base_weight(base), base.weight) if few_rows else F.linear(x, base.weight, base.bias)
    if mod.disable_adapters:
        return result
    if groups is None:                               # lora.Linear.forward, vanilla LoRA
        for name in mod.active_adapters:
            if name not in mod.lora_A:
                continue
            a, b = mod.lora_A[name], mod.lora_B[name]
            result = result + F.linear(F.linear(x, a.weight, a.bias), b.weight, b.bias) * mod.scaling[name]
        return result
    for name, index in groups:                       # lora.Linear._mixed_batch_forward
        if name == "__base__" or name not in mod.lora_A:
            continue
        a, b = mod.lora_A[name], mod.lora_B[name]
        # the same gather (a fresh contiguous copy: a view of the rows can round differently
        # in the product), product and scatter-add as peft's x[rows] / result[rows] += ...
        lora = F.linear(F.linear(x.index_select(0, index), a.weight, a.bias), b.weight, b.bias) * mod.scaling[name]
        result.index_add_(0, index, lora)
    return result


def row_groups(adapter_names: list[str], device) -> list:
    """(adapter, index tensor of its rows) per adapter in the batch, found once per forward
    (peft's mixed batch finds the same sub-batches again in every LoRA layer)."""
    rows: dict[str, list[int]] = {}
    for i, name in enumerate(adapter_names):
        rows.setdefault(name, []).append(i)
    return [(name, torch.tensor(idx, device=device)) for name, idx in rows.items()]


def _rms_norm(norm, h):
    # LlamaRMSNorm.forward: in float32, or float64 for the toy's float64 models (precision.py)
    hw = widen(h)
    hw = hw * torch.rsqrt(hw.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * hw.to(h.dtype)


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class _LeanLlama:
    def __init__(self, base):
        self.base, self.lm = base, base.model
        cfg = base.config
        self.n_layers = cfg.num_hidden_layers
        attn = self.lm.layers[0].self_attn
        self.head_dim, self.groups_kv, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        self.store = packed.store_for(base)    # float32 on an MKL CPU: packed decode products

    @torch.no_grad()
    def __call__(self, input_ids, mask, position_ids, cache, adapter_names=None, keep: int = 1):
        groups = None if adapter_names is None else row_groups(adapter_names, input_ids.device)
        st = self.store if packed.PACKED else None
        lm = self.lm
        emb = lm.embed_tokens
        h = F.embedding(input_ids, emb.weight, emb.padding_idx, emb.max_norm, emb.norm_type,
                        emb.scale_grad_by_freq, emb.sparse)
        rope = lm.rotary_emb          # LlamaRotaryEmbedding.forward, default rope (float64 models: precision.py)
        angle = wide(h.dtype)
        freqs = position_ids[..., None].to(angle) * rope.inv_freq.to(device=h.device, dtype=angle)
        e = torch.cat((freqs, freqs), dim=-1)
        cos = (e.cos() * rope.attention_scaling).to(dtype=h.dtype).unsqueeze(1)
        sin = (e.sin() * rope.attention_scaling).to(dtype=h.dtype).unsqueeze(1)
        B, S = input_ids.shape
        shape = (B, S, -1, self.head_dim)
        for idx, layer in enumerate(lm.layers[:self.n_layers]):
            residual = h
            x = _rms_norm(layer.input_layernorm, h)
            at = layer.self_attn
            q = _linear(at.q_proj, x, groups, st).view(shape).transpose(1, 2)
            k = _linear(at.k_proj, x, groups, st).view(shape).transpose(1, 2)
            v = _linear(at.v_proj, x, groups, st).view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.update(k, v, idx)
            n_rep = self.groups_kv
            if n_rep > 1 and S == 1:      # sdpa_attention_forward: pack_gqa for one query
                q = q.reshape(q.shape[0], q.shape[1] // n_rep, n_rep, q.shape[-1])
            elif n_rep > 1:               # repeat_kv
                b, kvh, sl, hd = k.shape
                k = k[:, :, None].expand(b, kvh, n_rep, sl, hd).reshape(b, kvh * n_rep, sl, hd)
                v = v[:, :, None].expand(b, kvh, n_rep, sl, hd).reshape(b, kvh * n_rep, sl, hd)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling,
                                                 is_causal=False)
            out = out.reshape(out.shape[0], -1, S, v.shape[-1]).transpose(1, 2).contiguous()
            out = out.reshape(B, S, -1).contiguous()
            h = residual + _linear(at.o_proj, out, groups, st)
            residual = h
            x = _rms_norm(layer.post_attention_layernorm, h)
            mlp = layer.mlp
            x = _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x, groups, st)) * _linear(mlp.up_proj, x, groups, st),
                        groups, st)
            h = residual + x
        h = _rms_norm(lm.norm, h)
        logits = widen(_linear(self.base.lm_head, h[:, -keep:, :], groups, st))
        return logits[:, -1] if keep == 1 else logits
