"""Reading the amount a simulator states: as its own sampled decision, and as an expectation.

P4G's persuadee ends an episode by stating its gift: asked for its decision, its reply begins
with "[DONATE $" and it writes the amount. For a tokenizer that writes digits one token at a
time (SmolLM2, Qwen, Llama 2; `amount_tokens` checks it), three tokens decide the amount: a
digit d, then "." or something else, then the tenths digit. The reading, in dollars, capped at
2 and to the dime (hundredths are not read):

    d >= 2                 -> 2 (the cap)        "2]", "2.50]", "3]"
    1, then a digit        -> 2 (ten or more)    "10]"
    1, ".", tenths t       -> 1 + t/10           "1.50]" -> 1.5
    1, anything else       -> 1                  "1]", "1 to the charity]"
    0, ".", tenths t       -> t/10               "0.50]" -> 0.5
    0, then a digit        -> not read           "05]"
    0, anything else       -> 0                  "0]"
    not a digit            -> not read           "N]", "$0]"

Two readings share these rules, so one is exactly the expectation of the other:
  - `expected_amount`: the sum over amounts of P_T(amount) * amount, where P_T is the
    speaker's sampling distribution at its temperature and an unreadable answer counts $0,
    as it does when sampled: E[dollars x 1{readable}], in float64 from the log-probs, with
    no division. Exact, from two teacher-forced forwards ("0." and "1." after the prefix give
    every distribution the rules look at); no sampling. Beside it, as diagnostics: the
    coverage (the probability that what the speaker writes is read at all) and the amount
    given a readable answer (E[dollars | readable] = amount / coverage), which is not what a
    sampled reading pays when the coverage is under 1.
  - `read_tokens`: the reading of three sampled tokens (None, paid $0, when unreadable). The
    rollout appends them to the speaker's own token stream with loss mask 1
    (`rollout.LMSpeaker.read_amount`), so a trained simulator learns the decision it is paid for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

CAP = 2.0                 # the most a reading can be (P4G: the persuadee's $2)
DECISION_TOKENS = 3       # digit, point, tenths: all a reading looks at
COVERAGE_FLOOR = 0.9      # under it, a run says so: many answers are unreadable and pay $0


@dataclass(frozen=True)
class AmountTokens:
    digits: tuple[int, ...]     # the ids of "0".."9" right after the prefix (and after a digit)
    point: int                  # the id of "." after a digit
    tenths: tuple[int, ...]     # the ids of "0".."9" after "d."


def amount_tokens(text_ids, prefix: str) -> AmountTokens:
    """The ids the rules look at, for the tokenizer behind `text_ids` (text -> ids). Raises a
    ValueError naming the problem when digits are not one token each after `prefix`."""
    head = text_ids(prefix)

    def tail(text: str, n: int) -> list[int]:
        ids = text_ids(prefix + text)
        if ids[:len(head)] != head or len(ids) != len(head) + n:
            raise ValueError(f"the amount readout needs a tokenizer that writes {prefix + text!r} as "
                             f"{prefix!r} plus {n} token(s), one per character; this one does not")
        return ids[len(head):]

    digits = tuple(tail(d, 1)[0] for d in "0123456789")
    one, point, five = tail("1.5", 3)
    if one != digits[1]:
        raise ValueError(f"the amount readout: '1' after {prefix!r} tokenizes differently before a '.'")
    tenths = tuple(tail("1." + t, 3)[2] for t in "0123456789")
    return AmountTokens(digits, point, tenths)


def read_tokens(ids: list[int], tok: AmountTokens) -> float | None:
    """The dollars that sampled ids (what follows the prefix) state, by the rules above; None
    when they state no readable amount."""
    digit = {i: n for n, i in enumerate(tok.digits)}
    if not ids or ids[0] not in digit:
        return None
    d = digit[ids[0]]
    if d >= 2:
        return CAP
    nxt = ids[1] if len(ids) > 1 else None
    if nxt in digit:
        return CAP if d == 1 else None
    if nxt == tok.point and len(ids) > 2:
        tenth = {i: n for n, i in enumerate(tok.tenths)}
        return d + tenth.get(ids[2], 0) / 10
    return float(d)


class Reading(NamedTuple):
    """The expected reading of a batch, each a [B] float64 tensor."""
    amount: torch.Tensor        # E[dollars x 1{readable}]: an unreadable answer is $0 (what pays)
    conditional: torch.Tensor   # E[dollars | readable] (a diagnostic; 0 where nothing is readable)
    coverage: torch.Tensor      # P(readable)


def expected_amount(after_0: torch.Tensor, after_1: torch.Tensor, tok: AmountTokens) -> Reading:
    """The expected reading (a `Reading` of [B] float64 tensors) from the speaker's sampling
    log-probabilities (any dtype; read in float64, renormalised) at the three positions of the
    teacher-forced "0." (`after_0` [B, 3, V]: after the prefix, after "0", after "0.") and
    "1." (`after_1`, the same after "1").

    Every term is a sum of products of probabilities, none a difference: the mass of "not a
    digit" is summed over the tokens that are not digits, never taken as 1 minus the digits'.
    So a speaker whose mass sits on the unreadable "05" reads near $0, not as a ratio of
    rounding errors."""
    # [B, 3, V] probabilities in float64, renormalised (log-probs of a low-precision dtype
    # need not sum to exactly 1)
    p0, p1 = (x.to("cpu", torch.float64).log_softmax(-1).exp() for x in (after_0, after_1))
    digits, tenths = list(tok.digits), list(tok.tenths)
    not_digit = torch.ones(p0.shape[-1], dtype=torch.bool)
    not_digit[digits] = False
    value_of_tenths = torch.arange(10, dtype=torch.float64) / 10
    p = p0[:, 0, digits]                                     # the first digit's distribution [B, 10]
    q0, r0, q1, r1 = p0[:, 1], p0[:, 2], p1[:, 1], p1[:, 2]
    tenths_0 = (r0[:, tenths] * value_of_tenths).sum(-1)     # E[t/10] after "0."
    tenths_1 = (r1[:, tenths] * value_of_tenths).sum(-1)     # E[t/10] after "1."
    # after "0": "." then t -> t/10; another non-digit -> 0 (read, worth nothing); a digit -> unread
    zero = q0[:, tok.point] * tenths_0
    zero_read = q0[:, not_digit].sum(-1)
    # after "1": a digit -> CAP; anything else -> 1, plus t/10 after "." (1 x P(non-digit) + 2 x P(digit))
    one = q1[:, not_digit].sum(-1) + CAP * q1[:, digits].sum(-1) + q1[:, tok.point] * tenths_1
    total = CAP * p[:, 2:].sum(-1) + p[:, 1] * one + p[:, 0] * zero
    coverage = p[:, 1:].sum(-1) + p[:, 0] * zero_read
    paid = total.clamp(0.0, CAP)
    conditional = torch.where(coverage > 0, total / coverage.clamp_min(1e-300), torch.zeros_like(total))
    return Reading(paid, conditional.clamp(0.0, CAP), coverage.clamp(0.0, 1.0))


def low_coverage(records: list[dict]) -> str | None:
    """One line when a record (a metrics.jsonl row: kind, step, readout_coverage) has its
    readout coverage under COVERAGE_FLOOR, naming the lowest; None when none has."""
    low = [r for r in records if r.get("readout_coverage", 1.0) < COVERAGE_FLOOR]
    if not low:
        return None
    r = min(low, key=lambda r: r["readout_coverage"])
    return (f"readout coverage under {COVERAGE_FLOOR:g} in {len(low)} of {len(records)} record(s), lowest "
            f"{r['readout_coverage']:.3f} ({r.get('kind', 'a')} step {r.get('step', '?')}): the persuadee "
            "often writes no readable amount, which pays $0 (readout_decision_conditional: the gift when readable)")
