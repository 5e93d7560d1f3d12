"""Shared-prefix update (minscope/prefix.py): the same loss, statistics and gradients as
feeding every row whole; and the zero-signal skip of the update."""
import copy

import pytest
import torch

from minscope import prefix
from minscope.envs.base import Episode
from minscope.models import add_adapters, build_tiny_model, enable_checkpointing
from minscope.rollout import Stream
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
        prompt = rand(24 + 7 * g)
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
               aggregation="token"):
    model = copy.deepcopy(base)
    if checkpointing:
        assert enable_checkpointing(model) > 0
    torch.manual_seed(1)
    model = add_adapters(model, ["policy"], init_lora_weights=False)
    cfg = UpdateConfig(lr=1e-3, beta=beta, micro_batch=micro_batch, prefix_sharing=sharing, aggregation=aggregation)
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


@pytest.mark.parametrize("micro_batch,aggregation", [(1, "token"), (2, "sequence"), (64, "fixed")])
def test_shared_prefix_update_equals_the_plain_one_for_any_micro_batch(tokenizer, micro_batch, aggregation):
    torch.manual_seed(0)
    base = build_tiny_model(tokenizer, "qwen3", hidden_size=32, num_layers=2)
    episodes = grouped_episodes(len(tokenizer), seed=micro_batch)
    adv = torch.linspace(1.0, -1.0, len(episodes))
    plain, g0 = run_update(base, episodes, adv, False, micro_batch=micro_batch, aggregation=aggregation)
    shared, g1 = run_update(base, episodes, adv, True, micro_batch=micro_batch, aggregation=aggregation)
    if micro_batch == 1:        # nothing to share within a unit of one row: the plain path exactly
        assert shared["tokens_forward"] == plain["tokens_forward"]
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
    assert units == [([0, 1, 2], 2, 7), ([3], 0, 5)]
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
