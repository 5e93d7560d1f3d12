"""Chat templates for token streams: render each turn's NEW messages only.

A party's token stream (`stream.Stream`) must only ever grow by appending, because its
sampled tokens are trained on exactly as they were sampled. The obvious way to extend it,
re-rendering the whole conversation and taking the text after what the stream already
holds, breaks on real chat templates:

  - Qwen3 drops `<think>...</think>` from earlier assistant turns, and with
    `enable_thinking=False` puts an empty think block in the generation prompt but not in
    the history, so the re-rendered conversation no longer starts with the stream;
  - Llama 3.x Instruct writes "Cutting Knowledge Date" / "Today Date: <today>" into the
    system turn at render time (the date can change between two renders).

So the stream is the source of truth, and for each new turn only the text of the NEW
messages is rendered and appended:

    delta = render(stub + new messages, generation prompt), cut after the stub's last
            assistant message

The stub is a fixed, short conversation (system, user, assistant) whose last assistant
message is a marker string; everything the template writes after the marker is the end of
an assistant turn (e.g. `<|im_end|>\\n`, `<|eot_id|>`), the new messages, and the generation
prompt. The party's stream already holds the end-of-turn token it sampled, so that part is
not appended twice. The system turn (with Llama's dates) is rendered once, on the party's
first turn, and never again.

Whether this decomposition holds is a property of the template, checked once per
tokenizer (`ChatFormat.probe`): the text after the marker must not depend on the stub (two
different stubs give the same delta) and must contain the new messages. A template that
fails the probe falls back to re-rendering the whole conversation (a stream whose history
was rewritten restarts and is not trained on: `Stream.exact` is False), and the training
run stops with a message if too few streams stay exact.

A tokenizer without a chat template (a base model, e.g. Gemma 3 270M) is prompted as a plain
transcript (`plain_transcript`): the system text, a blank line, then one labelled line per
message ("Partner: ...", "You: ..."), ending with the speaker's label "You:". Each of its
turns stops at a newline (`ChatFormat.stop_ids`), so the next message's line follows it and
the same per-turn deltas hold.

Reasoning: a turn's text as the OTHER party sees it has its `<think>...</think>` removed
(`strip_reasoning`); the party that produced it keeps its own sampled tokens.
"""

from __future__ import annotations

import re
import weakref

STUB_MARK = "minscope-stub-marker-7f3a"
_STUBS = (
    [{"role": "system", "content": "stub system"}, {"role": "user", "content": "stub user"},
     {"role": "assistant", "content": STUB_MARK}],
    [{"role": "system", "content": "another stub system, longer"}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"},
     {"role": "assistant", "content": STUB_MARK}],
)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The turn text another party may see: reasoning blocks removed.

    `<think>...</think>` blocks go; an unclosed `<think>` (generation stopped while
    thinking) hides the rest; a lone `</think>` (templates whose generation prompt opens
    the block) hides what came before it."""
    if "<think>" not in text and "</think>" not in text:
        return text
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.lstrip()


def tools_in_system(messages: list[dict], tools) -> list[dict]:
    """`messages` with the tool signatures and the `<tool_call>` format (the Hermes/Qwen style
    that `toolcalls.parse_tool_calls` reads) appended to the system message (one is added
    first when there is none)."""
    import json

    block = ("# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
             + "".join("\n" + json.dumps(t) for t in tools)
             + "\n</tools>\n\nCall a function as <tool_call>\n{\"name\": <function-name>, "
             "\"arguments\": <args-json-object>}\n</tool_call>")
    messages = [dict(m) for m in messages]
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = messages[0]["content"] + "\n\n" + block
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


PLAIN_LABELS = {"user": "Partner", "assistant": "You", "tool": "Tool"}


def plain_transcript(messages: list[dict], bos: str | None = None, generation_prompt: bool = True) -> str:
    """`messages` as a plain transcript, for a tokenizer without a chat template: `bos` (the
    tokenizer's begin-of-sequence text, if any), the system text and a blank line, then one
    line per message, "Label: content" (PLAIN_LABELS), and the speaker's "You:" to continue."""
    text = bos or ""
    for m in messages:
        if m["role"] == "system":
            text += m["content"] + "\n\n"
            continue
        content = m["content"]
        text += PLAIN_LABELS.get(m["role"], m["role"].capitalize()) + ":" + ("" if content[:1].isspace() else " ")
        text += content + "\n"
    return text + (PLAIN_LABELS["assistant"] + ":" if generation_prompt else "")


class TemplateError(ValueError):
    """The chat template cannot be decomposed into per-turn deltas."""


class ChatFormat:
    """One tokenizer's chat template, rendered for token streams (see module docstring).

    thinking: False passes `enable_thinking=False` (Qwen3: no reasoning; other templates
    ignore the flag), True lets a thinking template think.
    """

    def __init__(self, tokenizer, thinking: bool = False):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.kwargs = {"enable_thinking": bool(thinking)}
        self._probed: str | None = None          # None: not probed yet; "" ok; else the reason
        self.plain = not getattr(tokenizer, "chat_template", None)    # no template: a plain transcript

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], tools=None, generation_prompt: bool = True) -> str:
        if tools and not self.renders_tools:     # e.g. SmolLM2's template: list them in the system turn
            messages, tools = tools_in_system(messages, tools), None
        if self.plain:
            return plain_transcript(messages, self.tokenizer.bos_token, generation_prompt)
        kwargs = dict(self.kwargs, **({"tools": tools} if tools else {}))
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **kwargs)

    @property
    def renders_tools(self) -> bool:
        """Whether the template writes the `tools` it is given (cached). Some (SmolLM2's)
        silently drop them; `render` then lists the tools in the system message itself."""
        if self.plain:
            return False
        if not hasattr(self, "_renders_tools"):
            probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
            tool = {"type": "function", "function": {"name": "minscope_probe_tool", "parameters": {}}}
            try:
                text = self.tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, **self.kwargs)
                self._renders_tools = "minscope_probe_tool" in text
            except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

    def after_marker(self, new: list[dict], tools=None, stub: list[dict] | None = None) -> str:
        """What the template writes after an assistant turn when `new` follows it: the
        turn's closing text, the new messages and the generation prompt."""
        full = self.render((stub or _STUBS[0]) + list(new), tools)
        at = full.rfind(STUB_MARK)
        if at < 0:
            raise TemplateError("the chat template did not render the stub's assistant message")
        return full[at + len(STUB_MARK):]

    @property
    def stop_ids(self) -> set[int]:
        """Token ids that end a turn besides the tokenizer's end-of-sequence: for a plain
        transcript, the tokens that are only newlines (a line is a turn); none otherwise."""
        if not self.plain:
            return set()
        if not hasattr(self, "_stop_ids"):
            found = [self.tokenizer("\n" * n, add_special_tokens=False)["input_ids"] for n in range(1, 9)]
            self._stop_ids = {ids[0] for ids in found if len(ids) == 1}
        return self._stop_ids

    # ------------------------------------------------------------------ the probe
    def probe(self) -> str:
        """'' when per-turn deltas are valid for this template, else why not (cached)."""
        if self._probed is None:
            self._probed = self._check()
        return self._probed

    @property
    def incremental(self) -> bool:
        return self.probe() == ""

    def _check(self) -> str:
        cases = [[{"role": "user", "content": "probe reply one"}],
                 [{"role": "user", "content": "probe reply two"}, {"role": "user", "content": "and three"}]]
        try:
            for new in cases:
                deltas = [self.after_marker(new, stub=stub) for stub in _STUBS]
                if deltas[0] != deltas[1]:
                    return ("the text the template writes for a new message depends on the earlier "
                            f"conversation ({deltas[0]!r} vs {deltas[1]!r})")
                at = 0
                for m in new:
                    at = deltas[0].find(m["content"], at)
                    if at < 0:
                        return f"the template did not render the new message {m['content']!r} after the stub"
                    at += len(m["content"])
        except Exception as e:  # noqa: BLE001 - a template that cannot render the stub
            return f"the template cannot render the probe conversation ({type(e).__name__}: {e})"
        return ""

    # ------------------------------------------------------------------ deltas
    def delta(self, new: list[dict], tools=None, sampled_end: str = "") -> str:
        """The text to append to a stream whose last turn was sampled by its party and
        ended with `sampled_end` (the end-of-turn token's text, '' if generation stopped
        at the length cap), when the messages `new` follow."""
        after = self.after_marker(new, tools)
        if sampled_end and after.startswith(sampled_end):
            after = after[len(sampled_end):]
        return after


_FORMATS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def chat_format(tokenizer, thinking: bool = False) -> ChatFormat:
    """The ChatFormat of `tokenizer` (one per tokenizer, template and thinking mode, so the
    probe runs once)."""
    per_tok = _FORMATS.setdefault(tokenizer, {})
    key = (bool(thinking), tokenizer.chat_template)
    if key not in per_tok:
        per_tok[key] = ChatFormat(tokenizer, thinking)
    return per_tok[key]
