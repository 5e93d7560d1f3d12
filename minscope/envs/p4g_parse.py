"""Reading a P4G conversation: the donation a persuadee states, and whether a persuader asks.

The persuader's reward under `reward="parsed"` is read from the persuadee's own words:
`parse_donation` reads one text (a `[DONATE $N]` tag first, plain language second; the last
amount stated counts, clamped to [0, MAX_DONATION]), and `episode_donation` reads a whole
episode, leaving out what only echoes the persuader or the persuadee's instructions.
`is_donation_ask` tells whether a persuader message asks for money (a metric). The rules, and
what each one keeps out, are listed below; the environment that pays this reward is p4g.py.
"""

from __future__ import annotations

import bisect
import re

from minscope.envs.base import Episode

MAX_DONATION = 2.0         # dollars: the persuadee's whole payment, the most it can give

# ------------------------------------------------------------------- donation parsing
#
# Order of evidence: a tag `[DONATE $N]` / `[GIVE $N]` anywhere in the text wins; without
# one, a plain-language reading of the text's statements. In both cases the last amount
# stated counts, and it is clamped to [0, 2]. The plain-language reading keeps it simple:
#   - questions are skipped ("Would $1 be enough?" states nothing), where a question is a
#     sentence ending in "?" that opens with an auxiliary or wh-word ("I'll give $1, is
#     that ok?" still states $1);
#   - an amount counts only in a sentence with an intent-to-give word (donate, give,
#     contribute, pledge, spare, "I'll do", "go with", ...) — past tense ("I donated $20
#     last year") is not intent;
#   - an amount right after "of"/"out of"/"from" is the base ("$1 of my $2"), not a gift;
#   - an amount that is the object of a negated giving verb ("I can't give $2"), of "keep"
#     ("I'll keep my full $2") or of a past gift ("I donated $20 last year, but ...", "I've
#     given $5 before") is not a gift; a negated giving verb is a refusal, i.e. $0 ("I won't
#     donate", "I won't donate $2"), unless its object is partial ("I can't give more",
#     "... all of it": no amount stated) or a later amount follows ("I can't give $2, but
#     I'll give $1" is $1); "I'd rather keep it" is a refusal too;
#   - "0.50 cents" means fifty cents (nobody pledges part of a cent);
#   - what is not the persuadee's own statement is not read: an amount inside double quotes
#     ("He said \"donate $2\""), a giving verb addressed to or done by someone else
#     ("tells them to donate $2", "you give $2"), an imperative ("Donate $2 to Save the
#     Children"); a tag needs its closing bracket right after the amount ("[Donate $2 to
#     Save the Children]" is not a tag). Tags follow the same rules (`own_tags`): one in
#     quotes, or in a clause that negates ("I will not write [DONATE $2]") or reports an
#     instruction ("he told me to type [DONATE $2]"), is not read, as a tag or otherwise;
#   - an amount with a minus sign ("-$2", "$-2") is not a gift; only ASCII digits are
#     digits, as in the readout ("[DONATE $\uff12]" states nothing);
#   - over a whole episode (`episode_donation`) a persuadee sentence that repeats the
#     persuader's messages or its own instructions (`is_echo`: word for word at any length,
#     or a close third-person paraphrase) is dropped before reading, tags included, and so
#     is a tag whose amount the persuader wrote in a tag (`strip_copied_tags`).
#
# Any text parses without an exception in time linear in its length: a number never starts
# inside a run of digits and its digits are matched possessively (no backtracking into
# them), the tag's whitespace is possessive too, and the checks of each amount against the
# others, the negations and the "of my" look-back touch only the text near the amount.
# Tags are read in the whole text; plain language only in its last MAX_PLAIN_CHARS
# characters (from the first sentence that starts there), since the last statement counts:
# a persuadee's messages in one conversation are ~3 KB at most in the human data.
MAX_PLAIN_CHARS = 10_000

# Only ASCII digits are read, as the readout reads only the digit tokens "0".."9"
# (minscope/readout.py): "[DONATE $\uff12]" (fullwidth) or "$\u0662" (Arabic-Indic) states nothing to
# either. A number does not start right after a digit of any script.
_NUM = r"(?<!\d)([0-9]++(?:\.[0-9]++)?+|\.[0-9]++)"
_TAG = re.compile(r"\[\s*+(?:donate|give)\s*+:?\s*+\$?\s*+" + _NUM + r"(\s*+cents?)?\s*+\]", re.I)
_SMALL = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
          "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15,
          "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
          "seventy": 70, "eighty": 80, "ninety": 90}
_WORDNUM = (r"((?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)"
            r"(?:[\s-]+(?:one|two|three|four|five|six|seven|eight|nine))?"
            r"|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|fifteen)")
_WHOLE_PAYMENT = (r"(?:\$\s*2(?:\.00?)?|2\s*dollars|two\s+dollars"
                  r"|amount|payment|bonus|reward|pay|money|earnings|thing)")


def _cents(number: str) -> float:
    """Dollars in "<number> cents"; "0.50 cents" / ".25 cents" mean 50 / 25 cents."""
    return float(number) if "." in number and float(number) < 1 else float(number) / 100


# Non-ASCII letters that re.IGNORECASE matches to ASCII ones (the complete list): a number
# word may be spelled with them ("ſix"), and must still be found in _SMALL.
_CASE_FOLDS = {"\u017f": "s", "\u0130": "i", "\u0131": "i", "\u212a": "k"}


def _word_number(words: str) -> float:
    """"twenty five" / "twenty-five" / "ten" -> 25 / 25 / 10."""
    ascii_words = "".join(_CASE_FOLDS.get(c, c) for c in words).lower()
    return float(sum(_SMALL[w] for w in re.split(r"[\s-]+", ascii_words)))


def _rx(*parts: str) -> re.Pattern:
    return re.compile("".join(parts), re.I)


# (pattern, value from match) in priority order; an earlier pattern's span blocks later ones.
_AMOUNTS = [
    # "the whole $2", "my entire payment", "all of it", "all my bonus", "give it all"
    (_rx(r"\b(?:the|my|it|that|this)\s+(?:whole|entire|full)\s+", _WHOLE_PAYMENT, r"\b"), lambda m: 2.0),
    (_rx(r"\ball\s+(?:of\s+)?(?:it\b|(?:my|the)\s+", _WHOLE_PAYMENT, r"\b)"), lambda m: 2.0),
    (_rx(r"\b(?:donate|give|contribute)\s+(?:it\s+)?(?:all|everything)\b",
         r"(?!\s+(?:the\s+)?(?:children|kids|of\s+them))"), lambda m: 2.0),
    (_rx(r"\bhalf\s+(?:of\s+)?(?:it|my|the|that)\b"), lambda m: 1.0),
    # words: "a dollar", "half a dollar", "ten dollars", "twenty-five cents", "one penny"
    (_rx(r"\b(half\s+a|a|", _WORDNUM, r")\s+(?:dollars?|bucks?)\b"),
     lambda m: {"half a": 0.5, "a": 1.0}.get(re.sub(r"\s+", " ", m[1].lower())) or _word_number(m[1])),
    (_rx(r"\b", _WORDNUM, r"\s+(?:cents?|penny|pennies)\b"), lambda m: _word_number(m[1]) / 100),
    # digits: "$1.50", "1$", "2 dollars", "50 cents", "50c", and a bare "donate 0.5"
    (_rx(r"\$\s*", _NUM), lambda m: float(m[1])),
    (_rx(_NUM, r"\s*\$"), lambda m: float(m[1])),
    (_rx(_NUM, r"\s*(?:dollars?|bucks?|usd)\b"), lambda m: float(m[1])),
    (_rx(_NUM, r"(?:\s*(?:cents?|penny|pennies)\b|\s*¢|c\b)"), lambda m: _cents(m[1])),
    (_rx(r"\b(?:donate|donating|give|giving|contribute|contributing|pledge)\s+",
         r"(?:just\s+|only\s+|about\s+|around\s+)?", _NUM,
         r"(?!\s*(?:%|percent|cents?\b|penny\b|pennies\b|dollars?\b|bucks?\b|¢|\$|\d))"),
     lambda m: float(m[1])),
]
_INTENT = _rx(r"\b(?:donate|donating|donation|give|giving|contribute|contributing|contribution",
              r"|pledge|spare|chip\s+in|put\s+in|part\s+with|go\s+with",
              r"|(?:i'?ll|i\s+will|i\s+can|i\s+could|i'?d|let'?s|lets)\s+do)\b")
_BASE_REF = _rx(r"\b(?:out\s+of|of|from)\s+(?:my|the|your|our|this|that)?\s*$")
_NEGATED_GIVING = _rx(
    r"\b(?:not|never|won'?t|wont|can'?t|cant|cannot|don'?t|dont|wouldn'?t|unable)\s+",
    r"(?:(?:really|think|want|wanna|plan|intend|to|be|i|i'?ll|will|feel|like|able|going|gonna",
    r"|comfortable|afford|actually|willing|interested|in|make|making|a|any|do|am|would|need)\s+){0,4}",
    r"(?:donate|donating|donation|give|giving|contribute|contributing)\b")
# After a negated giving verb these words make the refusal partial ("can't give more"): no
# amount is stated. A negated amount ("I won't donate $2", "can't give a dollar") is a
# refusal of it and reads 0 unless a later amount follows ("..., but I'll give $1").
_PARTIAL = _rx(r"\s*(?:(?:any\s*)?more\b|much\b|that\s+much|a\s+lot|all\b",
               r"|the\s+(?:whole|full|entire)|everything|as\s+much|half)")
# A gift in the past ("I donated $20 last year", "I've given to them before") states
# nothing about this one: amounts that are its object are not read.
_PAST_GIVING = _rx(r"(?<!would\s)(?<!will\s)(?<!could\s)(?<!can\s)(?<!to\s)",   # "I would donated .50": a typo, not the past
                   r"\b(?:donated|gave|contributed",
                   r"|(?:have|has|had|i'?ve|we'?ve)\s+(?:already\s+|also\s+|just\s+)?(?:donated|given|contributed)",
                   r"|used\s+to\s+(?:donate|give|contribute))\b")
# Giving by someone else: the object of "you/they/them ... give" is not the persuadee's gift.
_OTHER_GIVER = _rx(r"(?<!thank\s)\b(?:you|they|he|she|them|him|her|people|everyone|others|someone)\s+",
                   r"(?:[a-z']+\s+){0,3}?(?:donate|donating|give|giving|contribute|contributing)\b")
# An imperative: a sentence that opens with the giving verb tells someone else to give.
_IMPERATIVE = _rx(r"^\W*(?:(?:please|so|ok|okay|just|now|then|and|go|yes)\W+)*",
                  r"(?:donate|give|contribute|pledge)\b")
_QUOTED = re.compile(r'"[^"\n]*+"|\u201c[^\u201d\n]*+\u201d')
_REFUSAL = _rx(r"\b(?:no\s+donation|(?:donate|give)\s+(?:nothing|zero)|nothing\s+to\s+(?:donate|give)",
               r"|keep\s+(?:all\b|it\b|my\b|the\s+(?:whole|full|entire|money|\$?2))",
               r"|i'?ll\s+pass\b|i\s+will\s+pass\b",
               r"|pass\s+on\s+(?:donating|the\s+donation|this|that|it)\b)")
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
# A tag is read by the rules of plain language: not inside quotes (reported speech), not in a
# clause that negates ("I will not write [DONATE $2]") or reports an instruction ("he told me
# to type [DONATE $2]"). The clause is what precedes the tag since the last sentence end,
# comma, semicolon, "but", "and" or "so".
_TAG_CLAUSE_START = re.compile(r"[.!?,;\n]|\b(?:but|and|so)\b", re.I)
_TAG_NEGATED = _rx(r"(?<!why\s)\b(?:not|never|won'?t|wont|can'?t|cant|cannot|don'?t|dont|doesn'?t|didn'?t",
                   r"|wouldn'?t|shouldn'?t|refuse|refusing)\b")
_TAG_REPORTED = _rx(r"\b(?:told|tells|tell|asked|asks|ask|wants|wanted|want|instructed|begged|urged)\s+(?:me|us)\s+to\b",
                    r"|\b(?:said|says)\s+to\b")
_MINUS = re.compile(r"(?<![\w$])[-\u2212]$")    # right before an amount: "-$2", "$-2" (not "$1-2", "- $2")
_QUESTION = _rx(r"^\W*(?:(?:so|ok|okay|well|and|but|oh|then|hmm)\W+)*",
                r"(?:would|could|can|should|shall|will|do|does|did|is|are|was|were|may|might",
                r"|how|what|why|where|when|which|who|if)\b")


def _clamp(x: float) -> float:
    return min(max(x, 0.0), MAX_DONATION)


_BASE_LOOK_BACK = 40      # characters before an amount searched for "of my" (bounds the work)
_OBJECT_REACH = 30        # an amount this close after a negation/"keep" is its object
_CLAUSE_BREAK = re.compile(r"[,;]|\b(?:but|and)\b")


def _is_base(sentence: str, pos: int) -> bool:
    """Whether "of"/"out of"/"from" (+ "my", "the", ...) comes right before the amount at
    `pos`. Only the _BASE_LOOK_BACK characters before it are searched, and only when they
    hold "of" or "from" at all (a cheap test first: most amounts have neither)."""
    start = max(0, pos - _BASE_LOOK_BACK)
    near = sentence[start:pos].lower()
    return ("of" in near or "from" in near) and _BASE_REF.search(sentence, start, pos) is not None


def _is_object_of(sentence: str, pos: int, blockers: list, ends: list[int]) -> bool:
    """Whether the amount at `pos` is the object of one of `blockers` (matches of one
    pattern, so disjoint and in order; `ends` their end positions): it starts at most
    _OBJECT_REACH characters after the blocker, with no clause break in between. Only the
    few blockers that end near `pos` are looked at."""
    i = bisect.bisect_left(ends, pos - _OBJECT_REACH)
    while i < len(blockers) and blockers[i].start() <= pos:
        if not _CLAUSE_BREAK.search(sentence[blockers[i].end():pos]):
            return True
        i += 1
    return False


def _statement_events(sentence: str) -> list[tuple[int, float]]:
    """(position, amount) of every gift or refusal stated in one sentence."""
    events = []
    negations = list(_NEGATED_GIVING.finditer(sentence))
    for neg in negations:
        if not _PARTIAL.match(sentence, neg.end()):
            events.append((neg.start(), 0.0))
    refusals = list(_REFUSAL.finditer(sentence))
    events += [(m.start(), 0.0) for m in refusals]
    if _INTENT.search(sentence):
        past = list(_PAST_GIVING.finditer(sentence))
        others = list(_OTHER_GIVER.finditer(sentence)) + list(_IMPERATIVE.finditer(sentence))
        others.sort(key=lambda m: m.start())
        blockers = [(b, [m.end() for m in b]) for b in (negations, refusals, past, others)]
        taken = bytearray(len(sentence))    # 1 where an earlier pattern already read an amount
        for pattern, value in _AMOUNTS:
            for m in pattern.finditer(sentence):
                start, end = m.span()
                if 1 in taken[start:end]:
                    continue
                taken[start:end] = b"\x01" * (end - start)
                if _MINUS.search(sentence, max(0, start - 2), start):
                    continue          # "-$2": a minus sign, not a gift
                if _is_base(sentence, start):
                    continue          # "$1 of my $2": the $2 is the base, not a gift
                if any(_is_object_of(sentence, start, b, ends) for b, ends in blockers):
                    continue          # "I can't give $2", "keep my full $2", "I gave $5", "Donate $2":
                                      # not this persuadee's gift
                events.append((start, value(m)))
    return sorted(events)


def _last_sentences(text: str) -> str:
    """The sentences that start in the last MAX_PLAIN_CHARS characters of `text` (all of
    it when shorter; the cut-off tail itself when no sentence starts there)."""
    if len(text) <= MAX_PLAIN_CHARS:
        return text
    tail = text[-MAX_PLAIN_CHARS:]
    boundary = _SENTENCE.search(tail)
    return tail[boundary.end():] if boundary else tail


def tag_value(m: re.Match) -> float:
    """The dollars a `_TAG` match states (not clamped)."""
    return _cents(m[1]) if m[2] else float(m[1])


def own_tags(text: str) -> tuple[list[float], str]:
    """(the amounts of the tags in `text` that are the speaker's own statement, in order;
    `text` with every tag read or not cut out). A tag inside double quotes, or in a clause
    that negates or reports an instruction (_TAG_NEGATED, _TAG_REPORTED), is not the
    speaker's own, and is not read as plain language either."""
    quoted = [m.span() for m in _QUOTED.finditer(text)]     # disjoint, in order
    starts = [a for a, _ in quoted]
    kept, pieces, at = [], [], 0
    for tag in _TAG.finditer(text):
        start = tag.start()
        pieces.append(text[at:start] + " ")
        at = tag.end()
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start < quoted[i][1]:
            continue
        before = text[max(0, start - 80):start]
        clause = before[max((m.end() for m in _TAG_CLAUSE_START.finditer(before)), default=0):]
        if _TAG_NEGATED.search(clause) or _TAG_REPORTED.search(clause):
            continue
        kept.append(tag_value(tag))
    return kept, "".join(pieces) + text[at:]


def parse_donation(text: str) -> float | None:
    """The donation a message (or several joined by newlines) states, in dollars, clamped
    to [0, 2]; None when it states none. Tags first, plain language second (in the last
    MAX_PLAIN_CHARS characters); the last amount stated counts. Refusals ("I won't
    donate") read as 0. Never raises; time linear in the text."""
    text = text.replace("\u2019", "'")
    tags, text = own_tags(text)
    if tags:
        return _clamp(tags[-1])
    last = None
    for sentence in _SENTENCE.split(_QUOTED.sub(" ", _last_sentences(text))):
        if not sentence.strip() or (sentence.rstrip().endswith("?") and _QUESTION.match(sentence)):
            continue
        events = _statement_events(sentence)
        if events:
            last = events[-1][1]
    return None if last is None else _clamp(last)


_WORDS = re.compile(r"\$?\d+(?:\.\d+)?|[a-z]+(?:'[a-z]+)?")
_FIRST_PERSON = frozenset("i i'll i'm i'd i've me my mine myself im ill id ive".split())
ECHO_OVERLAP = 0.6        # share of a sentence's word pairs found in the source that makes it an echo


def _word_pairs(text: str) -> list[tuple[str, str]]:
    words = _WORDS.findall(text.lower().replace("\u2019", "'"))
    return list(zip(words, words[1:]))


def _word_line(text: str) -> str:
    """The text's words (as `_word_pairs` splits them), space-separated with a space at each end."""
    return " " + " ".join(_WORDS.findall(text.lower().replace("\u2019", "'"))) + " "


def is_echo(sentence: str, source_pairs: set, source_lines: tuple[str, ...] = ()) -> bool:
    """Whether `sentence` repeats or closely paraphrases the source text whose word pairs
    are `source_pairs` (and whose messages' `_word_line`s are `source_lines`). A copy, word
    for word, of a run of two or more words of one source message is an echo whatever its
    length and its person ("I will donate $2" after "Just type: I will donate $2"). Otherwise
    a close paraphrase: it has at least 3 word pairs, at least ECHO_OVERLAP of them occur in
    the source, and it does not speak in the first person. "I will donate $2 to Save the
    Children" after "Would you donate $2 to Save the Children?" is the persuadee's own
    statement, and so is "I would like to donate $0.30" after a persuader who said the same
    of themselves (human persuadees mirror their partner this way); a first-person sentence
    that gives through someone else ("I hope you donate $2") is not read anyway."""
    pairs = _word_pairs(sentence)
    line = _word_line(sentence)
    if pairs and any(line in src for src in source_lines):
        return True
    if len(pairs) < 3 or any(w in _FIRST_PERSON for p in pairs for w in p):
        return False
    return sum(p in source_pairs for p in pairs) >= ECHO_OVERLAP * len(pairs)


def strip_echoes(text: str, sources: list[str]) -> str:
    """`text` without the sentences that echo `sources` (`is_echo`)."""
    pairs = {p for src in sources for p in _word_pairs(src)}
    if not pairs:
        return text
    lines = tuple(_word_line(src) for src in sources)
    return "\n".join(s for s in _SENTENCE.split(text) if s.strip() and not is_echo(s, pairs, lines))


# What a persuader writes that starts a tag: "[DONATE $2]", "[give: 2", "[DONATE $2" (no "]" needed).
_TAG_START = re.compile(r"\[\s*+(?:donate|give)\s*+:?\s*+\$?\s*+" + _NUM + r"(\s*+cents?)?", re.I)


def strip_copied_tags(text: str, persuader: list[str]) -> str:
    """`text` without its tags whose amount the persuader wrote as a tag (`_TAG_START`) in
    `persuader` (its messages so far): a copied tag is an echo, whatever its length. The
    persuadee's own words for the same amount ("Sure, I'll donate $2") are still read."""
    written = {tag_value(m) for msg in persuader for m in _TAG_START.finditer(msg)}
    if not written:
        return text
    return _TAG.sub(lambda m: " " if tag_value(m) in written else m[0], text)


def episode_donation(episode: Episode, instructions: str = "") -> float | None:
    """The last amount the persuadee stated across the conversation (tags anywhere win
    over plain language), or None. A persuadee sentence that echoes what the persuader said
    before it, or the persuadee's own `instructions` (its system prompt), is not read, nor a
    tag whose amount the persuader wrote in a tag (`strip_copied_tags`; the instructions'
    example tags are the format, not a copy)."""
    said, heard = [], [instructions]
    for turn in episode.turns:
        if turn.role == "agent":
            heard.append(turn.text)
        elif turn.role == "partner":
            said.append(strip_echoes(strip_copied_tags(turn.text, heard[1:]), heard))
    return parse_donation("\n".join(said))


# A persuader message asks for money when one sentence has both a request phrase and a
# money/donation word. Simple and transparent; it counts messages, not sentences.
_REQUEST = _rx(r"\b(?:would|could|will|can|won'?t)\s+you\b|\bare\s+you\s+(?:willing|able|interested|open)\b",
               r"|\bhow\s+much\b|\bplease\b|\bconsider\b|\bwhy\s+not\b|\bwhat\s+about\b|\bhow\s+about\b")
_MONEY = _rx(r"donat|\bgive\b|\bgiving\b|contribut|pledge|\$|\bdollars?\b|\bcents?\b")


def is_donation_ask(text: str) -> bool:
    return any(_REQUEST.search(s) and _MONEY.search(s) for s in _SENTENCE.split(text))
