"""The lean forward of Llama models on the CPU (minscope/lean.py): the same samples and
log-probs, bit for bit, as the general transformers + peft forward. Here on tiny Llamas;
tests/test_smollm2.py checks it on the real SmolLM2. (With its packed products off:
tests/test_packed.py checks those against this path.)"""
import pytest
import torch

from minscope import lean, packed, sampling
from minscope.adapters import add_adapters, use_adapter
from minscope.kvcache import KVCache
from minscope.models import build_tiny_model
from minscope.precision import to_float64


@pytest.fixture(scope="module", params=["float32", "float64"])
def llama(tokenizer, request):
    model = build_tiny_model(tokenizer, "llama", hidden_size=32, num_layers=2)
    return to_float64(model) if request.param == "float64" else model     # the toy's: float64


def both_paths(model, prompts, monkeypatch, **kw):
    out = []
    monkeypatch.setattr(packed, "PACKED", False)     # the same operations as the general path
    for on in (False, True):
        monkeypatch.setattr(sampling, "LEAN", on)
        torch.manual_seed(0)
        cache = KVCache()
        owners = [object() for _ in prompts]
        first = sampling.sample(model, prompts, 0, {-1}, 5, cache=cache, owners=owners, **kw)
        # a second turn through the kept cache (suffix prefill, holes in the mask)
        longer = [p + g + [7, 8][:1 + i % 2] for i, (p, g) in enumerate(zip(prompts, first[0]))]
        out.append((first, sampling.sample(model, longer, 0, {-1}, 5, cache=cache, owners=owners, **kw)))
    return out


PROMPTS = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [5, 6]]


def test_lean_forward_is_bit_identical_plain_and_with_adapters(llama, monkeypatch):
    assert lean.lean_forward(llama) is not None
    general, fast = both_paths(llama, PROMPTS, monkeypatch)
    assert general == fast
    model = add_adapters(llama, ["one", "two"], init_lora_weights=False, target_modules="all-linear+head")
    assert lean.lean_forward(model) is not None
    with use_adapter(model, "two"):
        general, fast = both_paths(model, PROMPTS, monkeypatch)
    assert general == fast
    # a population's batch: one adapter per row, "__base__" = none
    general, fast = both_paths(model, PROMPTS, monkeypatch, adapter_names=["one", "two", "__base__", "one"])
    assert general == fast
    with model.disable_adapter():
        general, fast = both_paths(model, PROMPTS, monkeypatch)
    assert general == fast


def test_lean_forward_is_for_sdpa_llamas_without_dropout_or_hooks_only(tokenizer):
    assert lean.lean_forward(build_tiny_model(tokenizer, "qwen3", hidden_size=32)) is None
    assert lean.lean_forward(build_tiny_model(tokenizer, "llama", hidden_size=32, attention="eager")) is None
    dropout = add_adapters(build_tiny_model(tokenizer, "llama", hidden_size=32), ["drop"], dropout=0.1)
    assert lean.lean_forward(dropout) is None
    hooked = build_tiny_model(tokenizer, "llama", hidden_size=32)
    handle = hooked.get_output_embeddings().register_forward_hook(lambda m, i, o: o + 1.0)
    assert lean.lean_forward(hooked) is None            # a hook on any module: the general path
    handle.remove()
    assert lean.lean_forward(hooked) is not None


def test_the_toy_models_take_the_lean_path(tmp_path):
    from minscope import toy_models

    models = toy_models.ToyModels(tmp_path, progress=False, log=lambda *a: None)   # the shipped models
    policy = add_adapters(models.policy_base(), ["policy"], r=16, alpha=32, target_modules="all-linear+head")
    assert lean.lean_forward(policy) is not None
    assert lean.lean_forward(models.simulator("sim-a")[0]) is not None
