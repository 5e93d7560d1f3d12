"""Models: tiny models with chat templates, many LoRA adapters on one base, snapshots."""
import pytest
import torch

from minscope import adapters, models, prefix
from minscope.adapters import (adapter_state, add_adapters, load_adapter, load_adapter_state, save_adapter,
                               trainable_parameters, use_adapter)
from minscope.models import build_tiny_model, fix_cpu_4bit


def logits(model, ids, adapter="__keep__"):
    if adapter == "__keep__":
        return model(input_ids=ids).logits
    with use_adapter(model, adapter):
        return model(input_ids=ids).logits


def test_tokenizer_has_chat_template_and_roundtrips_text(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "say river"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nsay river<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"


def test_chat_template_lists_tools(tokenizer):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool], tokenize=False)
    assert '"name": "lookup"' in text and "<tool_call>" in text


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_model_of_real_architecture(tokenizer, arch):
    model = build_tiny_model(tokenizer, arch, hidden_size=32)
    assert model.config.model_type == arch
    out = model(input_ids=torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, len(tokenizer))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sdpa_and_eager_attention_agree_on_padded_batches(tokenizer, arch):
    """The tiny models use sdpa (faster); on left- and right-padded rows it must match eager."""
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9], [3, 4, 5, 0, 0, 0]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    out = {a: prefix.final_hidden_states(build_tiny_model(tokenizer, arch, hidden_size=32, seed=3, attention=a),
                                         ids, attn) for a in ("eager", "sdpa")}
    real = attn.bool()
    assert torch.isfinite(out["sdpa"][real]).all()
    torch.testing.assert_close(out["sdpa"][real], out["eager"][real], rtol=1e-5, atol=1e-5)


def test_unknown_architecture_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="llama"):
        build_tiny_model(tokenizer, "gpt9")


def test_new_adapters_equal_base_until_trained(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    base = logits(tiny_model, ids)
    model = add_adapters(tiny_model, ["policy", "simulator"])
    assert torch.allclose(logits(model, ids, "policy"), base)
    assert torch.allclose(logits(model, ids, None), base)


def test_training_one_adapter_leaves_others_bit_identical(tiny_model):
    model = add_adapters(tiny_model, ["policy", "simulator"], init_lora_weights=False)
    before_sim = adapter_state(model, "simulator")
    before_base = {k: v.clone() for k, v in model.named_parameters() if "lora_" not in k}
    params = trainable_parameters(model, "policy")
    opt = torch.optim.SGD(params, lr=0.1)
    with use_adapter(model, "policy"):
        model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    opt.step()
    after_sim = adapter_state(model, "simulator")
    assert all(torch.equal(before_sim[k], after_sim[k]) for k in before_sim)
    assert all(torch.equal(v, dict(model.named_parameters())[k]) for k, v in before_base.items())
    assert not all(torch.equal(a, b) for a, b in zip(params, adapter_state(model, "simulator").values()))


def test_distinct_adapters_give_distinct_outputs_and_reference_is_base(tiny_model):
    ids = torch.tensor([[5, 6, 7, 8]])
    base = logits(tiny_model, ids)
    model = add_adapters(tiny_model, ["one", "two"], init_lora_weights=False)
    assert not torch.allclose(logits(model, ids, "one"), logits(model, ids, "two"))
    assert torch.allclose(logits(model, ids, None), base)


def test_snapshot_and_restore_is_exact(tiny_model):
    model = add_adapters(tiny_model, ["simulator", "pool0"], init_lora_weights=False)
    ids = torch.tensor([[9, 10, 11]])
    snap = adapter_state(model, "simulator")
    load_adapter_state(model, "pool0", snap)
    assert torch.equal(logits(model, ids, "pool0"), logits(model, ids, "simulator"))
    with torch.no_grad():
        for p in adapters.lora_parameters(model, "simulator").values():
            p.add_(1.0)
    load_adapter_state(model, "simulator", snap)
    assert torch.equal(logits(model, ids, "pool0"), logits(model, ids, "simulator"))


def test_adapter_saves_in_peft_format_and_loads_exactly(tiny_model, tmp_path):
    model = add_adapters(tiny_model, ["policy"], init_lora_weights=False)
    save_adapter(model, "policy", tmp_path)
    files = {p.name for p in tmp_path.rglob("*")}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    ids = torch.tensor([[3, 4, 5]])
    want = logits(model, ids, "policy")
    with torch.no_grad():
        for p in adapters.lora_parameters(model, "policy").values():
            p.zero_()
    load_adapter(model, "policy", tmp_path)
    assert torch.allclose(logits(model, ids, "policy"), want)


def test_hidden_states_path_matches_model_logits(tiny_model):
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    h = prefix.final_hidden_states(tiny_model, ids, attn)
    direct = tiny_model(input_ids=ids[1:], attention_mask=attn[1:]).logits
    assert torch.allclose(h[1:] @ adapters.output_embedding(tiny_model).T, direct, atol=1e-5)


def test_offline_hub_name_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="local directory"):
        models.load_model("some-org/not-a-real-model-xyz")


def test_cpu_4bit_training_still_gets_gradients_after_generation(tokenizer):
    bnb = pytest.importorskip("bitsandbytes")
    model = build_tiny_model(tokenizer, "qwen3", hidden_size=64)
    # Quantize every linear layer of the body to NF4, as from_pretrained(load_in_4bit) would.
    for name, mod in list(model.model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                      compute_dtype=torch.float32, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4")
                q = q.to("cpu")
                setattr(mod, child_name, q)
    assert fix_cpu_4bit(model) > 0
    model = add_adapters(model, ["policy"], init_lora_weights=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    params = trainable_parameters(model, "policy")

    def grads():
        model.train()
        for p in params:
            p.grad = None
        with use_adapter(model, "policy"):
            model(input_ids=ids).logits.sum().backward()
        return [p.grad.clone() for p in params]

    reference = grads()
    with torch.no_grad():
        model.eval()
        model(input_ids=ids)                      # an inference forward, like generate()
    # the gradients after generation must be the same as before it
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(reference, grads()))


def test_a_broken_local_model_directory_is_a_clear_error_with_its_cause(tmp_path):
    from minscope.models import load_model

    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(SystemExit) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    assert str(tmp_path) in message and "local model directory" in message and "hub name" not in message
