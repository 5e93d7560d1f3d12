"""The KV cache a party keeps across its turns: sampled log-probs must equal the trainer's
recomputation from the token ids alone, whatever the cache did (suffix prefill with holes,
rows leaving the decode batch, restarted histories, rows added and dropped, per-row adapters)."""
import random

import pytest
import torch

from minscope.adapters import add_adapters
from minscope.batch import training_batch
from minscope.envs.base import Environment, Step
from minscope.kvcache import KVCache, session
from minscope.models import build_tiny_model
from minscope.rollout import LMSpeaker, rollout
from minscope.sampling import sample
from minscope.trainer import sequence_logprobs

EOS = set(range(3, 300, 7))          # ~1 token in 7 ends a turn: rows finish at different steps


def recomputed(model, prompt, gen, temperature, adapter):
    """The trainer's log-probs of `gen` after `prompt` (one row, no cache)."""
    ids = torch.tensor([prompt + gen])
    logp = sequence_logprobs(model, ids, torch.ones_like(ids), temperature, adapter)
    return logp[0, len(prompt) - 1:]


def play(model, turns, temperature, cache_of, adapters=None, check_every=4, seed=0):
    """Simulated multi-turn sampling: each turn extends every prompt by its last reply and a
    ragged random suffix; conversation 3 sits turn 1 out (its row waits in the cache),
    conversation 2 ends after turn 1, conversation 5 joins at turn 2, and conversation 0's
    history is rewritten at turn 3 (a restarted stream).
    Yields (owners, prompts, generated ids, log-probs, cache) per turn."""
    rng = random.Random(seed)
    owners = [f"c{i}" for i in range(5)]
    history = {o: [rng.randrange(3, 290) for _ in range(rng.randint(2, 15))] for o in owners}
    for turn in range(turns):
        if turn == 2:
            owners = [o for o in owners if o != "c2"] + ["c5"]
            history["c5"] = [rng.randrange(3, 290) for _ in range(9)]
        if turn == 3:
            history["c0"] = history["c0"][:4] + [rng.randrange(3, 290) for _ in range(6)]
        speaking = [o for o in owners if not (turn == 1 and o == "c3")]   # c3 sits turn 1 out
        prompts = [history[o] for o in speaking]
        cache = cache_of()
        cache.discard(lambda o: o not in owners)
        names = [adapters[int(o[1:]) % len(adapters)] for o in speaking] if adapters else None
        ids, logps = sample(model, prompts, 0, EOS, 12, temperature, adapter_names=names,
                            cache=cache, owners=speaking, check_every=check_every)
        yield owners, prompts, ids, logps, cache, names
        for o, gen in zip(speaking, ids):
            history[o] = history[o] + gen + [rng.randrange(3, 290) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize("check_every", [1, 4])
def test_cached_turns_logprobs_equal_recomputation(tiny_model, check_every):
    torch.manual_seed(0)
    cache = KVCache()
    fed = []
    for owners, prompts, ids, logps, c, _ in play(tiny_model, 5, 1.0, lambda: cache, check_every=check_every):
        for p, gen, lp in zip(prompts, ids, logps):
            torch.testing.assert_close(torch.tensor(lp), recomputed(tiny_model, p, gen, 1.0, None),
                                       atol=1e-5, rtol=1e-5)
        fed.append(sum(c.last_prefilled))
        assert c.rows == len(owners)           # ended conversations left the cache
    lengths = [len(g) for g in ids]
    assert min(lengths) < 12 and len(set(lengths)) > 1   # rows really ended early, raggedly
    assert fed[1] < fed[0]                                # later turns feed only new suffixes


def test_mixed_adapters_keep_their_rows_through_the_cache(tiny_model):
    model = add_adapters(tiny_model, ["one", "two"], init_lora_weights=False)
    torch.manual_seed(1)
    cache = KVCache()
    for _, prompts, ids, logps, _, names in play(model, 4, 0.8, lambda: cache, adapters=["one", "two"]):
        for p, gen, lp, name in zip(prompts, ids, logps, names):
            torch.testing.assert_close(torch.tensor(lp), recomputed(model, p, gen, 0.8, name),
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_greedy_turns_with_the_cache_equal_full_prefill(tokenizer, attention):
    model = build_tiny_model(tokenizer, "qwen3", hidden_size=32, num_layers=2, attention=attention)
    cache = KVCache()
    kept = [(ids, c.last_prefilled) for _, _, ids, _, c, _ in play(model, 5, 0, lambda: cache)]
    fresh = [(ids, c.last_prefilled) for _, _, ids, _, c, _ in play(model, 5, 0, KVCache)]
    assert [k[0] for k in kept] == [f[0] for f in fresh]
    assert sum(sum(k[1]) for k in kept) < 0.5 * sum(sum(f[1]) for f in fresh)


def test_restarted_row_keeps_only_the_common_prefix():
    cache = KVCache()
    cache.add_rows(["a"], "cpu")
    cache.cached[0] = [1, 2, 3, 4, 5]
    cache.reserve(5, "cpu")
    cache.mask[0, :5] = True
    cache.advance(5)
    assert cache.prepare(["a"], [[1, 2, 9, 9]], "cpu") == [2]
    assert cache.cached[0] == [1, 2] and cache.mask[0, :5].tolist() == [True, True, False, False, False]
    assert cache.prepare(["a"], [[1, 2]], "cpu") == [1]    # the last prompt id is always fed


class Task:
    def __init__(self, turns):
        self.turns, self.system = turns, "you are the agent " + "x" * turns


class Talk(Environment):
    """Strict alternation; a task lasts `task.turns` turns; the 7-turn task's system prompt
    changes after turn 4, so its agent streams restart (and are not exact any more)."""

    def tasks(self, split="train"):
        return [Task(3), Task(6), Task(7)]

    def agent_messages(self, task):
        return [{"role": "system", "content": task.system}]

    def partner_messages(self, task):
        return [{"role": "system", "content": "you are the user"}]

    def after_turn(self, episode):
        if len(episode.turns) == 4 and episode.task.turns == 7:
            episode.task.system = "a different system prompt"
        if len(episode.turns) >= episode.task.turns:
            return Step(None)
        return Step("partner" if episode.turns[-1].role == "agent" else "agent")

    def score(self, episode):
        return 0.0, {}


def test_rollout_streams_train_on_the_logprobs_they_were_sampled_with(tiny_model, tokenizer):
    model = add_adapters(tiny_model, ["policy", "simulator"], init_lora_weights=False)
    agent = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=6)
    partner = LMSpeaker(model, tokenizer, "partner", adapter="simulator", max_new_tokens=6)
    env = Talk()
    torch.manual_seed(3)
    episodes = rollout(env, env.tasks(), agent, partner, group_size=2)
    restarted = [ep for ep in episodes if ep.task.turns == 7]
    assert not any(ep.info["streams"]["agent"].exact for ep in restarted)
    assert all(ep.info["streams"]["agent"].exact for ep in episodes if ep.task.turns != 7)
    for key, adapter in (("agent", "policy"), ("partner", "simulator")):
        exact = [ep for ep in episodes if ep.info["streams"][key].exact]
        batch = training_batch(exact, key, tokenizer.pad_token_id)
        logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, adapter)
        m = batch.loss_mask.bool()
        torch.testing.assert_close(batch.old_logp[m], logp[m], atol=1e-5, rtol=1e-5)
    for ep in restarted:   # after its restart, a stream's turns were sampled from the cropped cache
        s = ep.info["streams"]["agent"]
        ids = torch.tensor([s.ids])
        logp = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0, "policy")[0]
        m = torch.tensor(s.mask[1:]).bool()
        since = [t for t in ep.turns if t.role == "agent"][2:]      # the turns since the restart
        assert m.sum() == sum(len(t.token_ids) for t in since) > 0
        torch.testing.assert_close(torch.tensor(s.logp[1:])[m], logp[m], atol=1e-5, rtol=1e-5)
    for ep in episodes:
        n = {r: sum(t.role == r for t in ep.turns) for r in ("agent", "partner")}
        for role, count in ep.info["tokens"].items():
            stream = ep.info["streams"][role]
            assert count["generated"] == sum(len(t.token_ids) for t in ep.turns if t.role == role)
            if stream.exact:     # each id fed once (or copied from a shared prefix, sampling.share_prefixes);
                # each turn's last sampled id fed again next turn
                assert count["prefilled"] + count["shared"] + count["generated"] - n[role] + 1 == len(stream.ids)


def test_the_cache_lives_for_one_rollout_only(tiny_model, tokenizer):
    from minscope.kvcache import party_cache

    speaker = object()
    with session():
        assert party_cache(speaker) is party_cache(speaker)
    assert party_cache(speaker) is not party_cache(speaker)


def test_compacting_the_holes_keeps_every_row_intact(tiny_model):
    torch.manual_seed(4)
    cache = KVCache()
    widths = []

    def compacted():
        before = cache.width
        cache.compact()
        widths.append((before, cache.width))
        return cache
    for _, prompts, ids, logps, c, _ in play(tiny_model, 4, 1.0, compacted):
        assert all(int(c.mask[r, :c.width].sum()) == len(c.cached[r]) for r in range(c.rows))
        for p, gen, lp in zip(prompts, ids, logps):
            torch.testing.assert_close(torch.tensor(lp), recomputed(tiny_model, p, gen, 1.0, None),
                                       atol=1e-5, rtol=1e-5)
    assert any(after < before for before, after in widths)       # holes were really removed


def test_finished_rows_leave_the_decode_batch(tiny_model):
    sizes = []
    hook = tiny_model.get_input_embeddings().register_forward_pre_hook(
        lambda m, args: sizes.append(tuple(args[0].shape)))
    try:
        torch.manual_seed(5)
        ids, _ = sample(tiny_model, [[5, 6, 7]] * 8, 0, EOS, 20, 1.0, check_every=2)
    finally:
        hook.remove()
    decode_rows = [b for b, s in sizes if s == 1]
    lengths = sorted(len(g) for g in ids)
    assert lengths[0] < lengths[-1]                              # rows ended at different steps
    assert decode_rows[0] == 8 and min(decode_rows) < 8          # ended rows stopped being computed
    assert len(sizes) <= lengths[-1] + 1                         # and the loop ended with the last
