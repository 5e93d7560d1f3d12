"""The amount readout (minscope/readout.py): the sampled reading's rules, and the expected
reading as exactly the expectation of the sampled one (an unreadable answer paying $0), in
float64 whatever the dtype of the log-probs it is given."""

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


OTHER = 11          # every id past "." is neither a digit nor a point: the rules read them alike


def enumerated(after_0, after_1, b=0):
    """(mean of the sampled reading, unreadable = $0; P(readable)) for row b, by enumerating
    every 3-token continuation in float64. The ids past "." are merged into one class (their
    mass summed), as the rules read them alike. The distribution after the first two tokens is
    the teacher-forced one where the rules look, and does not matter elsewhere (spread evenly)."""
    def classes(logp):
        p = logp[b].to(torch.float64).exp()
        p = p / p.sum(-1, keepdim=True)         # a low-precision dtype's log-probs need not sum to 1
        return torch.cat([p[:, :OTHER], p[:, OTHER:].sum(-1, keepdim=True)], -1)   # [3, 12]
    c0, c1 = classes(after_0), classes(after_1)
    n = c0.shape[-1]
    total = mass = 0.0
    for a, m, t in itertools.product(range(n), repeat=3):
        p = c0[0, a].item()
        if a in (0, 1):
            second = c0 if a == 0 else c1
            p *= second[1, m].item() * (second[2, t].item() if m == TOK.point else 1.0 / n)
        else:
            p *= 1.0 / n ** 2
        dollars = read_tokens([a, m, t], TOK)
        total += p * (dollars or 0.0)           # unreadable: no gift, as the sampled reward pays
        mass += p * (dollars is not None)
    return total, mass


def check_against_enumeration(after_0, after_1, rel=1e-9):
    read = expected_amount(after_0, after_1, TOK)
    for b in range(after_0.shape[0]):
        total, mass = enumerated(after_0, after_1, b)
        assert 0 <= read.amount[b].item() <= CAP
        assert read.amount[b].item() == pytest.approx(total, rel=rel, abs=1e-300)
        assert read.coverage[b].item() == pytest.approx(mass, rel=rel, abs=1e-300)
        if mass > 0:
            assert read.conditional[b].item() == pytest.approx(total / mass, rel=rel)


def test_expected_equals_sampled_on_random_distributions():
    """Random distributions at the five positions the rules read."""
    g = torch.Generator().manual_seed(0)
    after_0 = torch.log_softmax(3 * torch.randn(4, 3, V, generator=g, dtype=torch.float64), -1)
    after_1 = torch.log_softmax(3 * torch.randn(4, 3, V, generator=g, dtype=torch.float64), -1)
    after_1[:, 0] = after_0[:, 0]              # both forwards see the same first position
    check_against_enumeration(after_0, after_1)


def forced(first, after_0, after_1, point_0=None, point_1=None):
    """Log-probs [1, 3, V] of the two forwards from {id: probability} dicts (the rest of the
    mass, if any, spread over the other ids evenly)."""
    def dist(pairs):
        d = torch.zeros(V, dtype=torch.float64)
        for i, p in pairs.items():
            d[i] = p
        rest = [i for i in range(V) if i not in pairs]
        d[rest] = (1 - d.sum()).clamp_min(0) / len(rest)
        return d.log()
    uniform = {}
    return (torch.stack([dist(first), dist(after_0), dist(point_0 or uniform)])[None],
            torch.stack([dist(first), dist(after_1), dist(point_1 or uniform)])[None])


@pytest.mark.parametrize("case", [
    # all the first digit's mass on "0", then a digit: "05", unreadable
    dict(first={0: 1.0}, after_0={5: 1.0}, after_1={}),
    # nearly all on "05", a little "0.5" and "2"
    dict(first={0: 0.99, 2: 0.01}, after_0={5: 0.98, 10: 0.02}, after_1={}, point_0={5: 1.0}),
    # the mass on forms that are not a digit ("N", "$0")
    dict(first={12: 0.9, 1: 0.1}, after_0={}, after_1={10: 0.5, 3: 0.5}, point_1={9: 1.0}),
    # "1." followed by no tenths digit, and "0." the same
    dict(first={0: 0.5, 1: 0.5}, after_0={10: 1.0}, after_1={10: 1.0}, point_0={12: 1.0}, point_1={11: 1.0}),
    # nothing readable at all
    dict(first={12: 1.0}, after_0={}, after_1={}),
])
def test_expected_equals_sampled_on_adversarial_distributions(case):
    check_against_enumeration(*forced(**case))


def test_a_hand_computed_reading():
    """The persuadee writes "0]" 0.2, "0.5" 0.3, "1]" 0.1, "1.5" 0.1, "2" 0.1 and "N" 0.2:
    coverage 0.8; expected 0.3 x 0.5 + 0.1 x 1 + 0.1 x 1.5 + 0.1 x 2 = 0.6 dollars (what the
    sampled reading pays on average, "N" paying $0), 0.6 / 0.8 = 0.75 given a readable one."""
    after_0, after_1 = forced({0: 0.5, 1: 0.2, 2: 0.1, 12: 0.2}, {11: 0.4, 10: 0.6}, {11: 0.5, 10: 0.5},
                              point_0={5: 1.0}, point_1={5: 1.0})
    read = expected_amount(after_0, after_1, TOK)
    assert read.coverage.item() == pytest.approx(0.8)
    assert read.amount.item() == pytest.approx(0.6)
    assert read.conditional.item() == pytest.approx(0.75)


def naive_conditional(after_0, after_1):
    """The readout as it was: E[gift | readable] with the coverage a difference of near-equal
    numbers, in the probabilities' own dtype. Kept here to show the case below breaks it."""
    digits = list(TOK.digits)
    p0, p1 = after_0.exp(), after_1.exp()
    p, q0, q1 = p0[:, 0, digits], p0[:, 1], p1[:, 1]
    v = torch.arange(10, dtype=p.dtype) / 10
    q1_digit = q1[:, digits].sum(-1)
    one = (1 - q1_digit) + CAP * q1_digit + q1[:, TOK.point] * (p1[:, 2, digits] * v).sum(-1)
    zero = q0[:, TOK.point] * (p0[:, 2, digits] * v).sum(-1)
    coverage = p.sum(-1) - p[:, 0] * q0[:, digits].sum(-1)
    return (CAP * p[:, 2:].sum(-1) + p[:, 1] * one + p[:, 0] * zero) / coverage.clamp_min(1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_readout_cancellation_on_05(dtype):
    """A speaker whose first-digit mass sits on "0" followed by a digit ("05", unreadable),
    its logits and log-probs in the model's dtype over a vocabulary of 1000: the readout stays in
    [0, 2] dollars and matches the exact value of the same log-probs, renormalised and
    enumerated in float64."""
    n = 1000
    g = torch.Generator().manual_seed(1)
    logits_0, logits_1 = torch.randn(1, 3, n, generator=g), torch.randn(1, 3, n, generator=g)
    logits_0[0, 0, 0] = 25.0        # the first digit: "0"
    logits_0[0, 1, 5] = 25.0        # after "0": "5"
    logits_1[:, 0] = logits_0[:, 0]
    after_0 = torch.log_softmax(logits_0.to(dtype), -1)
    after_1 = torch.log_softmax(logits_1.to(dtype), -1)
    assert naive_conditional(after_0, after_1).float().item() > 1e6      # the case breaks the old readout
    read = expected_amount(after_0, after_1, TOK)
    assert read.amount.dtype == torch.float64
    for x in (read.amount, read.conditional):
        assert 0 <= x.item() <= CAP
    total, mass = enumerated(after_0, after_1)
    assert read.amount.item() == pytest.approx(total, rel=1e-9)
    assert read.coverage.item() == pytest.approx(mass, rel=1e-9)
    assert read.conditional.item() == pytest.approx(total / mass, rel=1e-9)


def test_a_tokenizer_that_merges_digits_is_refused_with_a_reason():
    def merged(text):     # "10" as one token
        return [ord(c) for c in text.replace("1.", "\x01")]
    with pytest.raises(ValueError, match="one per character"):
        amount_tokens(merged, "[DONATE $")


def test_low_coverage_is_one_line_naming_the_lowest_and_the_report_says_it(tmp_path):
    import json

    from minscope.readout import low_coverage
    from minscope.real_tables import training_log
    recs = [{"kind": "train", "step": 0, "train_reward": 0.5, "readout_coverage": 0.99},
            {"kind": "train", "step": 1, "train_reward": 0.5, "readout_coverage": 0.42},
            {"kind": "eval", "step": 2, "panel_mean": 0.3, "readout_coverage": 0.85}]
    line = low_coverage(recs)
    assert "2 of 3" in line and "0.420 (train step 1)" in line and "\n" not in line
    assert low_coverage(recs[:1]) is None and low_coverage([{"kind": "train", "step": 0}]) is None
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert f"**Warning**: {line}." in "\n".join(training_log(run))
    (run / "metrics.jsonl").write_text(json.dumps(recs[0]) + "\n")
    assert "Warning" not in "\n".join(training_log(run))
