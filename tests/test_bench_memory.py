"""bench/memory.py on CPU: the --smoke path, the synthetic episodes and the naive log-probs switch."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from minscope import trainer
from minscope.adapters import add_adapters
from minscope.logprobs import token_logprobs
from minscope.models import build_tiny_model

PATH = Path(__file__).resolve().parents[1] / "bench" / "memory.py"
spec = importlib.util.spec_from_file_location("bench_memory", PATH)
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)


def lora_bytes(shape: dict, r: int) -> int:
    """fp32 LoRA (A: r x in, B: out x r) on q, k, v, o, gate, up, down of every layer."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + inter)
    return 4 * r * per_layer * shape["num_hidden_layers"]


def test_smoke_run_measures_every_default_configuration(tmp_path, capsys):
    out = tmp_path / "memory.json"
    memory.main(["--smoke", "--group-size", "4", "--tasks", "2", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == memory.DEFAULT_CONFIGS
    plain = results.pop()                    # the contrast: one plain HF QLoRA step
    assert plain["config"] == "hf-qlora" and plain["episodes"] == 4 and plain["max_tokens"] == 128
    assert plain["step_time_s"] > 0 and plain["peak_bytes"] is None and plain["loss"] > 0
    for r in results:
        features = memory.CONFIGS[r["config"]]
        assert all(r[k] == v for k, v in features.items())
        assert r["micro_batch"] == (4 if features["micro_batching"] else 8)
        assert r["logprobs_function"] == ("token_logprobs" if features["chunked"] else "naive_token_logprobs")
        assert r["checkpointed_layers"] == (2 if features["checkpointing"] else 0)
        assert r["step_time_s"] > 0 and r["peak_bytes"] is None       # no CUDA: no memory figures
        assert r["agent_tokens"] > 0 and r["partner_tokens"] > 0
        assert r["pool_size"] == 5
        assert r["adapter_bytes"] == lora_bytes(memory.SHAPES["tiny"], r=8)
        assert r["pool_bytes"] == r["pool_slot_bytes"] == 5 * r["adapter_bytes"]
    printed = capsys.readouterr().out
    assert "| tiny | no-micro-batching | nf4 | chunked | on | 8 |" in printed
    assert "| tiny | hf-qlora | nf4 | HF loss | on | 4 |" in printed
    assert "GPU memory figures need CUDA" in printed


def test_qwen3_shapes_are_refused_on_cpu():
    with pytest.raises(SystemExit):
        memory.parse_args(["--device", "cpu", "--shapes", "1.7b"])


def test_synthetic_streams_hold_each_party_own_turns_as_sampled_tokens():
    episodes = memory.synthetic_episodes(n_tasks=2, group_size=3, max_tokens=256, vocab_size=1000, seed=1)
    assert [ep.group for ep in episodes] == [0, 0, 0, 1, 1, 1]
    for ep in episodes:
        assert len(ep.turns) >= 4
        for role in ("agent", "partner"):
            s = ep.info["streams"][role]
            assert len(s.ids) == len(s.mask) == len(s.logp) <= 256
            sampled = [i for i, m in zip(s.ids, s.mask) if m]
            assert sampled == [i for t in ep.turns if t.role == role for i in t.token_ids]
        # complementary: every sampled token is trained in exactly one stream
        trained = sum(sum(ep.info["streams"][r].mask) for r in ("agent", "partner"))
        assert trained == sum(len(t.token_ids) for t in ep.turns)


def test_old_logprobs_come_from_the_adapter_that_sampled_the_stream(tokenizer):
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, hidden_size=32)
    model = add_adapters(model, ["policy", "simulator"], init_lora_weights=False)   # two distinct adapters
    vocab = len(tokenizer)
    episodes = memory.synthetic_episodes(1, 2, 64, vocab, seed=0)
    names = {id(episodes[0]): "policy", id(episodes[1]): "simulator"}
    memory.fill_old_logprobs(model, episodes, "partner", lambda ep: names[id(ep)],
                             pad_id=memory.ChatIds(vocab).pad, micro_batch=1)
    for ep in episodes:
        s = ep.info["streams"]["partner"]
        ids = torch.tensor([s.ids])
        with torch.no_grad(), trainer.use_adapter(model, names[id(ep)]):
            full = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)   # [T-1, V]
        expected = full.gather(1, ids[0, 1:, None]).squeeze(1) * torch.tensor(s.mask[1:])
        assert s.logp[0] == 0.0
        torch.testing.assert_close(torch.tensor(s.logp[1:]), expected, atol=1e-4, rtol=1e-4)


def test_naive_logprobs_agree_with_chunked_logprobs_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(50, 16)
    targets = torch.randint(0, 50, (2, 5))
    naive, naive_ent = memory.naive_token_logprobs(hidden, weight, targets, 0.7, return_entropy=True)
    (g_naive,) = torch.autograd.grad(naive.sum(), hidden)
    chunked, chunked_ent = token_logprobs(hidden, weight, targets, 0.7, return_entropy=True, backend="torch")
    (g_chunked,) = torch.autograd.grad(chunked.sum(), hidden)
    torch.testing.assert_close(naive, chunked)
    torch.testing.assert_close(naive_ent, chunked_ent)
    torch.testing.assert_close(g_naive, g_chunked)


def test_naive_logprobs_replace_the_trainer_function_only_inside_the_block():
    original = trainer.token_logprobs
    with memory.naive_logprobs():
        assert trainer.token_logprobs is memory.naive_token_logprobs
    assert trainer.token_logprobs is original
    with memory.naive_logprobs(enabled=False):
        assert trainer.token_logprobs is original
