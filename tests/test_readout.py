"""The amount readout (minscope/readout.py): the sampled reading's rules, and the expected
reading as exactly the expectation of the sampled one."""

import itertools

import pytest
import torch

from minscope.readout import CAP, AmountTokens, amount_tokens, expected_amount, read_tokens

# A toy vocabulary: ids 0-9 are the digits, 10 is ".", 11 is "]", 12 is "N".
TOK = AmountTokens(digits=tuple(range(10)), point=10, tenths=tuple(range(10)))
V = 13


@pytest.mark.parametrize("ids, dollars", [
    ([0, 11], 0.0), ([0, 10, 5], 0.5), ([0, 10, 11], 0.0), ([0, 7], None),
    ([1, 11], 1.0), ([1, 10, 5], 1.5), ([1, 0], CAP), ([1], 1.0), ([1, 12, 12], 1.0),
    ([2, 10, 5], CAP), ([9], CAP), ([12, 1], None), ([], None),
])
def test_the_sampled_reading_follows_the_rules(ids, dollars):
    assert read_tokens(ids, TOK) == dollars


def test_the_expected_reading_is_the_expectation_of_the_sampled_one():
    """Random distributions at the five positions the rules read; enumerate every 3-token
    continuation with its probability (the distribution after the first two tokens is the
    teacher-forced one where the rules look, and does not matter elsewhere)."""
    g = torch.Generator().manual_seed(0)
    after_0 = torch.softmax(3 * torch.randn(2, 3, V, generator=g, dtype=torch.float64), -1)
    after_1 = torch.softmax(3 * torch.randn(2, 3, V, generator=g, dtype=torch.float64), -1)
    after_1[:, 0] = after_0[:, 0]              # both forwards see the same first position
    amount, coverage = expected_amount(after_0, after_1, TOK)
    for b in range(2):
        total = mass = 0.0
        for a, n, t in itertools.product(range(V), repeat=3):
            p = after_0[b, 0, a].item()
            if a in (0, 1):
                second = (after_0 if a == 0 else after_1)[b]
                p *= second[1, n].item()
                p *= second[2, t].item() if n == TOK.point else 1.0 / V    # unread there: any spread
            else:
                p *= 1.0 / V ** 2
            dollars = read_tokens([a, n, t], TOK)
            if dollars is not None:
                total, mass = total + p * dollars, mass + p
        assert coverage[b].item() == pytest.approx(mass, rel=1e-9)
        assert amount[b].item() == pytest.approx(total / mass, rel=1e-9)


def test_a_hand_computed_reading():
    """The persuadee writes "0]" 0.2, "0.5" 0.3, "1]" 0.1, "1.5" 0.1, "2" 0.1 and "N" 0.2:
    coverage 0.8, expected (0.3 x 0.5 + 0.1 x 1 + 0.1 x 1.5 + 0.1 x 2) / 0.8 = 0.75 dollars."""
    def dist(pairs):
        d = torch.zeros(V, dtype=torch.float64)
        for i, p in pairs:
            d[i] = p
        return d
    first = dist([(0, 0.5), (1, 0.2), (2, 0.1), (12, 0.2)])
    after_0 = torch.stack([first, dist([(11, 0.4), (10, 0.6)]), dist([(5, 1.0)])])[None]
    after_1 = torch.stack([first, dist([(11, 0.5), (10, 0.5)]), dist([(5, 1.0)])])[None]
    amount, coverage = expected_amount(after_0, after_1, TOK)
    assert coverage.item() == pytest.approx(0.8)
    assert amount.item() == pytest.approx(0.75)


def test_a_tokenizer_that_merges_digits_is_refused_with_a_reason():
    def merged(text):     # "10" as one token
        return [ord(c) for c in text.replace("1.", "\x01")]
    with pytest.raises(ValueError, match="one per character"):
        amount_tokens(merged, "[DONATE $")
