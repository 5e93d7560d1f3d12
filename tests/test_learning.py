"""The honest end-to-end check: GRPO through the real stack makes a tiny policy better.

A tiny Llama-architecture policy is SFT'd to answer with a random word of the game, then
trained with GRPO against the scripted partner that asks for "river". The probability it
gives the right answer (computed exactly from the model, not sampled) must rise well above
where it started. Fixed seeds; the margin is far beyond what noise moves in 40 steps.
"""
import torch

from minscope.envs.wordgame import Asker, WordGame
from minscope.methods import build_method, train_step
from minscope.models import add_adapters, build_tiny_model, build_tokenizer
from minscope.rollout import LMSpeaker
from minscope.sft import encode_chat, sft
from minscope.trainer import UpdateConfig, sequence_logprobs


def answer_probability(model, tokenizer, word="river"):
    msgs = [{"role": "system", "content": "answer with one word"}, {"role": "user", "content": f"say {word}"},
            {"role": "assistant", "content": word}]
    ids, mask = encode_chat(tokenizer, msgs)
    ids = torch.tensor([ids])
    with torch.no_grad():
        logp = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0, "policy")
    return (logp * torch.tensor([mask[1:]], dtype=torch.float)).sum().exp().item()


def test_grpo_policy_learns_to_say_the_requested_word():
    torch.manual_seed(0)
    env = WordGame()
    tok = build_tokenizer(env.corpus(), vocab_size=300)
    model = build_tiny_model(tok, "llama", hidden_size=64)
    sft(model, tok, env.sft_conversations(), steps=300, batch_size=16, lr=3e-3, progress=False)
    model = add_adapters(model, ["policy"])
    policy = LMSpeaker(model, tok, "agent", adapter="policy", max_new_tokens=4)
    method = build_method("oracle", policy, [], UpdateConfig(lr=3e-3), oracle=Asker())
    before = answer_probability(model, tok)
    rewards = [train_step(method, env, ["river"] * 4, 8, step)["train_reward"] for step in range(40)]
    after = answer_probability(model, tok)
    assert 0.1 < before < 0.4                 # SFT: one word of four, at random
    assert after > before + 0.12, (before, after)
    assert sum(rewards[-10:]) / 10 > sum(rewards[:5]) / 5 + 0.05
