"""Verbalized Sampling: instruction, canonical format, tolerant parser, draws, per-turn counters."""

import json
import math
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minscope.verbalized import (
    VS_INSTRUCTION,
    VSStats,
    distribution_entropy,
    draw,
    fallback,
    format_candidates,
    pick,
    vs_instruction,
)
from minscope.verbalized_parse import MAX_TEXT_CHARS, Candidate, parse_candidates, parse_probability

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def texts(cands):
    return [c.text for c in cands]


def probs(cands):
    return [c.probability for c in cands]


# --------------------------------------------------------------------------- instruction
def test_instruction_asks_for_k_replies_in_the_responses_json_shape():
    block = vs_instruction(3)
    assert "3 different" in block and "3 entries" in block
    assert '{"responses": [{"text": ' in block and '"probability": ' in block
    assert "JSON only" in block


def test_default_instruction_asks_for_five():
    assert VS_INSTRUCTION == vs_instruction(5)
    assert "5 different" in VS_INSTRUCTION


@pytest.mark.parametrize("k", [0, -1, 2.5])
def test_instruction_rejects_non_positive_k(k):
    with pytest.raises(ValueError, match="k >= 1"):
        vs_instruction(k)


# --------------------------------------------------------------------------- format
def test_format_is_compact_json_with_two_decimal_probabilities():
    out = format_candidates([Candidate("Hi there", 0.333), Candidate("No", None)])
    assert " " not in out.replace("Hi there", "")   # compact separators
    assert json.loads(out) == {"responses": [{"text": "Hi there", "probability": 0.33},
                                             {"text": "No", "probability": None}]}


def test_format_keeps_non_ascii_characters():
    assert "Grüße, 你好" in format_candidates([Candidate("Grüße, 你好", 0.5)])


def test_format_rejects_empty_text_and_out_of_range_probability():
    with pytest.raises(ValueError, match="empty text"):
        format_candidates([Candidate("  ", 0.5)])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        format_candidates([Candidate("a", 1.5)])


candidate_strategy = st.builds(
    Candidate,
    text=st.text(min_size=1, max_size=40).filter(lambda t: t.strip()),
    probability=st.none() | st.floats(min_value=0.0, max_value=1.0),
)


@FAST
@given(st.lists(candidate_strategy, min_size=1, max_size=6))
def test_parse_inverts_format(cands):
    expected = [Candidate(c.text.strip(), None if c.probability is None else round(c.probability, 2))
                for c in cands]
    assert parse_candidates(format_candidates(cands)) == expected


def test_round_trip_survives_text_that_looks_like_tags_or_json():
    cands = [Candidate('<response><text>x</text></response>', 0.5), Candidate('{"text": "y"}', 0.5)]
    assert texts(parse_candidates(format_candidates(cands))) == texts(cands)


# --------------------------------------------------------------------------- parser: never raises
def assert_well_formed(cands):
    assert isinstance(cands, list)
    for c in cands:
        assert isinstance(c, Candidate) and c.text.strip() == c.text and c.text
        assert c.probability is None or 0.0 <= c.probability <= 1.0


@FAST
@given(st.text(max_size=300))
def test_parse_never_raises_on_arbitrary_text(text):
    assert_well_formed(parse_candidates(text))


@FAST
@given(st.text(alphabet='{}[]"\':,.0123456789%-eE ntrulfasNoe<>/\\\n', max_size=200))
def test_parse_never_raises_on_json_like_noise(text):
    assert_well_formed(parse_candidates(text))


@FAST
@given(st.lists(candidate_strategy, min_size=1, max_size=4), st.data())
def test_parse_never_raises_on_mutated_json(cands, data):
    text = format_candidates(cands)
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, len(text)))
        kind = data.draw(st.sampled_from(["delete", "insert", "truncate", "replace"]))
        junk = data.draw(st.text(alphabet='{}[]"\':,%-. \nxé', min_size=1, max_size=3))
        if kind == "delete":
            text = text[:i] + text[i + 3:]
        elif kind == "insert":
            text = text[:i] + junk + text[i:]
        elif kind == "truncate":
            text = text[:i]
        else:
            text = text[:i] + junk + text[i + len(junk):]
    assert_well_formed(parse_candidates(text))


def test_parse_survives_deep_nesting():
    assert parse_candidates("[" * 5000) == []
    assert parse_candidates('{"a":' * 3000 + "1" + "}" * 3000) == []


def seconds(fn, text):
    start = time.perf_counter()
    fn(text)
    return time.perf_counter() - start


@pytest.mark.parametrize("text", [
    "[" * 64 + '"' + "a" * 1_000_000,      # every opening bracket used to re-read the string
    "[" * 64 + "1," * 30_000,              # ... or the list of numbers
    "<response>" * 10_000,                 # every tag searched to the end for its closing tag
    "<response>" + "<text>" * 10_000 + "</response>",
    '{"responses": [' + '{"text": "x", "probability": 0.1}, ' * 30_000,
], ids=["string", "numbers", "response-tags", "text-tags", "long-list"])
def test_parse_time_is_linear_on_hostile_text(text):
    assert seconds(parse_candidates, text) < 1.0


@pytest.mark.parametrize("text", ["<probability>" * 10_000, '"text": "' + "\\a" * 200_000],
                         ids=["probability-tags", "escapes"])
def test_fallback_time_is_linear_on_hostile_text(text):
    assert seconds(fallback, text) < 1.0


def test_only_the_start_of_a_very_long_generation_is_read():
    answer = format_candidates([Candidate("a", 0.5), Candidate("b", 0.5)])
    assert texts(parse_candidates(answer + " " * MAX_TEXT_CHARS)) == ["a", "b"]
    assert parse_candidates(" " * MAX_TEXT_CHARS + answer) == []


def test_a_truncated_nested_answer_is_still_found_inside_an_outer_bracket():
    # the outer list fails as a whole; the object inside it is found from its own start
    assert texts(parse_candidates('[[note] {"responses": [{"text": "a"}, {"text": "b"}]}')) == ["a", "b"]
    assert texts(parse_candidates('[[[{"text": "a", "p": 1}, {"text": "b"')) == ["a"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(['{', '[', '"', "'", ":", ",", "}", "]", "1", "text", "<response>",
                                 "<text>", "</text>", "<probability>", "\\", " ", "a"]),
                min_size=1, max_size=6))
def test_long_repeated_text_parses_fast(pieces):
    unit = "".join(pieces)
    text = unit * (100_000 // len(unit) + 1)        # about 100 KB
    start = time.perf_counter()
    assert_well_formed(parse_candidates(text))
    assert isinstance(fallback(text), str)
    assert time.perf_counter() - start < 2.0


def test_parse_survives_integer_too_large_for_a_float():
    cands = parse_candidates('[{"text": "a", "probability": ' + "9" * 400 + "}]")
    assert cands == [Candidate("a", None)]


def test_parse_rejects_non_string_input():
    with pytest.raises(TypeError, match="str"):
        parse_candidates(None)


# --------------------------------------------------------------------------- parser: tolerance
def test_parses_plain_json():
    text = '{"responses": [{"text": "Maybe later.", "probability": 0.6}, {"text": "Sure!", "probability": 0.4}]}'
    assert parse_candidates(text) == [Candidate("Maybe later.", 0.6), Candidate("Sure!", 0.4)]


@pytest.mark.parametrize("fence", ["```", "```json", "``` JSON"])
def test_parses_json_in_code_fence(fence):
    text = f'{fence}\n{{"responses": [{{"text": "ok", "probability": 0.5}}]}}\n```'
    assert parse_candidates(text) == [Candidate("ok", 0.5)]


def test_parses_json_with_prose_before_and_after():
    text = ('Here are {some} options [as asked]:\n{"responses": [{"text": "No thanks.", '
            '"probability": 0.7}]}\nLet me know if you need more.')
    assert parse_candidates(text) == [Candidate("No thanks.", 0.7)]


def test_parses_trailing_commas():
    text = '{"responses": [{"text": "a", "probability": 0.5,}, {"text": "b", "probability": 0.5,},],}'
    assert texts(parse_candidates(text)) == ["a", "b"]


def test_parses_single_quotes_with_apostrophes_inside():
    text = "{'responses': [{'text': 'I can't afford it', 'probability': 0.8}]}"
    assert parse_candidates(text) == [Candidate("I can't afford it", 0.8)]


def test_parses_bare_keys_and_python_constants():
    text = "{responses: [{text: 'a', probability: None}, {text: 'b', probability: .5}]}"
    assert parse_candidates(text) == [Candidate("a", None), Candidate("b", 0.5)]


@pytest.mark.parametrize("stated, expected", [
    (0.3, 0.3), ("0.3", 0.3), ("30%", 0.3), ("30 %", 0.3), (30, 0.3), (1, 1.0), (0, 0.0),
    (100, 1.0), ("about 0.25", 0.25), ("1%", 0.01),
])
def test_probability_forms_are_read_as_a_fraction(stated, expected):
    assert parse_probability(stated) == pytest.approx(expected)


@pytest.mark.parametrize("stated", [None, 150, "250%", -0.2, "-5", "likely", float("nan"),
                                    float("inf"), True, [0.3]])
def test_unusable_probabilities_are_none(stated):
    assert parse_probability(stated) is None


def test_probabilities_in_json_as_string_percent_and_percent_number():
    text = ('[{"text": "a", "probability": "0.3"}, {"text": "b", "probability": "30%"}, '
            '{"text": "c", "probability": 30}, {"text": "d", "probability": 30%}]')
    assert probs(parse_candidates(text)) == pytest.approx([0.3, 0.3, 0.3, 0.3])


def test_missing_probability_is_none():
    assert parse_candidates('{"responses": [{"text": "a"}]}') == [Candidate("a", None)]


def test_negative_probability_is_none():
    assert parse_candidates('{"responses": [{"text": "a", "probability": -0.4}]}') == [Candidate("a", None)]


def test_parses_bare_list_without_responses_key():
    text = '[{"text": "a", "probability": 0.2}, {"text": "b", "probability": 0.8}]'
    assert parse_candidates(text) == [Candidate("a", 0.2), Candidate("b", 0.8)]


def test_parses_single_candidate_object():
    assert parse_candidates('{"text": "only one", "probability": 1}') == [Candidate("only one", 1.0)]


@pytest.mark.parametrize("key", ["response", "reply", "content", "Text"])
def test_alternative_text_keys(key):
    assert parse_candidates(f'{{"responses": [{{"{key}": "hello", "probability": 0.5}}]}}') == \
        [Candidate("hello", 0.5)]


@pytest.mark.parametrize("key", ["prob", "p", "confidence", "Probability"])
def test_alternative_probability_keys(key):
    assert parse_candidates(f'[{{"text": "hello", "{key}": 0.25}}]') == [Candidate("hello", 0.25)]


def test_other_list_keys_hold_candidates():
    assert texts(parse_candidates('{"candidates": [{"text": "x", "p": 0.1}]}')) == ["x"]


def test_parses_list_of_plain_strings():
    assert parse_candidates('{"responses": ["yes", "no"]}') == [Candidate("yes", None), Candidate("no", None)]


def test_parses_repeated_tag_format():
    text = ("Sure.\n<response><text>I'm in.</text><probability>0.7</probability></response>\n"
            "<response>\n  <text>Not today.</text>\n  <probability>30%</probability>\n</response>\n"
            "<response><text>Hmm</text></response>")
    assert parse_candidates(text) == [Candidate("I'm in.", 0.7), Candidate("Not today.", 0.3),
                                      Candidate("Hmm", None)]


def test_tag_text_that_quotes_json_is_read_as_tags():
    text = '<response><text>I typed ["ok"] there</text><probability>0.5</probability></response>'
    assert parse_candidates(text) == [Candidate('I typed ["ok"] there', 0.5)]


def test_empty_text_candidates_are_dropped():
    text = '[{"text": "", "probability": 0.5}, {"text": "   ", "p": 0.1}, {"text": "kept", "p": 0.4}, {"p": 0.1}]'
    assert parse_candidates(text) == [Candidate("kept", 0.4)]


def test_text_is_stripped_of_surrounding_whitespace():
    assert texts(parse_candidates('[{"text": "  hi \\n", "p": 1}]')) == ["hi"]


@pytest.mark.parametrize("text", ["", "Just a normal reply.", "{}", '{"responses": []}', "[1, 2, 3]",
                                  '{"responses": [{"probability": 0.5}]}', "<response></response>"])
def test_returns_empty_list_when_nothing_is_recoverable(text):
    assert parse_candidates(text) == []


def test_truncated_generation_keeps_only_complete_candidates():
    full = '{"responses": [{"text": "a", "probability": 0.5}, {"text": "b and more", "probability": 0.5}]}'
    cut_inside_second = full[: full.index("and more")]
    assert parse_candidates(cut_inside_second) == [Candidate("a", 0.5)]
    cut_before_closing = full[: full.index("0.5}]}", full.index("b and"))] + "0.5"
    assert parse_candidates(cut_before_closing) == [Candidate("a", 0.5)]


# --------------------------------------------------------------------------- draw
def chi_square(counts, dist, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, dist) if p > 0)


CHI2_CRIT_DF2_P001 = 13.82   # chi-square critical value, 2 degrees of freedom, p = 0.001


def test_weighted_draw_renormalises_stated_probabilities():
    _, dist = draw([Candidate("a", 0.5), Candidate("b", 0.2), Candidate("c", 0.1)], random.Random(0))
    assert dist == pytest.approx([0.625, 0.25, 0.125])


def test_weighted_draw_frequencies_match_the_distribution():
    cands = [Candidate("a", 0.5), Candidate("b", 0.2), Candidate("c", 0.1)]
    rng, n, counts = random.Random(1234), 20000, [0, 0, 0]
    for _ in range(n):
        i, dist = draw(cands, rng)
        counts[i] += 1
    assert chi_square(counts, dist, n) < CHI2_CRIT_DF2_P001
    # the same counts are far from uniform, so the test can tell the two modes apart
    assert chi_square(counts, [1 / 3] * 3, n) > 100 * CHI2_CRIT_DF2_P001


def test_uniform_draw_ignores_stated_probabilities():
    cands = [Candidate("a", 0.9), Candidate("b", 0.05), Candidate("c", None)]
    rng, n, counts = random.Random(99), 9000, [0, 0, 0]
    for _ in range(n):
        i, dist = draw(cands, rng, mode="uniform")
        assert dist == [1 / 3] * 3
        counts[i] += 1
    assert chi_square(counts, dist, n) < CHI2_CRIT_DF2_P001


def test_missing_probability_gets_the_mean_of_stated_ones():
    _, dist = draw([Candidate("a", 0.6), Candidate("b", 0.2), Candidate("c", None)], random.Random(0))
    assert dist == pytest.approx([0.6 / 1.2, 0.2 / 1.2, 0.4 / 1.2])


@pytest.mark.parametrize("stated", [[None, None], [0.0, 0.0], [-1.0, None], [float("nan"), 0.0]])
def test_weighted_draw_is_uniform_without_usable_positive_probabilities(stated):
    _, dist = draw([Candidate(str(i), p) for i, p in enumerate(stated)], random.Random(0))
    assert dist == [0.5, 0.5]


def test_zero_probability_candidate_is_never_drawn():
    cands = [Candidate("never", 0.0), Candidate("always", 0.3)]
    rng = random.Random(7)
    assert {draw(cands, rng)[0] for _ in range(500)} == {1}


def test_draw_is_reproducible_with_the_same_seed():
    cands = [Candidate(str(i), p) for i, p in enumerate([0.1, 0.4, 0.2, 0.3])]
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert [draw(cands, rng_a)[0] for _ in range(50)] == [draw(cands, rng_b)[0] for _ in range(50)]


def test_draw_rejects_empty_candidates_and_unknown_mode():
    with pytest.raises(ValueError, match="at least one candidate"):
        draw([], random.Random(0))
    with pytest.raises(ValueError, match="weighted"):
        draw([Candidate("a", 1.0)], random.Random(0), mode="greedy")


# --------------------------------------------------------------------------- entropy
def test_entropy_of_uniform_is_log_k():
    assert distribution_entropy([0.25] * 4) == pytest.approx(math.log(4))


def test_entropy_of_a_point_mass_is_zero():
    assert distribution_entropy([1.0, 0.0, 0.0]) == 0.0


def test_entropy_of_half_quarter_quarter():
    # -(.5 ln .5 + 2 * .25 ln .25) = .5 ln 2 + ln 2 = 1.5 ln 2
    assert distribution_entropy([0.5, 0.25, 0.25]) == pytest.approx(1.5 * math.log(2))


def test_entropy_rejects_negative_probabilities():
    with pytest.raises(ValueError, match="negative"):
        distribution_entropy([1.2, -0.2])


# --------------------------------------------------------------------------- pick / fallback / stats
GOOD = '{"responses": [{"text": "Yes.", "probability": 0.5}, {"text": "No.", "probability": 0.5}]}'


def test_pick_returns_a_drawn_reply_and_counts_the_request():
    stats = VSStats()
    reply, cands, dist = pick(GOOD, random.Random(0), "weighted", stats)
    assert reply in ("Yes.", "No.") and texts(cands) == ["Yes.", "No."] and dist == [0.5, 0.5]
    assert (stats.requests, stats.retries, stats.parse_failures) == (1, 0, 0)
    assert stats.entropies == [pytest.approx(math.log(2))] and stats.n_candidates == [2]


def test_pick_returns_none_and_counts_a_parse_failure():
    stats = VSStats()
    assert pick("I refuse to answer in JSON.", random.Random(0), "weighted", stats) == (None, [], [])
    assert (stats.requests, stats.parse_failures, stats.entropies) == (1, 1, [])


def test_pick_counts_later_attempts_as_retries():
    stats = VSStats()
    pick("bad", random.Random(0), "weighted", stats, attempt=0)
    pick(GOOD, random.Random(0), "weighted", stats, attempt=1)
    assert (stats.requests, stats.retries, stats.parse_failures, stats.fallbacks) == (1, 1, 1, 0)


def test_retries_then_fallback_are_all_counted():
    stats, rng = VSStats(), random.Random(0)
    for attempt in range(3):
        reply, _, _ = pick("not json", rng, "uniform", stats, attempt=attempt)
        assert reply is None
    assert fallback("not json", stats) == "not json"
    assert stats.as_dict() == {
        "requests": 1, "retries": 2, "parse_failures": 3, "fallbacks": 1, "draws": 0,
        "parse_failure_rate": 1.0, "fallback_rate": 1.0, "mean_entropy": None, "mean_candidates": None,
    }


def test_stats_as_dict_is_json_serialisable_and_averages_draws():
    stats, rng = VSStats(), random.Random(0)
    pick(GOOD, rng, "weighted", stats)
    pick('[{"text": "only", "p": 1}]', rng, "weighted", stats)
    d = stats.as_dict()
    json.dumps(d)
    assert d["draws"] == 2 and d["mean_candidates"] == 1.5
    assert d["mean_entropy"] == pytest.approx(math.log(2) / 2)
    assert d["parse_failure_rate"] == 0.0


def test_stats_merge_adds_counts_and_reset_clears_them():
    a, b = VSStats(requests=2, parse_failures=1, entropies=[0.5]), VSStats(requests=3, fallbacks=1, entropies=[1.5])
    assert a.merge(b) is a
    assert (a.requests, a.parse_failures, a.fallbacks, a.mean_entropy) == (5, 1, 1, 1.0)
    a.reset()
    assert a == VSStats()


def test_fallback_extracts_the_text_field_of_cut_off_json():
    raw = '```json\n{"responses": [{"text": "Well, I\'d say \\"maybe\\"\\nlater'
    assert fallback(raw) == 'Well, I\'d say "maybe"\nlater'


def test_fallback_removes_fences_tags_and_wrapping_quotes():
    assert fallback("```\nI'll think about it.\n```") == "I'll think about it."
    assert fallback("<response><text>Fine.</text><probability>0.9</probability>") == "Fine."
    assert fallback('  "Just this."  ') == "Just this."


def test_fallback_keeps_plain_replies_unchanged():
    assert fallback('She said "no" and left.') == 'She said "no" and left.'
