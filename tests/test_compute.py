"""Compute accounting (minscope/compute.py): a training step's tokens and FLOPs, on cases
whose counts follow from the token streams."""

import pytest
import torch

from minscope.adapters import add_adapters, adapter_state
from minscope.compute import parameter_count
from minscope.envs.wordgame import Asker, WordGame
from minscope.methods import build_method, train_step
from minscope.models import build_tiny_model
from minscope.rollout import LMSpeaker
from minscope.simulators import Frozen
from minscope.trainer import UpdateConfig


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())     # a tied embedding once


@pytest.fixture
def policy(tokenizer):
    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"], init_lora_weights=False)
    return LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=3)


def test_parameter_count_is_the_base_plus_the_one_adapter_in_use(tokenizer):
    plain = numel(build_tiny_model(tokenizer, "qwen3", hidden_size=32))
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["first", "second"])
    lora = sum(t.numel() for t in adapter_state(model, "first").values())
    assert parameter_count(model) == plain and lora > 0
    assert parameter_count(model, "first") == parameter_count(model, "second") == plain + lora   # the other adapter: not counted


def test_a_cotraining_step_counts_its_streams_tokens_and_flops(policy, tokenizer):
    """WordGame: one simulator turn, then one policy turn. Each party's stream holds exactly what
    it was fed plus what it sampled, so the counts follow from the streams: prefilled = stream
    length - sampled - the ids copied from a shared prefix (sampling.share_prefixes); trained =
    sampled tokens x epochs; with the update's prefix sharing off, every pass feeds the whole
    stream (tests/test_prefix.py checks the shared counts)."""
    from minscope.sft import encode_chat, pad_batch

    sim_model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32, seed=1), ["simulator"],
                             init_lora_weights=False)
    pcfg = UpdateConfig(lr=1e-3, epochs=2, beta=0.04, prefix_sharing=False)
    scfg = UpdateConfig(lr=1e-3, epochs=3, prefix_sharing=False)
    m = build_method("cotrain", policy, [], pcfg, scfg, sim_model=sim_model, sim_tokenizer=tokenizer,
                     sim_reward="cooperative")
    conv = [{"role": "user", "content": "give"}, {"role": "assistant", "content": "no thanks"}]
    anchor = pad_batch([encode_chat(tokenizer, conv)] * 2, tokenizer.pad_token_id)
    m.anchor = lambda: anchor
    env = WordGame()
    metrics = train_step(m, env, env.tasks()[:2], 2, step=0)
    c, eps = metrics["compute"], metrics["_episodes"]
    streams = {k: [ep.info["streams"][k] for ep in eps] for k in ("agent", "partner")}
    sampled = {k: sum(sum(s.mask) for s in v) for k, v in streams.items()}
    length = {k: sum(len(s.ids) for s in v) for k, v in streams.items()}
    assert sampled["agent"] == sum(len(t.token_ids) for ep in eps for t in ep.turns if t.role == "agent") > 0
    assert (c["policy_decoded"], c["sim_decoded"]) == (sampled["agent"], sampled["partner"])
    copied = {k: sum(ep.info["tokens"][k]["shared"] for ep in eps) for k in ("agent", "partner")}
    assert (c["policy_prefilled"], c["sim_prefilled"]) == (length["agent"] - sampled["agent"] - copied["agent"],
                                                          length["partner"] - sampled["partner"] - copied["partner"])
    anchor_fed, anchor_trained = int(anchor[1].sum()), int(anchor[2][:, 1:].sum())
    assert c["policy_trained"] == 2 * sampled["agent"] and c["policy_backprop"] == 2 * length["agent"]
    assert c["sim_trained"] == 3 * sampled["partner"] + anchor_trained
    assert c["sim_backprop"] == 3 * length["partner"] + anchor_fed
    assert c["ref_forward"] == length["agent"]              # the policy's KL pass; the simulator has beta 0
    n_pol, n_sim = parameter_count(policy.model, "policy"), parameter_count(sim_model, "simulator")
    assert c["rollout_flops"] == (2 * n_pol * (length["agent"] - copied["agent"])
                                  + 2 * n_sim * (length["partner"] - copied["partner"]))
    assert c["update_flops"] == (6 * n_pol * 2 * length["agent"] + 2 * parameter_count(policy.model) * length["agent"]
                                 + 6 * n_sim * (3 * length["partner"] + anchor_fed))
    assert c["flops"] == c["rollout_flops"] + c["update_flops"]


def test_a_scripted_partner_costs_nothing(policy, tokenizer):
    m = build_method("oracle", policy, [], UpdateConfig(lr=1e-3), oracle=Asker())
    env = WordGame()
    c = train_step(m, env, env.tasks()[:2], 2, step=0)["compute"]
    assert c["sim_prefilled"] == c["sim_decoded"] == c["sim_trained"] == 0
    assert c["policy_decoded"] > 0 and c["flops"] > 0


def test_verbalized_samplings_retries_are_counted(policy, tokenizer):
    """An untrained simulator never writes parsable candidates: every turn is generated
    1 + retries times, and every attempt's tokens count, not only the reply that was kept."""
    base = Frozen(build_tiny_model(tokenizer, "llama", hidden_size=32, seed=2), tokenizer, max_new_tokens=3)
    m = build_method("vs", policy, [base], UpdateConfig(lr=1e-3), vs_k=2)
    attempts = []
    generate = m.partner.speaker.generate

    def spy(episodes, env):
        out = generate(episodes, env)
        attempts.append(sum(map(len, out[1])))
        return out
    m.partner.speaker.generate = spy
    env = WordGame()
    metrics = train_step(m, env, env.tasks()[:2], 2, step=0)
    assert metrics["vs_fallbacks"] == 4 and len(attempts) == 3       # 4 episodes, every attempt failed
    assert metrics["compute"]["sim_decoded"] == sum(attempts) > 0
