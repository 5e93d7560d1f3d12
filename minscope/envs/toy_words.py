"""The toy's words: the persuader's acts, the persuadee's replies, and how text is read as them.

Every utterance of the toy is one of a few fixed strings: 7 persuader acts (ACTS) and 23
persuadee replies (REPLIES, each with a unique first word), beside the 4 personas (the tasks)
and the three phrasings of what each one cares about (CUES). Text is read by exact match
after `normalize` (`text_to_act`, `canonical_reply`), and the donation a reply states by a
lenient reading (`stated_amount`, `donation`). The world (toy_world.py) and the environment
(toy.py) both read utterances through these functions.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

ACTS = {  # act key -> the utterance the persuader says
    "probe": "what matters to you?",
    "emotion": "think of a hungry child",
    "evidence": "the data shows it works",
    "social": "your friends already gave",
    "benefit": "it is tax deductible",
    "small_ask": "would you give 1 dollar?",
    "big_ask": "would you give 2 dollars?",
}
ACT_KEYS = tuple(ACTS)
STRATEGIES = ("emotion", "evidence", "social", "benefit")
INVALID = "invalid"

# Persona i's key strategy is STRATEGIES[i]; its three cue phrasings name what it cares about.
PERSONAS = ("the empath", "the analyst", "the joiner", "the saver")
CUES = (("kids in need move me", "feelings guide me", "sad stories touch me"),
        ("data convinces me", "proof matters to me", "numbers never lie"),
        ("friends matter to me", "everyone giving inspires me", "community counts"),
        ("taxes worry me", "money is tight", "savings come first"))

BLAND = "hmm hard to say"
WOW = "wow that moves me"            # persuaded
OKAY = "okay i see"                  # unmoved
STOP = "stop pushing me"             # resentful (pushback)
YES2 = "yes i give 2 dollars"
SURE1 = "sure i give 1 dollar"
MAYBE = "maybe later"
NO = "no thanks"
FORGET = "forget it"                 # retractions of a pledge: they state 0, like "no thanks"
NEVER = "never mind then"
WHAT = "what do you mean"            # reply to text that is not an act
REPLIES = (BLAND, *[c for cues in CUES for c in cues], WOW, OKAY, STOP, YES2, SURE1, MAYBE, NO, FORGET, NEVER, WHAT)
RESENTFUL = (STOP, NO, FORGET, NEVER)


@dataclass(frozen=True)
class ToyTask:
    """A task is a persona type: the simulator is told `name`, the policy is not."""
    persona: int
    name: str


@functools.lru_cache(maxsize=1 << 16)     # pure: exact evaluation calls it ~10^6 times per arm
def normalize(text: str) -> str:
    """Lower-case, single spaces, no surrounding punctuation: what exact matching compares."""
    return " ".join(text.lower().strip().strip(" .!?,;:\"'").split())


_ACT_BY_TEXT = {normalize(t): k for k, t in ACTS.items()}
_REPLY_BY_TEXT = {normalize(r): r for r in REPLIES}


def text_to_act(text: str) -> str:
    """Map an utterance to its act key by exact match after normalisation; else 'invalid'."""
    return _ACT_BY_TEXT.get(normalize(text), INVALID)


def act_entropy(act_lists) -> float | None:
    """Entropy (nats) of the persuader's acts pooled over episodes and turns: the empirical
    distribution over the 7 acts plus "invalid" (any garbled utterance counts as that one
    category). Beside the token entropy: a policy that garbles its asks raises the token
    entropy while its choice among acts can narrow. None when there are no acts."""
    acts = [a for acts in act_lists for a in acts]
    if not acts:
        return None
    counts = np.array([acts.count(k) for k in (*ACT_KEYS, INVALID)], dtype=float)
    p = counts[counts > 0] / len(acts)
    return float(-(p * np.log(p)).sum()) + 0.0


def canonical_reply(text: str) -> str | None:
    """The reply in REPLIES this text is (after normalisation), or None."""
    return _REPLY_BY_TEXT.get(normalize(text))


_AMOUNT = re.compile(r"give\s+\$?(\d+(?:\.\d+)?)\s*dollar")


@functools.lru_cache(maxsize=1 << 16)
def stated_amount(text: str) -> float | None:
    """Donation stated by a reply: 'i give N dollar(s)' -> N, 'no thanks' -> 0, else None.

    Lenient so that an LM simulator's near-misses still count, as in P4G's fallback parse.
    """
    t = normalize(text)
    m = _AMOUNT.search(t)
    if m:
        return min(float(m.group(1)), 2.0)
    if t.startswith("no thanks") or t == "no" or t in (FORGET, NEVER):
        return 0.0
    return None


def donation(replies) -> float:
    """The last amount stated in a sequence of persuadee replies (0 if none)."""
    amount = 0.0
    for r in replies:
        a = stated_amount(r)
        if a is not None:
            amount = a
    return amount
