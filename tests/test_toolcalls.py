"""Tolerant parsing of Qwen3/Hermes-style <tool_call> blocks (minscope.toolcalls)."""

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minscope.toolcalls import (MAX_CALLS, MAX_LITERAL_CHARS, ParsedTurn, ToolCall, ToolCallError,
                                format_tool_call, has_tool_call, parse_tool_calls)


def only_call(text) -> ToolCall:
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) == 1
    assert isinstance(parsed.calls[0], ToolCall), parsed.calls[0]
    return parsed.calls[0]


def only_entry(text):
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) == 1
    return parsed.calls[0]


def test_canonical_block_gives_name_and_arguments():
    call = only_call('<tool_call>\n{"name": "get_user", "arguments": {"user_id": "u1"}}\n</tool_call>')
    assert call == ToolCall("get_user", {"user_id": "u1"})


def test_text_outside_blocks_is_the_message_content():
    parsed = parse_tool_calls('Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nOne moment.')
    assert parsed.content == "Let me check.\n\nOne moment."


def test_plain_text_has_no_calls():
    parsed = parse_tool_calls("Your order has been cancelled.")
    assert parsed == ParsedTurn("Your order has been cancelled.", [])
    assert not has_tool_call("Your order has been cancelled.")


def test_several_blocks_are_returned_in_order():
    text = format_tool_call("a", {"x": 1}) + "\n" + format_tool_call("b", {"y": 2})
    assert [c.name for c in parse_tool_calls(text).calls] == ["a", "b"]


def test_missing_close_tag_at_the_end_is_tolerated():
    call = only_call('<tool_call>\n{"name": "f", "arguments": {"k": "v"}}')
    assert call == ToolCall("f", {"k": "v"})


def test_missing_close_tag_before_the_next_block_is_tolerated():
    text = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c.name for c in parse_tool_calls(text).calls] == ["a", "b"]


def test_code_fence_inside_the_block_is_ignored():
    call = only_call('<tool_call>\n```json\n{"name": "f", "arguments": {"n": 3}}\n```\n</tool_call>')
    assert call == ToolCall("f", {"n": 3})
    # a Python literal in a fence: only the fence's removal lets it parse
    call = only_call("<tool_call>\n```python\n{'name': 'f', 'arguments': {'n': 3}}\n```\n</tool_call>")
    assert call == ToolCall("f", {"n": 3})


def test_stray_close_tags_are_dropped_from_the_text():
    parsed = parse_tool_calls("Sure.</tool_call> Anything else?")
    assert parsed.calls == [] and parsed.content == "Sure. Anything else?"


def test_text_after_the_json_object_is_ignored():
    call = only_call('<tool_call>{"name": "f", "arguments": {"n": 3}} I hope this works</tool_call>')
    assert call == ToolCall("f", {"n": 3})


def test_arguments_given_as_a_json_string_are_decoded():
    call = only_call('<tool_call>{"name": "f", "arguments": "{\\"n\\": 3}"}</tool_call>')
    assert call.arguments == {"n": 3}


def test_parameters_is_accepted_for_arguments():
    assert only_call('<tool_call>{"name": "f", "parameters": {"n": 3}}</tool_call>').arguments == {"n": 3}


def test_openai_function_wrapper_is_unwrapped():
    call = only_call('<tool_call>{"type": "function", "function": {"name": "f", "arguments": {"n": 3}}}</tool_call>')
    assert call == ToolCall("f", {"n": 3})


def test_missing_arguments_mean_no_arguments():
    assert only_call('<tool_call>{"name": "list_all_airports"}</tool_call>').arguments == {}


def test_a_json_list_in_one_block_gives_several_calls():
    parsed = parse_tool_calls('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>')
    assert [c.name for c in parsed.calls] == ["a", "b"]


def test_python_literal_dict_is_accepted():
    call = only_call("<tool_call>{'name': 'f', 'arguments': {'ok': True, 'x': None}}</tool_call>")
    assert call == ToolCall("f", {"ok": True, "x": None})


def test_invalid_json_becomes_an_error_that_shows_the_format():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"n": </tool_call>')
    [error] = parsed.calls
    assert isinstance(error, ToolCallError)
    assert error.message.startswith("Error:") and "<tool_call>" in error.message
    assert error.raw == '{"name": "f", "arguments": {"n":'


def test_missing_name_is_an_error():
    [error] = parse_tool_calls('<tool_call>{"arguments": {"n": 1}}</tool_call>').calls
    assert isinstance(error, ToolCallError) and '"name"' in error.message


def test_non_object_arguments_are_an_error():
    [error] = parse_tool_calls('<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>').calls
    assert isinstance(error, ToolCallError) and "arguments" in error.message


def test_empty_block_is_an_error():
    [error] = parse_tool_calls("<tool_call>\n</tool_call>").calls
    assert isinstance(error, ToolCallError)


def test_valid_calls_skips_errors():
    text = format_tool_call("a", {}) + "<tool_call>oops</tool_call>"
    parsed = parse_tool_calls(text)
    assert len(parsed.calls) == 2 and [c.name for c in parsed.valid_calls] == ["a"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(name=st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
       arguments=st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_format_then_parse_round_trips(name, arguments):
    assert only_call(format_tool_call(name, arguments)) == ToolCall(name, json.loads(json.dumps(arguments)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"f"',
                                 ",", '"arguments"', "[", "]", "```", "x", " ", "\n"]), max_size=30))
def test_parsing_never_raises(pieces):
    parsed = parse_tool_calls("".join(pieces))
    assert all(isinstance(c, (ToolCall, ToolCallError)) for c in parsed.calls)


@pytest.mark.parametrize("body", [
    "[" * 20_000,
    '{"a": ' * 20_000,
    '{"name": "f", "arguments": "' + "[" * 20_000 + '"}',
])
def test_deeply_nested_output_is_an_error_not_a_crash(body):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(parsed.calls) == 1 and isinstance(parsed.calls[0], ToolCallError)


# ------------------------------------------------------------------ hostile and huge outputs

def test_a_number_over_pythons_digit_limit_is_an_error_not_a_crash():
    # Python refuses to turn more than 4,300 digits into an int (a ValueError, not a
    # JSONDecodeError), in the block and in "arguments" given as a JSON string
    assert isinstance(only_entry("<tool_call>" + "1" * 5000), ToolCallError)
    block = json.dumps({"name": "f", "arguments": '{"n": ' + "7" * 5000 + "}"})
    assert isinstance(only_entry(f"<tool_call>{block}</tool_call>"), ToolCallError)


def test_python_literal_arguments_are_plain_json_values():
    # a tuple or a set is not a JSON value: tuples become lists, a set is an error
    assert only_call("<tool_call>{'name': 'f', 'arguments': {'ids': (1, 2)}}</tool_call>") == \
        ToolCall("f", {"ids": [1, 2]})
    assert isinstance(only_entry("<tool_call>{'name': 'f', 'arguments': {'ids': {1, 2}}}</tool_call>"),
                      ToolCallError)


def test_a_python_literal_longer_than_the_cap_is_not_evaluated():
    call = "{'name': 'f', 'arguments': {}}, "
    short = "<tool_call>[" + call * 3 + "]</tool_call>"
    assert [c.name for c in parse_tool_calls(short).calls] == ["f"] * 3
    long = "<tool_call>[" + call * (MAX_LITERAL_CHARS // len(call) + 1) + "]</tool_call>"
    (error,) = parse_tool_calls(long).calls
    assert isinstance(error, ToolCallError) and "too long" in error.message


def test_more_calls_than_the_cap_in_one_turn_end_in_one_error():
    many_blocks = format_tool_call("f", {}) * (MAX_CALLS + 8)
    one_list = "<tool_call>[" + ", ".join(['{"name": "f", "arguments": {}}'] * 100) + "]</tool_call>"
    for text in (many_blocks, one_list):
        calls = parse_tool_calls(text).calls
        assert len(calls) == MAX_CALLS + 1 and all(isinstance(c, ToolCall) for c in calls[:-1])
        assert isinstance(calls[-1], ToolCallError) and f"first {MAX_CALLS}" in calls[-1].message


def seconds(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


@pytest.mark.parametrize("text", [
    "<tool_call>" * 40_000,                          # no close tag: each block used to rescan the text
    "<tool_call>" + "[" * 100_000,
    '<tool_call>{"name": "' + "a" * 400_000,
], ids=["open-tags", "brackets", "string"])
def test_long_hostile_outputs_parse_in_linear_time(text):
    assert seconds(parse_tool_calls, text) < 1.0


def assert_well_formed(parsed, text):
    assert isinstance(parsed, ParsedTurn) and isinstance(parsed.content, str)
    blocks = text.count("<tool_call>")
    assert min(blocks, MAX_CALLS) <= len(parsed.calls) <= MAX_CALLS + 1   # an entry per block, capped
    for call in parsed.calls:
        if isinstance(call, ToolCall):
            assert isinstance(call.name, str) and call.name == call.name.strip() and call.name
            assert isinstance(call.arguments, dict)
            json.dumps(call.arguments)                      # plain JSON the environment can take
        else:
            assert isinstance(call, ToolCallError) and call.message.startswith("Error:")


PIECES = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"f"', ",", '"arguments"', "[", "]",
          "```", "'", "(", ")", "True", "None", "1" * 60, "x", " ", "\n", "\\", "\u017f", "\x00"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=40))
def test_any_output_parses_to_well_formed_calls(pieces):
    text = "".join(pieces)
    assert_well_formed(parse_tool_calls(text), text)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=6))
def test_long_repeated_output_parses_fast_and_well_formed(pieces):
    unit = "".join(pieces)
    text = unit * (100_000 // len(unit) + 1)        # about 100 KB
    start = time.perf_counter()
    parsed = parse_tool_calls(text)
    assert time.perf_counter() - start < 2.0
    assert_well_formed(parsed, text)
