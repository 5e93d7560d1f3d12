"""Tool calls inside generated text: parse them tolerantly, and write them in canonical form.

Qwen3 / Hermes-style chat templates teach a model to call a tool by writing

    <tool_call>
    {"name": "get_user_details", "arguments": {"user_id": "sara_doe_496"}}
    </tool_call>

anywhere in its reply (several blocks are allowed). Small models and early RL policies
break this format in every possible way, and a broken call must never crash a rollout: it
becomes a `ToolCallError` whose `message` is sent back to the model as the tool result, so
it can try again (and so the policy learns that malformed calls cost a turn).

What is tolerated, because models really write it:
  - a missing `</tool_call>` at the end of the text (generation stopped or was truncated),
  - Markdown code fences inside the block, text after the JSON object,
  - `arguments` given as a JSON string (OpenAI wire format) or named `parameters`,
  - an OpenAI-style wrapper `{"type": "function", "function": {...}}`,
  - a JSON list of calls inside one block,
  - Python-literal dicts (single quotes, True/False/None).
What is not guessed: a block whose content is not a JSON object with a string `name`.
Text outside blocks is the message part of the turn (`ParsedTurn.content`).

Any text parses without an exception and in time linear in its length: a number longer
than Python's int limit (4,300 digits) is an invalid call, and a Python literal is only
evaluated when the block is at most MAX_LITERAL_CHARS long (evaluating one costs about
500 bytes of memory per character; longer blocks must be JSON). At most MAX_CALLS calls
are read per turn; any beyond are dropped, with one error saying so.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass, field

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MAX_LITERAL_CHARS = 20_000   # longest block read as a Python literal (a real call is < 1 KB)
MAX_CALLS = 32               # calls read per turn; more become one error (a real turn has 1-3)
FORMAT_HINT = ('Write each call as <tool_call>{"name": "<tool name>", '
               '"arguments": {<JSON object>}}</tool_call>.')


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolCallError:
    raw: str        # the block's content as written
    message: str    # what was wrong, worded for the model that wrote it


@dataclass
class ParsedTurn:
    content: str                                   # text outside the tool-call blocks
    calls: list = field(default_factory=list)      # ToolCall | ToolCallError, in order

    @property
    def valid_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if isinstance(c, ToolCall)]


def format_tool_call(name: str, arguments: dict) -> str:
    """The canonical block, as Qwen3's chat template writes a call."""
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


def has_tool_call(text: str) -> bool:
    return OPEN_TAG in text


def parse_tool_calls(text: str) -> ParsedTurn:
    """Split `text` into its message part and its tool calls (never raises)."""
    outside, blocks = [], []
    pos = 0
    close = text.find(CLOSE_TAG)     # the next close tag; searched again only once passed,
    while True:                      # so that many open tags without one stay linear
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        if 0 <= close < body_start:
            close = text.find(CLOSE_TAG, body_start)
        end = close
        # A new <tool_call> before any </tool_call> means the close tag was forgotten.
        next_open = text.find(OPEN_TAG, body_start)
        if end < 0 or (0 <= next_open < end):
            end = next_open if next_open >= 0 else len(text)
            blocks.append(text[body_start:end])
            pos = end
        else:
            blocks.append(text[body_start:end])
            pos = end + len(CLOSE_TAG)
    content = "".join(outside).replace(CLOSE_TAG, "").strip()   # stray close tags
    calls = []
    for block in blocks:
        if len(calls) > MAX_CALLS:
            break
        calls.extend(_parse_block(block))
    if len(calls) > MAX_CALLS:
        calls = calls[:MAX_CALLS] + [ToolCallError(
            "", f"Error: more than {MAX_CALLS} tool calls in one turn; only the first {MAX_CALLS} "
                "were read. Make fewer calls per turn.")]
    return ParsedTurn(content=content, calls=calls)


def _parse_block(block: str) -> list:
    raw = block.strip()
    body = _strip_code_fence(raw)
    if not body:
        return [ToolCallError(raw, f"Error: empty tool call. {FORMAT_HINT}")]
    value, problem = _decode(body)
    if problem:
        return [ToolCallError(raw, f"Error: tool call is not valid JSON ({problem}). {FORMAT_HINT}")]
    items = value if isinstance(value, list) else [value]
    if not items:
        return [ToolCallError(raw, f"Error: empty tool call list. {FORMAT_HINT}")]
    return [_to_call(item, raw) for item in items]


def _strip_code_fence(body: str) -> str:
    match = re.match(r"^```[a-zA-Z]*\s*(.*?)\s*(```)?$", body, flags=re.DOTALL)
    return match.group(1).strip() if match else body


def _decode(body: str):
    """JSON first; then the first JSON value in the text (ignores trailing junk);
    then a Python literal. Returns (value, None) or (None, reason)."""
    try:
        return json.loads(body), None
    except ValueError as e:              # JSONDecodeError, or a number over the int digit limit
        reason = _json_problem(e)
    except RecursionError:               # thousands of nested brackets: a degenerate output
        return None, "nested too deeply"
    first = min((i for i in (body.find("{"), body.find("[")) if i >= 0), default=-1)
    if first >= 0:
        try:
            value, _ = json.JSONDecoder().raw_decode(body, first)
            return value, None
        except (ValueError, RecursionError):
            pass
    if len(body) > MAX_LITERAL_CHARS:
        return None, f"{reason}; the call is too long to read as a Python literal"
    value = _python_literal(body)
    return (value, None) if isinstance(value, (dict, list)) else (None, reason)


def _json_problem(error: ValueError) -> str:
    """What json.loads disliked, worded for the model."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at position {error.pos}"
    return "a number has too many digits"


def _python_literal(body: str):
    """The Python literal `body` spells, as plain JSON values (tuples become lists), or None.
    Sets, bytes, complex numbers and anything else JSON cannot hold give None, so the
    arguments an environment receives are always JSON."""
    try:
        with warnings.catch_warnings():      # e.g. SyntaxWarning for "1x": not worth a line on stderr
            warnings.simplefilter("ignore")
            value = ast.literal_eval(body)
        return json.loads(json.dumps(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _to_call(item, raw: str):
    if not isinstance(item, dict):
        return ToolCallError(raw, f"Error: a tool call must be a JSON object. {FORMAT_HINT}")
    if isinstance(item.get("function"), dict):          # OpenAI-style wrapper
        item = item["function"]
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(raw, f'Error: tool call has no "name". {FORMAT_HINT}')
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):                           # OpenAI wire format: a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:            # JSONDecodeError, or a number over the digit limit
            return ToolCallError(raw, f'Error: "arguments" of {name} is not valid JSON '
                                      f"({_json_problem(e)}). {FORMAT_HINT}")
        except RecursionError:
            return ToolCallError(raw, f'Error: "arguments" of {name} are nested too deeply. {FORMAT_HINT}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(raw, f'Error: "arguments" of {name} must be a JSON object. '
                                  f"{FORMAT_HINT}")
    return ToolCall(name=name.strip(), arguments=args)
