"""Reading a Verbalized Sampling answer: `parse_candidates` turns one simulator generation
into the candidate replies it states with their probabilities (`Candidate`), forgiving the
many ways small models break the format: prose and code fences around the JSON, single
quotes, missing commas, a generation cut off halfway (the lenient reader `_LenientJSON`),
the tag format, stated percentages. `verbalized.py` asks for the answer and draws from it.

Conventions the parser applies to a stated probability (see `parse_probability`):
  - 0 <= p <= 1                  -> p            (1 means 1.0, not 1 %)
  - 1 < p <= 100                 -> p / 100      (the model wrote a percentage: 30 -> 0.30)
  - "30%" / "30 %"               -> 0.30         (explicit percent, any value in [0, 100])
  - "0.3", " 0.3 (likely)"       -> 0.3          (first number in a string)
  - p > 100, negative, NaN, inf, bool, missing, unreadable -> None (no usable probability)
Negative values are treated as missing rather than as 0: a sign error says nothing about
how likely the reply is, while 0 is a statement the model made.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass

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
