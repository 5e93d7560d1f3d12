"""The GRPO loss and its gradient on three hand-made episodes, worked out by hand.

The expected values use Python floats and `math` only, one token at a time, from the
equations at the top of minscope/grpo.py; minscope computes the same with tensors and
autograd. Each token is chosen to take a different branch of the clipped surrogate.
"""
import math

import pytest
import torch

from minscope.grpo import group_advantages, grpo_loss

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.1          # clip range [0.8, 1.28]; KL weight
# One group of three episodes, three token slots each. MASK 0 = not a token the policy said
# (padding here): its log-probs are absurd on purpose, and must change nothing.
REWARDS = [1.0, 0.0, 0.5]
LOGP = [[-1.0, -0.5, -2.0], [-1.5, -0.2, -900.0], [-0.7, -9.0, -9.0]]
OLD = [[-1.1, -0.9, -2.0], [-1.0, -0.5, 0.0], [-0.6, 0.0, 0.0]]
REF = [[-1.2, -0.6, -1.8], [-1.3, -0.4, -10.0], [-0.5, 0.0, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]

# Advantages: mean reward 0.5; population variance (0.5^2 + 0.5^2 + 0^2) / 3 = 1/6, so
# std = 1/sqrt(6) and A = (R - 0.5) * sqrt(6) = +sqrt(1.5), -sqrt(1.5), 0  (+-1.2247).
A = math.sqrt(1.5)
ADV = [A, -A, 0.0]

# Per trained token (episode, slot): r = exp(logp - old), and the surrogate
# surr = min(r A, clip(r, 0.8, 1.28) A). On the unclipped branch d surr / d logp = r A
# (d r / d logp = r); on the clipped branch the gradient is 0.
#   (0, 0) A > 0, r = e^0.1  = 1.1052, inside the range:   surr = r A    = 1.3536
#   (0, 1) A > 0, r = e^0.4  = 1.4918 > 1.28, clipped:      surr = 1.28 A = 1.5677, no gradient
#   (0, 2) A > 0, r = e^0    = 1:                           surr = A      = 1.2247
#   (1, 0) A < 0, r = e^-0.5 = 0.6065 < 0.8: min(-0.7428, 0.8 A = -0.9798) is the clipped
#          branch:                                          surr = 0.8 A  = -0.9798, no gradient
#   (1, 1) A < 0, r = e^0.3  = 1.3499 > 1.28, but for A < 0 the min keeps r A = -1.6532
#          (below 1.28 A = -1.5677): not clipped,           surr = r A    = -1.6532
#   (2, 0) A = 0:                                           surr = 0, no gradient
SURR = {(0, 0): math.exp(0.1) * A, (0, 1): 1.28 * A, (0, 2): A,
        (1, 0): 0.8 * -A, (1, 1): math.exp(0.3) * -A, (2, 0): 0.0}
DSURR = {(0, 0): math.exp(0.1) * A, (0, 1): 0.0, (0, 2): A,
         (1, 0): 0.0, (1, 1): math.exp(0.3) * -A, (2, 0): 0.0}
CLIPPED = 2                                       # (0, 1) and (1, 0)

# KL to the reference, the k3 estimator with d = ref - logp: kl = e^d - d - 1 >= 0, and
# d kl / d logp = -(e^d - 1) = 1 - e^d (d falls as logp rises).
#   d = ref - logp: (0, 0) -0.2, (0, 1) -0.1, (0, 2) +0.2, (1, 0) +0.2, (1, 1) -0.2, (2, 0) +0.2
D = {(0, 0): -0.2, (0, 1): -0.1, (0, 2): 0.2, (1, 0): 0.2, (1, 1): -0.2, (2, 0): 0.2}


def k3(d):
    return math.exp(d) - d - 1


def dk3_dlogp(d):
    return 1 - math.exp(d)


def expected(weights):
    """Loss = sum over trained tokens of w * (-surr + beta * kl); its gradient per token."""
    loss = sum(weights[k] * (-SURR[k] + BETA * k3(D[k])) for k in SURR)
    grad = [[0.0] * 3 for _ in range(3)]          # 0 at padding: it is in no term
    for (i, t) in SURR:
        grad[i][t] = weights[(i, t)] * (-DSURR[(i, t)] + BETA * dk3_dlogp(D[(i, t)]))
    return loss, grad


# minscope's aggregation weights are float32 (mask.float()): 1/6 there is 1/6 to 7 digits,
# so the two sides agree to ~1e-8, far closer than any branch taken wrongly (>= 1e-3).
TOL = 1e-7


def minscope_loss(aggregation):
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.tensor(OLD, dtype=torch.float64), torch.tensor(REF, dtype=torch.float64),
                            torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64),
                            eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, aggregation=aggregation)
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


def test_group_advantages_by_hand():
    adv, zero_var = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), group_size=3)
    assert adv.tolist() == pytest.approx(ADV, abs=1e-12)
    assert zero_var.tolist() == [False]


def test_token_mean_loss_and_gradient_by_hand():
    # "token" aggregation: the mean over the 6 trained tokens, w = 1/6 each.
    # loss = (1/6) (-1.3536 - 1.5677 - 1.2247 + 0.9798 + 1.6532 - 0
    #               + 0.1 (0.01873 + 0.00484 + 0.02140 + 0.02140 + 0.01873 + 0.02140))
    #      = (1/6) (-1.5130 + 0.01065) = -0.25038
    want_loss, want_grad = expected({k: 1 / 6 for k in SURR})
    assert want_loss == pytest.approx(-0.25038, abs=1e-5)
    # e.g. token (1, 1): (1/6) (-(-1.6532) + 0.1 (1 - e^-0.2)) = (1/6) (1.6532 + 0.01813) = 0.27856
    assert want_grad[1][1] == pytest.approx(0.27856, abs=1e-5)
    loss, grad, stats = minscope_loss("token")
    assert loss == pytest.approx(want_loss, abs=TOL)
    for row, want_row in zip(grad, want_grad):
        assert row == pytest.approx(want_row, abs=TOL)
    assert stats["clip_frac"] == pytest.approx(CLIPPED / 6)
    assert stats["kl"] == pytest.approx(sum(k3(d) for d in D.values()) / 6, abs=TOL)


def test_sequence_mean_loss_and_gradient_by_hand():
    # "sequence" aggregation: the mean within each episode, then over the 3 episodes:
    # w = 1/(3*3) in episode 0 (3 tokens), 1/(3*2) in episode 1, 1/(3*1) in episode 2.
    per_episode = {0: 1 / 9, 1: 1 / 6, 2: 1 / 3}
    want_loss, want_grad = expected({(i, t): per_episode[i] for (i, t) in SURR})
    loss, grad, _ = minscope_loss("sequence")
    assert loss == pytest.approx(want_loss, abs=TOL)
    for row, want_row in zip(grad, want_grad):
        assert row == pytest.approx(want_row, abs=TOL)
