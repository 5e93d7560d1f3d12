"""The packed decode products (minscope/packed.py) against the lean path without them: the
same tokens, log-probs within float32 rounding, rows that do not see each other, merged
adapters that follow their weights, and float64 models (the toy's) never packed."""
import pytest
import torch

from minscope import lean, packed, sampling
from minscope.adapters import add_adapters, trainable_parameters, use_adapter
from minscope.kvcache import KVCache
from minscope.models import build_tiny_model
from minscope.precision import to_float64

pytestmark = pytest.mark.skipif(not packed.available(), reason="this torch has no MKL packed sgemm "
                                "(the packed path is then off: nothing to compare)")

PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [5, 6]]


@pytest.fixture(scope="module")
def model(tokenizer):
    base = build_tiny_model(tokenizer, "llama", hidden_size=32, num_layers=2)
    return add_adapters(base, ["one", "two"], init_lora_weights=False, target_modules="all-linear+head")


def two_turns(model, monkeypatch, on: bool, **kw):
    monkeypatch.setattr(packed, "PACKED", on)
    calls = []
    real = packed.Store.product
    monkeypatch.setattr(packed.Store, "product", staticmethod(lambda *a: calls.append(1) or real(*a)))
    torch.manual_seed(0)
    cache, owners = KVCache(), [object() for _ in PROMPTS]
    first = sampling.sample(model, PROMPTS, 0, {-1}, 6, cache=cache, owners=owners, **kw)
    longer = [p + g + [7] for p, g in zip(PROMPTS, first[0])]
    second = sampling.sample(model, longer, 0, {-1}, 6, cache=cache, owners=owners, **kw)
    monkeypatch.setattr(packed.Store, "product", real)
    assert bool(calls) == on          # the decode steps took the packed products, or none did
    return first, second


def assert_close_episodes(a, b, tol=1e-4):
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b):
        assert ids_a == ids_b
        diff = max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for x, y in zip(ra, rb))
        assert diff <= tol, diff


@pytest.mark.parametrize("setup", ["one adapter", "base", "per-row"])
def test_packed_products_sample_the_same_tokens_with_logprobs_within_rounding(model, monkeypatch, setup):
    assert lean.lean_forward(model).store is not None          # float32 on an MKL CPU: packed
    kw = {"adapter_names": ["one", "two", "__base__", "one"]} if setup == "per-row" else {}
    ctx = model.disable_adapter() if setup == "base" else use_adapter(model, "two")
    with ctx:
        plain, fast = two_turns(model, monkeypatch, False, **kw), two_turns(model, monkeypatch, True, **kw)
    assert_close_episodes(plain, fast)


def test_a_padded_row_reads_what_it_would_in_a_full_batch():
    w = torch.randn(40, 24)
    x = torch.randn(packed.ROWS, 24)
    p = packed.pack(w)
    full = packed.Store.product(x, p, w)
    for m in (1, 3, packed.ROWS - 1):
        assert torch.equal(packed.Store.product(x[:m], p, w), full[:m])
    assert torch.allclose(full, torch.nn.functional.linear(x, w), atol=1e-5)


def test_a_merged_adapter_follows_its_weights(model, monkeypatch):
    """After an optimiser step the packed path samples from the new weights (the merged
    copy is re-made), as the unpacked path does."""
    with use_adapter(model, "one"):
        two_turns(model, monkeypatch, True)                       # packs "one" as it is now
        params = trainable_parameters(model, "one")
        saved = [p.detach().clone() for p in params]
        opt = torch.optim.AdamW(params, lr=0.05)         # the trainer's optimiser, one step
        g = torch.Generator().manual_seed(3)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        try:
            assert_close_episodes(two_turns(model, monkeypatch, False), two_turns(model, monkeypatch, True))
        finally:
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)


def test_float64_models_are_never_packed(tokenizer):
    toy_like = to_float64(build_tiny_model(tokenizer, "llama", hidden_size=32, num_layers=2))
    assert lean.lean_forward(toy_like).store is None
