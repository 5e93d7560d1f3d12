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
  - `parse_candidates`: a tolerant parser (small models break the format in many ways),
  - `draw`: weighted or uniform choice among candidates,
  - `pick` / `fallback` / `VSStats`: what the simulator layer calls each turn, and the
    counters it logs. The caller retries a failed `pick` a few times, then uses `fallback`.

Conventions the parser applies to a stated probability (see `parse_probability`):
  - 0 <= p <= 1                  -> p            (1 means 1.0, not 1 %)
  - 1 < p <= 100                 -> p / 100      (the model wrote a percentage: 30 -> 0.30)
  - "30%" / "30 %"               -> 0.30         (explicit percent, any value in [0, 100])
  - "0.3", " 0.3 (likely)"       -> 0.3          (first number in a string)
  - p > 100, negative, NaN, inf, bool, missing, unreadable -> None (no usable probability)
Negative values are treated as missing rather than as 0: a sign error says nothing about
how likely the reply is, while 0 is a statement the model made.

One file, though long: the prompt that asks for candidates, the lenient reader of the answers
(`_LenientJSON`, tags) and the draw from them are one format, tested together
(tests/test_verbalized.py; bench/fuzz_parsers.py fuzzes the reader).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from dataclasses import dataclass, field

TEXT_KEYS = ("text", "response", "reply", "content")                # first present wins
PROB_KEYS = ("probability", "prob", "p", "confidence")
LIST_KEYS = ("responses", "candidates", "replies", "options", "alternatives")
MAX_START_POSITIONS = 64    # opening brackets tried per text
MAX_DEPTH = 64              # nesting depth the lenient parser accepts
MAX_TEXT_CHARS = 32_000     # characters of a generation that are read (a k=5 answer is ~2 KB)
LENIENT_STEPS_PER_CHAR = 2  # work allowed to the lenient reader, over all start positions


@dataclass(frozen=True)
class Candidate:
    text: str
    probability: float | None   # None: the model gave no usable probability


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


# --------------------------------------------------------------------------- parsing
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?\s*%?")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_CONSTANTS = {"true": True, "false": False, "null": None, "none": None, "nan": None}


def parse_probability(value) -> float | None:
    """A stated probability as a float in [0, 1], or None (rules in the module docstring)."""
    if value is None or isinstance(value, bool):
        return None
    percent = False
    if isinstance(value, str):
        m = _NUMBER_RE.search(value)
        if m is None:
            return None
        token = m.group(0).replace(" ", "")
        percent = token.endswith("%")
        value = token.rstrip("%")
    if not isinstance(value, (int, float, str)):
        return None
    try:
        p = float(value)
    except (ValueError, OverflowError):   # OverflowError: a JSON integer too big for a float
        return None
    if not math.isfinite(p) or p < 0:
        return None
    if percent:
        return p / 100 if p <= 100 else None
    if p <= 1:
        return p
    return p / 100 if p <= 100 else None


class _ParseError(Exception):
    pass


class _TooDeep(_ParseError):
    """Nesting over MAX_DEPTH. Unlike other errors it depends on where the parse started,
    so it is not remembered (a start further in may read the same text fine)."""


class _OutOfSteps(_ParseError):
    """The lenient reader used up its steps (LENIENT_STEPS_PER_CHAR per character)."""


_STRING_STOPS = {'"': re.compile(r'["\\]'), "'": re.compile(r"['\\]")}   # closing quote or escape
_WHITESPACE = re.compile(r"\s*")


class _Truncated(dict):
    """An object the text ended inside of (e.g. generation hit its token cap)."""


class _LenientJSON:
    """Reads one JSON-like value starting at index i (`value(i)`), forgiving what small models get wrong.

    Accepts: single-quoted strings, unescaped quotes inside strings (a quote closes a string
    only when followed by , } ] : or the end), trailing commas, missing commas between items,
    bare keys, True/False/None/NaN, 30% as a number. If the text ends inside an object, the
    object is returned as `_Truncated` so the caller can drop the half-written candidate.

    The value read at a position (or the error met) is remembered: `parse_candidates` tries
    many start positions, and a start inside a value already read (e.g. the second of
    64 opening brackets) then costs nothing. A start inside a string read before (e.g. the
    "{" in '{"{"{"{"...') is read afresh, so the reader also counts its steps (values and
    string pieces) and gives up, for all later starts too, after LENIENT_STEPS_PER_CHAR
    steps per character of text: only such pathological texts get there, and the work stays
    linear in the text.
    """

    def __init__(self, text: str):
        self.s = text
        self.n = len(text)
        self._memo: dict[int, tuple] = {}     # position -> (value, end) or (_ParseError, message)
        self.steps_left = LENIENT_STEPS_PER_CHAR * self.n + 1000

    def _step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise _OutOfSteps("the lenient reader used up its steps")

    def _skip_ws(self, i: int) -> int:
        return _WHITESPACE.match(self.s, i).end()

    def value(self, i: int, depth: int = 0):
        known = self._memo.get(i)
        if known is not None:
            if known[0] is _ParseError:
                raise _ParseError(known[1])
            return known
        self._step()
        try:
            result = self._value(i, depth)
        except (_TooDeep, _OutOfSteps):
            raise
        except _ParseError as e:
            self._memo[i] = (_ParseError, str(e))
            raise
        self._memo[i] = result
        return result

    def _value(self, i: int, depth: int):
        if depth > MAX_DEPTH:
            raise _TooDeep("too deeply nested")
        i = self._skip_ws(i)
        if i >= self.n:
            raise _ParseError("no value")
        c = self.s[i]
        if c == "{":
            return self._object(i + 1, depth)
        if c == "[":
            return self._array(i + 1, depth)
        if c in "\"'":
            return self._string(i)
        m = _NUMBER_RE.match(self.s, i)
        if m:
            token = m.group(0)
            return (token if token.endswith("%") else float(token)), m.end()
        m = _WORD_RE.match(self.s, i)
        if m:
            word = m.group(0).lower()
            if word in _CONSTANTS:
                return _CONSTANTS[word], m.end()
        raise _ParseError(f"unexpected {c!r}")

    def _string(self, i: int):
        quote, i, out = self.s[i], i + 1, []
        escapes = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}
        stop = _STRING_STOPS[quote]
        while i < self.n:
            self._step()
            m = stop.search(self.s, i)           # jump over plain characters in one step
            j = m.start() if m else self.n
            out.append(self.s[i:j])
            i = j
            if i >= self.n:
                break
            c = self.s[i]
            if c == "\\" and i + 1 < self.n:
                nxt = self.s[i + 1]
                if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", self.s[i + 2:i + 6]):
                    out.append(chr(int(self.s[i + 2:i + 6], 16)))
                    i += 6
                    continue
                out.append(escapes.get(nxt, nxt))
                i += 2
                continue
            if c == quote:
                j = self._skip_ws(i + 1)
                if j >= self.n or self.s[j] in ",}]:":
                    return "".join(out), i + 1
            out.append(c)
            i += 1
        return "".join(out), self.n   # the text ended inside the string

    def _object(self, i: int, depth: int):
        obj: dict = {}
        while True:
            i = self._skip_ws(i)
            if i >= self.n:
                return _Truncated(obj), i
            c = self.s[i]
            if c == "}":
                return obj, i + 1
            if c == ",":
                i += 1
                continue
            if c in "\"'":
                key, i = self._string(i)
            else:
                m = _WORD_RE.match(self.s, i)
                if m is None:
                    raise _ParseError(f"bad key at {i}")
                key, i = m.group(0), m.end()
            i = self._skip_ws(i)
            if i >= self.n:
                return _Truncated(obj), i
            if self.s[i] != ":":
                raise _ParseError(f"expected ':' at {i}")
            i = self._skip_ws(i + 1)
            if i >= self.n:
                return _Truncated(obj), i
            val, i = self.value(i, depth + 1)
            if i >= self.n and not isinstance(val, (dict, list)):
                return _Truncated(obj), i   # a scalar the text ends in may be cut off: drop it
            obj[key] = val
            if i >= self.n:
                return _Truncated(obj), i   # the object itself was never closed

    def _array(self, i: int, depth: int):
        arr: list = []
        while True:
            i = self._skip_ws(i)
            if i >= self.n:
                return arr, i
            c = self.s[i]
            if c == "]":
                return arr, i + 1
            if c == ",":
                i += 1
                continue
            val, i = self.value(i, depth + 1)
            if i >= self.n and not isinstance(val, (dict, list)):
                return arr, i               # a scalar cut off by the end: drop it
            arr.append(val)


def _candidate_from_item(item) -> Candidate | None:
    if isinstance(item, str):
        return Candidate(item.strip(), None) if item.strip() else None
    if not isinstance(item, dict) or isinstance(item, _Truncated):
        return None
    lowered = {str(k).strip().lower(): v for k, v in item.items()}
    text = next((lowered[k] for k in TEXT_KEYS if isinstance(lowered.get(k), str)), None)
    if text is None or not text.strip():
        return None
    prob = next((lowered[k] for k in PROB_KEYS if k in lowered), None)
    return Candidate(text.strip(), parse_probability(prob))


def _candidates_from_value(value) -> list[Candidate]:
    items: list = []
    if isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        lowered = {str(k).strip().lower(): v for k, v in value.items()}
        lists = [lowered[k] for k in LIST_KEYS if isinstance(lowered.get(k), list)]
        if lists:
            items = lists[0]
        else:
            items = [value]   # a single candidate object
    cands = [_candidate_from_item(it) for it in items]
    return [c for c in cands if c is not None]


_TAGS = {name: (re.compile(f"<{name}>", re.IGNORECASE), re.compile(f"</{name}>", re.IGNORECASE))
         for name in ("response", "text", "probability")}


def _elements(text: str, name: str):
    """(start, end, content) of each <name>...</name> in `text`, the same ones the lazy regex
    `<name>(.*?)</name>` finds (case-insensitive), in linear time: each closing tag is
    searched for once, and when an opening tag has none after it, no later one has."""
    opening, closing = _TAGS[name]
    pos = 0
    while (m := opening.search(text, pos)) is not None:
        close = closing.search(text, m.end())
        if close is None:
            return
        yield m.start(), close.end(), text[m.end():close.start()]
        pos = close.end()


def _first_element(text: str, name: str) -> str | None:
    return next((content for _, _, content in _elements(text, name)), None)


def _candidates_from_tags(text: str) -> tuple[list[Candidate], int]:
    """Candidates in the tag format, and where the first <response> block starts."""
    cands, first = [], len(text)
    for start, _, block in _elements(text, "response"):
        t = _first_element(block, "text")
        if t is None or not t.strip():
            continue
        p = _first_element(block, "probability")
        cands.append(Candidate(t.strip(), parse_probability(p) if p is not None else None))
        first = min(first, start)
    return cands, first


_OPENING_RE = re.compile(r"[{\[]")


def parse_candidates(text: str) -> list[Candidate]:
    """Candidates from one simulator generation; [] when nothing is recoverable. Never raises
    on a string (a non-string is a caller bug: TypeError).

    Two formats are read, and the one that starts first in the text wins (so a JSON text that
    quotes tags, or a tag text that quotes JSON, is read as its outer format):
      - JSON: at each '{' or '[' from the left, strict JSON and, if that fails, the lenient
        reader (`_LenientJSON`); the first value that yields a candidate is used. That covers
        code fences and prose around the JSON, `{"responses": [...]}` or any of LIST_KEYS, a
        bare list of objects, a single object, and a list of plain strings.
      - tags: `<response><text>..</text><probability>..</probability></response>`, repeated.
    Text keys: TEXT_KEYS; probability keys: PROB_KEYS (case-insensitive); probabilities
    through `parse_probability`. Empty texts are dropped, and so is an object the text ends
    inside of (a truncated generation keeps its complete candidates).

    Only the first MAX_TEXT_CHARS characters are read (an answer cut there is a truncated
    generation as above), at most MAX_START_POSITIONS opening brackets are tried, and the
    lenient reader's work is bounded (see `_LenientJSON`), so the time is linear in the text
    and bounded for any text: under a second at worst (a wall of "[1,1,1,..."), under a
    millisecond for a real answer.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_candidates expects the generated text as str, got {type(text).__name__}")
    text = text[:MAX_TEXT_CHARS]
    tag_cands, tag_start = _candidates_from_tags(text) if "<response" in text.lower() else ([], len(text))
    strict = json.JSONDecoder()
    lenient = _LenientJSON(text)
    openings = _OPENING_RE.finditer(text, 0, tag_start)
    starts = [m.start() for m in itertools.islice(openings, MAX_START_POSITIONS)]
    for i in starts:
        for use_strict in (True, False):
            if not use_strict and lenient.steps_left < 0:
                continue
            try:
                value, _ = strict.raw_decode(text, i) if use_strict else lenient.value(i)
            except (ValueError, RecursionError, _ParseError):   # JSONDecodeError is a ValueError
                continue
            cands = _candidates_from_value(value)
            if cands:
                return cands
    return tag_cands


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
