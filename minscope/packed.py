"""Decode products through MKL's packed GEMM: the weights laid out once for a few-row product.

A decode step multiplies a handful of rows (8 conversations) by every weight of the model.
At so few rows the product only streams the weights, and MKL's plain sgemm streams them at
well under the memory bandwidth. On a 2-core AVX-512 Xeon (docs/BENCHMARKS.md, "The real
step against the machine's limits"), SmolLM2's LM head, 49,152 x 576, took 14.6 ms at 8 rows
(7.8 GB/s), and the same product on weights packed for 8 rows 7.3 ms. MKL packs
a weight for a given number of rows (`torch.ops.mkl._mkl_reorder_linear_weight`, the
prepacked sgemm torch's own CPU compiler uses); a product of fewer rows is padded with zero
rows to that number, which changes nothing in the real rows (each output row depends only on
its own input row; a test checks it).

A LoRA layer's product is `W x + s B (A x)`: three products, two of them of 8-row width,
whose calls cost more than their arithmetic (with one adapter a decode step took 113 ms,
adapters off 80 ms). For one adapter at a time (the policy's turns; a simulator's) the
packed weight is the merged
`W + s B A`, one product. It is re-made when the adapter's weights change (each optimiser
step bumps the parameters' version counter), once per rollout, not per token.

What this changes: the rounding of the products, not what they compute. Logits differ from
the unpacked path by float32 rounding (~1e-5, tests/test_packed.py bounds it); the sampled
tokens are the same except where a uniform number falls within that distance of a boundary.
The sampled log-probs are recorded from the logits actually sampled from, so the update's
importance ratio stays that of the distribution that drew each token. float64 models (the toy's,
minscope/precision.py) never take this path: MKL packs float32 only, and the toy's numbers stay
bit-identical on every CPU.

Memory: one packed copy of the weights (the base's, for frozen simulators and the per-row
path) and one per merged adapter (at most `MAX_MERGED`), each the size of the fp32 weights
(560 MiB for SmolLM2). Models over `MAX_BYTES` of weights are not packed. `PACKED = False`
turns it off (the tests that check the lean path against transformers' bit for bit do).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
import torch.nn.functional as F

PACKED = True          # float32 models on an MKL CPU pack their decode products
ROWS = 8               # products of at most this many rows use the packed weights (padded to it)
MAX_MERGED = 2         # adapters kept merged at once (the policy and one simulator)
MAX_BYTES = 1 << 30    # models with more float32 weight bytes than this are not packed

_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def available() -> bool:
    """Whether this torch has MKL's packed sgemm (x86 builds with MKL; not Apple silicon)."""
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def store_for(base) -> "Store | None":
    """The packed weights of `base` (a transformers model), made lazily; None when off, not
    float32, too large, or this torch has no packed sgemm."""
    if not PACKED or not available():
        return None
    if base in _STORES:
        return _STORES[base]
    params = list(base.parameters())
    ok = all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
    ok = ok and sum(p.numel() * 4 for p in params) <= MAX_BYTES
    store = Store() if ok and Store.works() else None
    _STORES[base] = store
    return store


def lora_key(mod, name: str) -> tuple:
    """What the merged weight of adapter `name` in `mod` depends on: its tensors' identity,
    version counters (bumped by every in-place update) and scaling."""
    a, b = mod.lora_A[name].weight, mod.lora_B[name].weight
    return (a.data_ptr(), a._version, b.data_ptr(), b._version, float(mod.scaling[name]))


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), ROWS)


class Store:
    """Packed base weights per linear module, and merged packed weights per adapter."""

    def __init__(self):
        self.base: dict[int, tuple] = {}                     # id(module) -> (module ref, packed)
        self.merged: OrderedDict = OrderedDict()             # adapter -> {id(module): (key, packed)}

    @staticmethod
    def works() -> bool:
        """A packed product of ROWS rows equals the plain one (up to rounding) on this CPU."""
        try:
            w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
            x = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(1))
            y = torch.ops.mkl._mkl_linear(x, pack(w), w * 0, None, ROWS)   # a fallback would give 0
            return bool(torch.allclose(y, F.linear(x, w), rtol=1e-4, atol=1e-4))
        except (RuntimeError, AttributeError):
            return False

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.numel() // x.shape[-1] <= ROWS

    def base_weight(self, linear) -> torch.Tensor:
        got = self.base.get(id(linear))
        if got is None or got[0]() is not linear:
            got = (weakref.ref(linear), pack(linear.weight))
            self.base[id(linear)] = got
        return got[1]

    def merged_weight(self, mod, name: str) -> torch.Tensor:
        """The packed `W + s B A` of LoRA layer `mod` under adapter `name`."""
        layers = self.merged.get(name)
        if layers is None:
            if len(self.merged) >= MAX_MERGED:
                self.merged.popitem(last=False)
            layers = self.merged[name] = {}
        self.merged.move_to_end(name)
        key = lora_key(mod, name)
        got = layers.get(id(mod))
        if got is None or got[0] != key:
            w = mod.base_layer.weight.detach()
            a, b = mod.lora_A[name].weight.detach(), mod.lora_B[name].weight.detach()
            got = (key, pack(torch.addmm(w, b, a, alpha=float(mod.scaling[name]))))
            layers[id(mod)] = got
        return got[1]

    @staticmethod
    def product(x: torch.Tensor, packed: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
        """x [..., K] times a packed weight [N, K] -> [..., N], x's rows padded to ROWS.
        `origin`: the unpacked weight of that shape (the base's for a merged one), which MKL
        reads only for a product of another number of rows: padding rules that out, and
        `works` checks it (it passes zeros there)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        m = flat.shape[0]
        if m < ROWS:
            flat = torch.cat([flat, flat.new_zeros(ROWS - m, flat.shape[1])])
        y = torch.ops.mkl._mkl_linear(flat.contiguous(), packed, origin, None, ROWS)
        return y[:m].reshape(*lead, origin.shape[0])
