"""Shared-prefix update (minscope/prefix.py): the same loss, statistics and gradients as
feeding every row whole; and the zero-signal skip of the update."""
import copy

import pytest
import torch

from minscope import prefix
from minscope.adapters import add_adapters
from minscope.envs.base import Episode
from minscope.models import build_tiny_model, enable_checkpointing
from minscope.stream import Stream
from minscope.trainer import UpdateConfig, grpo_update, make_optimizer


class Recording(torch.optim.AdamW):
    """AdamW that keeps a copy of the gradients it was asked to apply."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def grouped_episodes(vocab: int, groups=3, group_size=4, seed=0):
    """Groups whose rows share a prompt (ragged between groups), then sampled and partner ids;
    the last group's rows share only a few ids (no unit), one row is much shorter."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=gen).tolist()   # noqa: E731
    episodes = []
    for g in range(groups):
        prompt = rand(70 + 7 * g)
        for i in range(group_size):
            head = prompt if g < groups - 1 else prompt[:5] + rand(20)
            ids, mask = list(head), [0] * len(head)
            for turn in range(2 if (g, i) != (1, 2) else 1):
                n = 3 + (i + turn) % 4
                ids += rand(n)
                mask += [1] * n
                other = rand(2 + i)
                ids += other
                mask += [0] * len(other)
            logp = [-(1 + 0.05 * j) if m else 0.0 for j, m in enumerate(mask)]
            episodes.append(Episode(task=g, group=g, info={"streams": {"agent": Stream(ids, mask, logp)}}))
    return episodes


def run_update(base, episodes, adv, sharing: bool, checkpointing=False, micro_batch=3, beta=0.005,
               aggregation="token", checkpoint_above=None, layer_calls=None):
    model = copy.deepcopy(base)
    if checkpointing:
        assert enable_checkpointing(model) > 0
    if layer_calls is not None:     # count the first layer's attention forwards (recomputations included)
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: layer_calls.append(1))
    torch.manual_seed(1)
    model = add_adapters(model, ["policy"], init_lora_weights=False)
    cfg = UpdateConfig(lr=1e-3, beta=beta, micro_batch=micro_batch, prefix_sharing=sharing, aggregation=aggregation,
                       checkpoint_above=checkpoint_above)
    opt = Recording(make_optimizer(model, "policy", cfg).param_groups)
    stats = grpo_update(model, "policy", opt, episodes, "agent", adv, cfg, 0)
    return stats, opt.grads


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_update_equals_the_plain_one(tiny_model, tokenizer, checkpointing):
    episodes = grouped_episodes(len(tokenizer))
    adv = torch.linspace(-1.5, 1.5, len(episodes))
    plain, g0 = run_update(tiny_model, episodes, adv, sharing=False, checkpointing=checkpointing)
    shared, g1 = run_update(tiny_model, episodes, adv, sharing=True, checkpointing=checkpointing)
    assert shared["tokens_forward"] < 0.8 * plain["tokens_forward"]      # the prefixes went once per unit
    assert plain["tokens_forward"] == plain["tokens_forward_plain"] == shared["tokens_forward_plain"]
    for k in ("loss", "kl", "entropy", "clip_frac", "grad_norm"):
        assert shared[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-7), k
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()


def test_units_small_enough_keep_their_activations_with_the_same_gradients(tiny_model, tokenizer):
    """checkpoint_above: a unit under the limit skips the recomputation (the first layer runs
    once per unit, not twice) and its gradients and statistics are the same, bit for bit."""
    episodes = grouped_episodes(len(tokenizer))
    adv = torch.linspace(-1.5, 1.5, len(episodes))
    runs = {}
    for above in (None, 0, 10**12):          # every unit checkpointed, every unit over 0 bytes, none
        calls = []
        stats, grads = run_update(tiny_model, episodes, adv, sharing=True, checkpointing=True,
                                  checkpoint_above=above, layer_calls=calls)
        runs[above] = (stats, grads, len(calls))
    (s0, g0, c0), (s1, g1, c1), (s2, g2, c2) = runs[None], runs[0], runs[10**12]
    assert c0 == c1 and c2 < c0       # kept activations: fewer forwards of the layer
    for s, g in ((s1, g1), (s2, g2)):
        assert all(s[k] == s0[k] for k in ("loss", "kl", "entropy", "clip_frac", "grad_norm"))
        assert all(torch.equal(a, b) for a, b in zip(g, g0))


def test_the_lm_head_at_trained_positions_only_gives_the_full_loss_and_gradient():
    """The update feeds the LM head only the positions that carry loss (minscope/trainer.py):
    the same loss, log-probs there and gradient w.r.t. every hidden state as the head over all
    positions with weight 0 elsewhere."""
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    g = torch.Generator().manual_seed(0)
    b, S, H, V = 3, 11, 16, 50
    hidden = torch.randn(b, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (b, S), generator=g)
    mask = torch.rand(b, S, generator=g) < 0.4
    old = -torch.rand(b, S, generator=g, dtype=torch.float64) * 4
    ref = old + 0.1 * torch.randn(b, S, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, S)
    weights = mask.double() / mask.sum()
    full, lp_full, _ = fused_grpo_token_loss(hidden, head, targets, old, ref, adv, weights, beta=0.1, backend="torch")
    (d_full,) = torch.autograd.grad(full, hidden)
    sel, lp_sel, _ = fused_grpo_token_loss(hidden[mask], head, targets[mask], old[mask], ref[mask], adv[mask],
                                           weights[mask], beta=0.1, backend="torch")
    (d_sel,) = torch.autograd.grad(sel, hidden)
    assert torch.allclose(sel, full, rtol=1e-12) and torch.allclose(lp_sel, lp_full[mask], rtol=1e-12)
    assert torch.allclose(d_sel, d_full, rtol=1e-10, atol=1e-14) and (d_sel[~mask] == 0).all()
    with torch.no_grad():
        assert torch.allclose(token_logprobs(hidden[mask], head, targets[mask]),
                              token_logprobs(hidden, head, targets)[mask], rtol=1e-12)


@pytest.mark.parametrize("micro_batch,aggregation", [(1, "token"), (2, "sequence"), (64, "fixed")])
def test_shared_prefix_update_equals_the_plain_one_for_any_micro_batch(tokenizer, micro_batch, aggregation):
    torch.manual_seed(0)
    base = build_tiny_model(tokenizer, "qwen3", hidden_size=32, num_layers=2)
    episodes = grouped_episodes(len(tokenizer), seed=micro_batch)
    adv = torch.linspace(1.0, -1.0, len(episodes))
    plain, g0 = run_update(base, episodes, adv, False, micro_batch=micro_batch, aggregation=aggregation)
    shared, g1 = run_update(base, episodes, adv, True, micro_batch=micro_batch, aggregation=aggregation)
    if micro_batch == 1:        # nothing to share within a unit of one row: the plain path exactly
        assert shared["tokens_forward"] == plain["tokens_forward"] and shared["loss"] == plain["loss"]
    else:
        assert shared["tokens_forward"] < plain["tokens_forward"]
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_plan_shares_only_untrained_common_prefixes():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7], [8, 8, 8, 8, 8, 0, 0]])
    attn = (torch.arange(7)[None] < torch.tensor([6, 7, 7, 5])[:, None]).long()
    loss = torch.zeros(4, 6)
    loss[0, 4:] = 1          # row 0 trains ids 5.. : its prefix may be at most 4 ids
    loss[2, 2:] = 1          # row 2 trains from id 3: at most 2
    units = prefix.plan(ids, attn, loss, micro_batch=8, min_prefix=2)
    assert units == [([0, 1, 2], 2, 7), ([3], 0, 7)]
    assert prefix.plan(ids, attn, loss, micro_batch=2, min_prefix=2) == [([0, 1], 4, 7), ([2, 3], 0, 7)]
    assert prefix.fed_tokens(attn, [([0, 1, 2], 2, 7), ([3], 0, 5)]) == 2 + 4 + 5 + 5 + 5


def test_a_step_without_reward_signal_skips_the_update(tokenizer):
    """UpdateConfig.skip_zero_signal: every advantage 0 -> no forward, no backward, no step."""
    torch.manual_seed(0)
    base = build_tiny_model(tokenizer, "llama", hidden_size=32, num_layers=2)
    episodes = grouped_episodes(len(tokenizer))
    model = add_adapters(base, ["policy"], init_lora_weights=False)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}
    calls = []
    handle = model.get_base_model().model.register_forward_hook(lambda *a: calls.append(1))
    cfg = UpdateConfig(lr=1e-2, beta=0.005, skip_zero_signal=True)
    stats = grpo_update(model, "policy", make_optimizer(model, "policy", cfg), episodes, "agent",
                        torch.zeros(len(episodes)), cfg, 0)
    assert stats["skipped_update"] and "advantage" in stats["skip_reason"] and not calls
    assert stats["tokens_fed"] == 0 and stats["entropy"] is None
    assert all(torch.equal(before[k], v) for k, v in model.named_parameters() if "lora_" in k)
    # the paper's update (the default) still applies the KL step and AdamW's weight decay
    cfg = UpdateConfig(lr=1e-2, beta=0.005)
    stats = grpo_update(model, "policy", make_optimizer(model, "policy", cfg), episodes, "agent",
                        torch.zeros(len(episodes)), cfg, 0)
    handle.remove()
    assert not stats["skipped_update"] and calls
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters() if "lora_" in k)


# ----------------------------------------------------------------------------- the rollout
from minscope.envs.base import Environment  # noqa: E402
from minscope.rollout import LMSpeaker, rollout  # noqa: E402
from minscope.sampling import sample  # noqa: E402


def test_sampling_with_shared_prefixes_draws_the_same_tokens(tiny_model, tokenizer):
    """Rows that start alike are prefilled once (per adapter); the tokens and log-probs drawn
    under the same seed are those of a full prefill of every row."""
    model = add_adapters(tiny_model, ["one", "two"], init_lora_weights=False)
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()   # noqa: E731
    a, b = rand(80), rand(70)
    prompts = [a + rand(3), a + rand(5), a + rand(1), b + rand(4), b + rand(2), rand(75), a[:68] + rand(3)]
    names = ["one", "one", "two", "one", "one", "two", "one"]
    out, fed = [], []
    for share in (False, True):
        torch.manual_seed(7)
        from minscope.kvcache import KVCache
        cache = KVCache()
        out.append(sample(model, prompts, tokenizer.pad_token_id, {tokenizer.eos_token_id}, 8, 1.0,
                          adapter_names=names, cache=cache, share_prefix=share))
        fed.append(cache.last_prefilled)
    (ids0, lp0), (ids1, lp1) = out
    assert ids0 == ids1
    assert all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-5) for x, y in zip(lp0, lp1))
    assert fed[0] == [len(p) for p in prompts]
    # rows 0, 1 and 6 share 68 ids (row 0 feeds them); 3 and 4 share b; 2 (another adapter) and 5 are alone
    assert fed[1][1] == 85 - 68 and fed[1][6] == 3 and fed[1][4] == 2
    assert fed[1][0] == fed[0][0] and fed[1][3] == fed[0][3] and fed[1][2] == fed[0][2] and fed[1][5] == fed[0][5]


def test_two_groups_sharing_an_opening_are_prefilled_as_two_clusters(tokenizer):
    """P4G's persuadee prompts: every group's starts with the same ~100 ids, then its own
    persona. Each group's rows share their whole persona prompt (one cluster per group),
    not just the opening all groups have; the tokens are still those of full prefills."""
    from minscope.kvcache import KVCache

    model = build_tiny_model(tokenizer, "llama", hidden_size=32, num_layers=2)
    gen = torch.Generator().manual_seed(5)
    rand = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()   # noqa: E731
    opening, a, b = rand(66), rand(40), rand(40)
    prompts = [opening + a + rand(3), opening + a + rand(4), opening + b + rand(2), opening + b + rand(5)]
    out, fed = [], []
    for share in (False, True):
        torch.manual_seed(7)
        cache = KVCache()
        out.append(sample(model, prompts, tokenizer.pad_token_id, {tokenizer.eos_token_id}, 6, 1.0,
                          cache=cache, share_prefix=share))
        fed.append(cache.last_prefilled)
    assert out[0][0] == out[1][0]
    assert fed[1] == [109, 4, 108, 5]         # leaders feed their whole prompt, the others their own ids


def test_a_shared_prefix_that_fills_the_whole_cache_is_copied_to_every_row(tiny_model, tokenizer):
    """Regression: 64 shared ids on an empty cache reserve exactly 64 columns, so the copy reads
    the leader's whole buffer row; the rows still get the same tokens as full prefills."""
    from minscope.kvcache import KVCache
    gen = torch.Generator().manual_seed(5)
    head = torch.randint(3, len(tokenizer), (64,), generator=gen).tolist()
    prompts = [head + [t] for t in (5, 6, 7, 8)]           # 65 ids: the last one starts the turn
    out = []
    for share in (False, True):
        torch.manual_seed(1)
        cache = KVCache()
        out.append(sample(tiny_model, prompts, tokenizer.pad_token_id, {tokenizer.eos_token_id}, 4, 1.0,
                          cache=cache, share_prefix=share))
        if share:
            assert cache.last_prefilled == [65, 1, 1, 1]         # the leader feeds the 64 shared ids
    assert out[0][0] == out[1][0]


class Persuade(Environment):
    """Both parties have long system prompts; three turns each; a group's episodes share them."""
    max_turns = 6

    def tasks(self, split="train"):
        return ["alpha", "beta"]

    def agent_messages(self, task):
        return [{"role": "system", "content": "you are the agent, be kind and persuasive " * 10}]

    def partner_messages(self, task):
        return [{"role": "system", "content": f"you are the user called {task}; " + "answer briefly and honestly " * 12}]

    def score(self, episode):
        return float(len(episode.turns[0].text) % 2), {}


@pytest.mark.parametrize("population", [False, True])
def test_rollouts_with_shared_prefixes_are_the_same_episodes(tiny_model, tokenizer, population):
    model = add_adapters(tiny_model, ["policy", "sim1", "sim2"], init_lora_weights=False)
    partner_adapter = (lambda ep: "sim1" if ep.group % 2 else "sim2") if population else None
    runs = []
    for share in (False, True):
        agent = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=6)
        partner = LMSpeaker(model, tokenizer, "partner", adapter=partner_adapter, max_new_tokens=6)
        agent.share_prefix = partner.share_prefix = share
        runs.append(rollout(Persuade(), ["alpha", "beta"], agent, partner, group_size=3, seed=11))
    off, on = runs
    for e0, e1 in zip(off, on):
        assert [t.text for t in e0.turns] == [t.text for t in e1.turns]
        for key in ("agent", "partner"):
            s0, s1 = e0.info["streams"][key], e1.info["streams"][key]
            assert s0.ids == s1.ids and s0.mask == s1.mask
            assert torch.allclose(torch.tensor(s0.logp), torch.tensor(s1.logp), atol=1e-5)
    prefilled = [sum(ep.info["tokens"][k]["prefilled"] for ep in run for k in ("agent", "partner")) for run in runs]
    assert prefilled[1] < 0.75 * prefilled[0]


def test_train_step_logs_a_skipped_update_and_its_reason(tokenizer):
    """A step whose groups all have equal rewards: with skip_zero_signal the policy's and the
    co-trained simulator's updates are skipped and the metrics say so; without it they run."""
    from minscope.adapters import adapter_state
    from minscope.envs.wordgame import WordGame
    from minscope.methods import build_method, train_step
    from minscope.simulators import Frozen

    class Flat(WordGame):
        def score(self, episode):
            return 1.0, {}

    torch.manual_seed(0)
    policy_model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"],
                                init_lora_weights=False)
    sim_model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32, seed=1), ["simulator"],
                             init_lora_weights=False)
    policy = LMSpeaker(policy_model, tokenizer, "agent", adapter="policy", max_new_tokens=3)
    frozen = [Frozen(build_tiny_model(tokenizer, "llama", hidden_size=32, seed=2), tokenizer, max_new_tokens=3)]
    env = Flat()
    for skip in (True, False):
        cfg = UpdateConfig(lr=1e-2, beta=0.005, skip_zero_signal=skip)
        m = build_method("cotrain", policy, frozen, cfg, UpdateConfig(lr=1e-2, skip_zero_signal=skip),
                         sim_model=sim_model, sim_tokenizer=tokenizer, sim_reward="adversarial")
        before = adapter_state(policy_model, "policy")
        metrics = train_step(m, env, env.tasks()[:2], 2, step=0)
        moved = any(not torch.equal(before[k], v) for k, v in adapter_state(policy_model, "policy").items())
        assert metrics["zero_var_frac"] == 1.0
        assert metrics["skipped_update"] is skip and metrics["sim_skipped_update"] is skip
        assert moved is not skip                    # the paper's update applies the KL term and AdamW
        if skip:
            assert "advantage" in metrics["skip_reason"] and metrics["policy_entropy"] is None
            assert metrics["compute"]["policy_backprop"] == metrics["compute"]["ref_forward"] == 0
        else:
            assert "skip_reason" not in metrics and metrics["policy_entropy"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_shared_prefix_update_under_checkpointing_with_eager_attention_equals_the_plain_one(tokenizer, arch):
    """The backward replays the prefix's checkpointed layers after the suffix forward began:
    with one cache for both, the replay was served the prefix's own keys again (2P keys for
    P queries), which sdpa's trimming hid and eager attention refused with a size mismatch."""
    torch.manual_seed(0)
    base = build_tiny_model(tokenizer, arch, hidden_size=32, num_layers=2, attention="eager")
    assert prefix.supported(base)
    episodes = grouped_episodes(len(tokenizer), groups=2, group_size=3)
    adv = torch.linspace(-1.0, 1.0, len(episodes))
    plain, g0 = run_update(base, episodes, adv, sharing=False)
    shared, g1 = run_update(base, episodes, adv, sharing=True, checkpointing=True)
    assert shared["tokens_forward"] < plain["tokens_forward"]
    assert shared["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()


def test_plan_gives_each_group_its_own_longer_prefix():
    """Two groups whose prompts share 3 ids, each group 6 of its own (P4G: the persuadee
    prompt's opening, then a persona): two units of 6 shared ids, not one of 3."""
    a, b = [1, 2, 3, 4, 4, 4], [1, 2, 3, 5, 5, 5]
    ids = torch.tensor([a + [7, 8], a + [9, 8], b + [7, 8], b + [9, 9]])
    attn = torch.ones_like(ids)
    loss = torch.zeros(4, 7)
    loss[:, 6:] = 1                    # each row trains its last id
    units = prefix.plan(ids, attn, loss, micro_batch=8, min_prefix=2)
    assert units == [([0, 1], 6, 8), ([2, 3], 6, 8)]
    assert prefix.fed_tokens(attn, units) == 2 * (6 + 2 + 2) < 3 + 4 * 5       # the old plan's unit
