"""Verbalized Sampling (VS): ask a simulator for k replies with probabilities, then draw one.

A frozen, aligned simulator tends to say its single most likely reply every time (its mode),
so every rollout meets the same user. VS asks it instead for a small distribution,

    {"responses": [{"text": "...", "probability": 0.4}, {"text": "...", "probability": 0.1}, ...]}

and draws one reply from the stated probabilities (renormalised), which recovers much more of
the spread a real population of users would show. Only the drawn reply enters the
conversation; the candidates are kept for logging.

This module is the text side of VS and knows nothing about models:
  - `vs_instruction(k)`: the block appended to the simulator's system prompt,
  - `format_candidates`: the canonical JSON answer (SFT targets for tiny simulators),
  - `draw`: weighted or uniform choice among candidates,
  - `pick` / `fallback` / `VSStats`: what the simulator layer calls each turn, and the
    counters it logs. The caller retries a failed `pick` a few times, then uses `fallback`.
The answers are read by `verbalized_parse.parse_candidates`, a tolerant parser (small models
break the format in many ways; its module docstring gives the rules for stated probabilities).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field

from .verbalized_parse import MAX_TEXT_CHARS, TEXT_KEYS, Candidate, _elements, parse_candidates


# --------------------------------------------------------------------------- instruction
def vs_instruction(k: int = 5) -> str:
    """The block appended to a simulator's system prompt, asking for k replies as JSON."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"vs_instruction needs k >= 1 candidate replies, got {k!r}")
    return (
        "How to answer: do not write a single reply. Instead, think of "
        f"{k} different things the character you are playing could realistically say next, "
        "from the most likely to less likely but still plausible ones, and estimate for each "
        "how likely the character is to say it (a number between 0 and 1).\n"
        "Answer with JSON only, in exactly this shape, and write nothing before or after it:\n"
        '{"responses": [{"text": "<reply 1>", "probability": <number>}, '
        '{"text": "<reply 2>", "probability": <number>}, ...]}\n'
        f'The list must hold {k} entries. Each "text" is the full reply, written as the '
        "character would say it."
    )


VS_INSTRUCTION = vs_instruction(5)   # the paper's k = 5


# --------------------------------------------------------------------------- formatting
def format_candidates(cands: list[Candidate]) -> str:
    """The canonical answer to `vs_instruction`: compact JSON, probabilities rounded to 2 places.

    Texts are stripped of surrounding whitespace (the parser strips them too, so
    `parse_candidates(format_candidates(x))` gives x back up to that and the rounding).
    A missing probability is written as null.
    """
    items = []
    for c in cands:
        text = c.text.strip()
        if not text:
            raise ValueError("format_candidates got a candidate with empty text; drop it first")
        p = c.probability
        if p is not None and not (0.0 <= p <= 1.0):
            raise ValueError(f"probability must lie in [0, 1] or be None, got {p!r} for {text!r}")
        items.append({"text": text, "probability": None if p is None else round(float(p), 2)})
    return json.dumps({"responses": items}, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------- drawing
def draw(cands: list[Candidate], rng: random.Random, mode: str = "weighted") -> tuple[int, list[float]]:
    """Choose one candidate; returns (index, the normalised distribution it was drawn from).

    weighted: stated probabilities renormalised to sum to 1. A candidate without a usable
    probability (None, negative, NaN) gets the mean of the usable positive ones, so it stays
    in play without the draw inventing a preference; a stated 0 stays 0. If no candidate has
    a usable positive probability, the draw is uniform.
    uniform: every candidate 1/k, whatever was stated.
    """
    if not cands:
        raise ValueError("draw needs at least one candidate; check parse_candidates' result first")
    if mode not in ("weighted", "uniform"):
        raise ValueError(f"draw mode must be 'weighted' or 'uniform', got {mode!r}")
    k = len(cands)
    stated = [c.probability if c.probability is not None and math.isfinite(c.probability)
              and c.probability >= 0 else None for c in cands]
    positive = [p for p in stated if p is not None and p > 0]
    if mode == "uniform" or not positive:
        return rng.randrange(k), [1.0 / k] * k
    fill = sum(positive) / len(positive)
    weights = [fill if p is None else p for p in stated]
    total = sum(weights)
    dist = [w / total for w in weights]
    u, acc = rng.random(), 0.0
    for i, p in enumerate(dist):
        acc += p
        if u < acc:
            return i, dist
    return max(i for i, p in enumerate(dist) if p > 0), dist   # u landed in float round-off


def distribution_entropy(dist: list[float]) -> float:
    """Shannon entropy in nats, -sum p ln p (0 ln 0 = 0). log(k) for uniform over k."""
    if any(p < 0 for p in dist):
        raise ValueError(f"a distribution cannot hold negative probabilities: {dist}")
    return -sum(p * math.log(p) for p in dist if p > 0)


# --------------------------------------------------------------------------- per-turn use
@dataclass
class VSStats:
    """Counters for one logging window (e.g. one training step); `reset()` between windows.

    requests: turns a reply was asked for (pick with attempt == 0)
    retries: further generations for the same turn (pick with attempt > 0)
    parse_failures: generations with no usable candidate (= retries + fallbacks when the
        caller retries a fixed number of times and then falls back)
    fallbacks: turns that ended with the raw text as the reply
    entropies / n_candidates: of each successful draw's distribution
    """

    requests: int = 0
    retries: int = 0
    parse_failures: int = 0
    fallbacks: int = 0
    entropies: list[float] = field(default_factory=list)
    n_candidates: list[int] = field(default_factory=list)

    @property
    def mean_entropy(self) -> float | None:
        return sum(self.entropies) / len(self.entropies) if self.entropies else None

    def as_dict(self) -> dict:
        """Flat numbers for a metrics line; undefined means are None (JSON null)."""
        generations = self.requests + self.retries
        return {
            "requests": self.requests,
            "retries": self.retries,
            "parse_failures": self.parse_failures,
            "fallbacks": self.fallbacks,
            "draws": len(self.entropies),
            "parse_failure_rate": self.parse_failures / generations if generations else None,
            "fallback_rate": self.fallbacks / self.requests if self.requests else None,
            "mean_entropy": self.mean_entropy,
            "mean_candidates": (sum(self.n_candidates) / len(self.n_candidates)
                                if self.n_candidates else None),
        }

    def merge(self, other: "VSStats") -> "VSStats":
        """Add another window's counts into this one (e.g. from several simulators); returns self."""
        self.requests += other.requests
        self.retries += other.retries
        self.parse_failures += other.parse_failures
        self.fallbacks += other.fallbacks
        self.entropies.extend(other.entropies)
        self.n_candidates.extend(other.n_candidates)
        return self

    def reset(self) -> None:
        self.requests = self.retries = self.parse_failures = self.fallbacks = 0
        self.entropies.clear()
        self.n_candidates.clear()


def pick(text: str, rng: random.Random, mode: str = "weighted", stats: VSStats | None = None,
         attempt: int = 0) -> tuple[str | None, list[Candidate], list[float]]:
    """Parse one generation and draw a reply: (reply, candidates, distribution).

    On failure (no candidate) returns (None, [], []) and counts a parse failure; the caller
    may generate again with attempt + 1, then call `fallback`. attempt 0 counts a request,
    attempt > 0 a retry.
    """
    if mode not in ("weighted", "uniform"):
        raise ValueError(f"pick mode must be 'weighted' or 'uniform', got {mode!r}")
    if stats is not None:
        if attempt == 0:
            stats.requests += 1
        else:
            stats.retries += 1
    cands = parse_candidates(text)
    if not cands:
        if stats is not None:
            stats.parse_failures += 1
        return None, [], []
    index, dist = draw(cands, rng, mode)
    if stats is not None:
        stats.entropies.append(distribution_entropy(dist))
        stats.n_candidates.append(len(cands))
    return cands[index].text, cands, dist


_FENCE_RE = re.compile(r"```[ \t]*[A-Za-z0-9_+-]*")
_TEXT_FIELD_RE = re.compile(
    r"""(?<![A-Za-z_])["']?(?:%s)["']?\s*:\s*(["'])((?:\\.|(?!\1).)*)(?:\1|$)""" % "|".join(TEXT_KEYS),
    re.IGNORECASE | re.DOTALL)
_VS_TAG_RE = re.compile(r"</?(?:responses?|text|probability)>", re.IGNORECASE)
_JUNK_EDGES = " \t\r\n{}[],"


def _without_probabilities(text: str) -> str:
    """`text` without its <probability>..</probability> elements (linear time)."""
    parts, pos = [], 0
    for start, end, _ in _elements(text, "probability"):
        parts.append(text[pos:start])
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


def fallback(text: str, stats: VSStats | None = None) -> str:
    """The reply to use when VS parsing kept failing; counts a fallback.

    Returns, from the raw generation (its first MAX_TEXT_CHARS characters, as parse_candidates):
      1. with code-fence markers (``` and an optional language word) removed,
      2. if a text field is present ("text"/"response"/"reply"/"content" followed by ':' and
         a quoted value, the closing quote optional since output may be cut off), the first
         such value, with \\n, \\" and similar escapes undone;
      3. otherwise the text with VS tags removed (<response>, <text>, whole
         <probability>..</probability> elements),
    stripped of leading/trailing whitespace; in case 3 also of leading/trailing { } [ ] and
    commas, and of one pair of quotes wrapping the whole reply. May be "" if nothing else is
    left; the caller decides what an empty reply means.
    """
    if stats is not None:
        stats.fallbacks += 1
    body = _FENCE_RE.sub("", text[:MAX_TEXT_CHARS])
    m = _TEXT_FIELD_RE.search(body)
    if m:
        raw = m.group(2)
        unescaped = re.sub(r"\\(.)", lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), raw)
        return unescaped.strip()
    body = _VS_TAG_RE.sub("", _without_probabilities(body)).strip(_JUNK_EDGES)
    if len(body) >= 2 and body[0] == body[-1] and body[0] in "\"'":
        body = body[1:-1].strip()   # one reply wrapped in quotes
    return body
