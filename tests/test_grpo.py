"""GRPO as equations: hand-computed small cases."""
import math

import pytest
import torch

from minscope.grpo import aggregation_weights, group_advantages, grpo_loss, simulator_rewards, token_loss


def test_group_advantages_zscore_each_group_with_population_std():
    adv, zero_var = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert zero_var.tolist() == [False, True]


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), group_size=2)


def test_ratio_above_upper_clip_stops_positive_advantage():
    logp = torch.tensor([math.log(1.5)], requires_grad=True)
    loss, ratio, clipped = token_loss(logp, torch.zeros(1), None, torch.ones(1), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.28)          # -(clip(1.5) * 1)
    assert clipped.item()
    loss.sum().backward()
    assert logp.grad.item() == 0.0


def test_clip_is_asymmetric_for_negative_advantage():
    # ratio 0.7 with A = -1: the clipped branch (0.8 * -1 = -0.8) is larger than 0.7 * -1,
    # so the min picks the unclipped -0.7 ... and with ratio 0.5 below 1-eps_low = 0.8:
    loss, _, clipped = token_loss(torch.tensor([math.log(0.5)]), torch.zeros(1), None,
                                  -torch.ones(1), 0.2, 0.28)
    assert loss.item() == pytest.approx(0.8)            # -min(0.5*-1, 0.8*-1) = 0.8
    assert clipped.item()
    # ratio 1.25 with A = +1 is inside [0.8, 1.28]: not clipped (eps_high = 0.28, not 0.2)
    loss, _, clipped = token_loss(torch.tensor([math.log(1.25)]), torch.zeros(1), None,
                                  torch.ones(1), 0.2, 0.28)
    assert loss.item() == pytest.approx(-1.25)
    assert not clipped.item()


def test_kl_term_is_k3_estimator():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    loss, _, _ = token_loss(logp, logp, ref, torch.zeros(1), beta=0.1)
    d = math.log(0.5)
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1))


def test_kl_at_untrained_positions_cannot_make_the_loss_nan():
    """A prompt or padding position (mask 0) may hold any log-probs: ref - logp = 200 there
    must not reach the exponential (exp(200) = inf, and inf * weight 0 = NaN)."""
    logp = torch.tensor([[-1.0, -250.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.2, -50.0, -0.4]])                  # ref - logp = 200 at position 1
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss, stats = grpo_loss(logp, logp.detach(), ref, torch.ones(1), mask, beta=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and math.isfinite(stats["kl"])
    assert logp.grad[0, 1] == 0.0
    # the trained positions keep their KL term: the same loss as without the untrained one
    keep = [0, 2]
    alone, _ = grpo_loss(logp.detach()[:, keep], logp.detach()[:, keep], ref[:, keep], torch.ones(1),
                         mask[:, keep], beta=0.1)
    assert loss.item() == pytest.approx(alone.item())


def test_token_aggregation_is_mean_over_all_masked_tokens():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = aggregation_weights(mask, "token")
    assert torch.allclose(w, mask / 4)


def test_sequence_aggregation_weighs_each_sequence_equally():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    w = aggregation_weights(mask, "sequence")
    assert torch.allclose(w[0], torch.tensor([1 / 6, 1 / 6, 1 / 6]))
    assert torch.allclose(w[1], torch.tensor([0.5, 0.0, 0.0]))


def test_fixed_aggregation_divides_by_batch_times_max_len():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = aggregation_weights(mask, "fixed", max_len=10)
    assert torch.allclose(w, mask / 20)


def test_grpo_loss_broadcasts_sequence_advantage_and_reports_stats():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = grpo_loss(logp, logp, None, torch.tensor([2.0, -1.0]), mask,
                            zero_var=torch.tensor([True, False]))
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)   # ratio 1: loss = -mean(A) over tokens
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["zero_var_frac"] == 0.5


@pytest.mark.parametrize("aggregation", ["token", "sequence", "fixed"])
def test_readable_grpo_loss_equals_the_fused_one_training_uses(aggregation):
    """`grpo_loss` is the loss to read; training computes it through the LM head in chunks
    (`fused_grpo_token_loss`): same value, same gradient w.r.t. the hidden states."""
    from minscope.logprobs import fused_grpo_token_loss, token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] + [1.0] * 2 + [0.0] * 2])
    with torch.no_grad():
        old = token_logprobs(hidden, weight, targets) + 0.3 * torch.randn(3, 5, generator=g)
        ref = old - 0.1
    adv = torch.tensor([1.5, -0.5, 0.7])
    loss, _ = grpo_loss(token_logprobs(hidden, weight, targets), old, ref, adv, mask, beta=0.05,
                        aggregation=aggregation, max_len=6)
    (grad,) = torch.autograd.grad(loss, hidden)
    fused, _, _ = fused_grpo_token_loss(hidden, weight, targets, old, ref, adv[:, None].expand(3, 5),
                                        aggregation_weights(mask, aggregation, max_len=6), beta=0.05,
                                        backend="torch", chunk_size=4)
    (fused_grad,) = torch.autograd.grad(fused, hidden)
    assert fused.item() == pytest.approx(loss.item(), rel=1e-5)
    assert torch.allclose(fused_grad, grad, atol=1e-6)


def test_simulator_rewards_adversarial_cooperative_shared():
    r = torch.tensor([1.0, 0.0])
    assert simulator_rewards(r, 2, "adversarial").tolist() == [-1.0, -0.0]
    assert simulator_rewards(r, 2, "cooperative").tolist() == [1.0, 0.0]
    assert simulator_rewards(r, 2, "shared").tolist() == [1.0, 0.0]


def test_curriculum_reward_peaks_at_variance_quarter_and_is_shared_by_group():
    half = simulator_rewards(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "curriculum")
    assert half[:2].tolist() == pytest.approx([1.0, 1.0])                 # var 0.25
    assert half[2:].tolist() == pytest.approx([math.exp(-0.0625 / 0.02)] * 2)  # var 0
    with pytest.raises(ValueError):
        simulator_rewards(torch.zeros(2), 2, "servile")


def test_a_std_floor_keeps_near_equal_continuous_rewards_from_getting_full_advantages():
    """Two groups: readings 1e-3 apart, and readings 0.4 apart. Without a floor both get +-1;
    with the read rewards' floor (0.05) the first gets +-0.01 and the second is unchanged."""
    from minscope.envs.p4g import READ_STD_FLOOR

    r = torch.tensor([0.300, 0.301, 0.1, 0.5], dtype=torch.float64)
    plain, _ = group_advantages(r, 2)
    floored, zero_var = group_advantages(r, 2, std_floor=READ_STD_FLOOR)
    assert plain.tolist() == pytest.approx([-1, 1, -1, 1])
    assert floored.tolist() == pytest.approx([-0.01, 0.01, -1, 1])
    assert not zero_var.any()
