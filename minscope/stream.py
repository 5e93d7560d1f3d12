"""What one party sees of a conversation, and the exact token stream it keeps of it.

Each party sees the conversation through its own chat template with the roles flipped
(`view_messages`): its own turns are "assistant", the other party's are "user", environment
turns (tool results) are "tool" for the party they are addressed to (`Turn.to`, the agent by
default) and hidden from the other.

Each party keeps, per episode, a token *stream* (`Stream`): exactly the ids it was fed and the
ids it sampled. The stream is extended by tokenizing only the new chat-template text between
turns, so the tokens a party is later trained on are exactly the ones it sampled — generated
text is never re-tokenized. The text <-> ids calls that build it (`template_text`, `text_ids`,
`ids_text`) are memoised.

    Episode ──► streams["agent"]   = ids, mask (1 on the agent's sampled tokens), logp
            └─► streams["partner"] = ids, mask (1 on the partner's sampled tokens), logp

On generated tokens the two masks are complementary: every sampled token belongs to exactly
one party's stream with mask 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .envs.base import Episode


# --------------------------------------------------------------------------- views
def view_messages(env, episode: Episode, role: str) -> list[dict]:
    """The conversation as `role` sees it, as chat messages (its own turns = assistant)."""
    lead = env.agent_messages(episode.task) if role == "agent" else env.partner_messages(episode.task)
    messages = list(lead)
    for turn in episode.turns:
        if turn.role == role:
            messages.append({"role": "assistant", "content": turn.text})
        elif turn.role == "env":
            if (turn.to or "agent") == role:    # tool results go to the party addressed (the agent by default)
                messages.append({"role": "tool", "content": turn.text})
        elif turn.public:
            messages.append({"role": "user", "content": turn.text})
    return messages


@dataclass
class Stream:
    """What one party was fed and sampled in one episode (see module docstring).

    While `exact` is True, `ids` only ever grows by appending: each turn appends the
    chat-template text of the messages that are new to this party (`chat.ChatFormat.delta`)
    and then the tokens it sampled. If the conversation this party sees was rewritten (the
    messages already in the stream are no longer a prefix of its view, e.g. Verbalized
    Sampling shows the drawn reply instead of what was sampled), or the template cannot be
    rendered turn by turn, the stream restarts from the full prompt and `exact` becomes
    False: such a stream is never trained on.
    """
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)      # 1 = sampled by this party
    logp: list[float] = field(default_factory=list)    # sampling log-prob (0 where mask 0)
    text: str = ""                                      # the text that `ids` spell
    exact: bool = True                                  # False once the history was rewritten
    messages: list = field(default_factory=list)        # the view's messages already in `ids`
    sampled_end: str = ""                               # end-of-turn text the last sampled turn ended with

    def extend_prompt(self, chat, messages: list[dict], tools=None):
        """Append the template text of the messages in `messages` (this party's whole view)
        that the stream does not hold yet, and the generation prompt. `chat` is the party's
        `chat.ChatFormat`."""
        n = len(self.messages)
        new = messages[n:]
        if not self.ids:                                 # the first turn: the whole prompt
            delta = template_text(chat, messages, tools)
        elif (messages[:n] == self.messages and chat.incremental
              and all(m["role"] != "assistant" for m in new)):
            delta = template_text(chat, new, tools, self.sampled_end)
        else:
            # The history was rewritten, or the template cannot be rendered turn by turn:
            # restart from the full prompt (not used for training: `exact` is False).
            self.ids, self.mask, self.logp, self.text, self.exact = [], [], [], "", False
            delta = template_text(chat, messages, tools)
        ids = text_ids(chat, delta) if delta else []
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.text += delta
        self.messages = [dict(m) for m in messages]
        self.sampled_end = ""

    def extend_forced(self, ids: list[int], text: str):
        """Append ids this party did not sample (the start of an answer it is made to give)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.text += text

    def extend_sampled(self, ids: list[int], logp: list[float], text: str, shown: str | None = None,
                       end: str = ""):
        """Append a sampled turn. `shown`: the turn's text as it enters the conversation
        (what this party's view will hold as its own message); `end`: the text of the
        end-of-turn token the turn ended with ('' when it stopped at the length cap)."""
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logp += logp
        self.text += text
        if shown is not None:
            self.messages.append({"role": "assistant", "content": shown})
        self.sampled_end = end


# ------------------------------------------------------------- memoised text <-> ids
# Rendering a chat template (jinja) and calling a tokenizer cost about a millisecond each, per
# episode and turn; the toy's conversations repeat the same few texts, so most of them are
# the same call again. These are pure functions of their inputs, memoised per chat format
# (bounded; short inputs only; not for templates that read the clock), so the text and ids
# are exactly what the direct calls give.
MEMO_ENTRIES, MEMO_KEY_CHARS = 4096, 4000


def _memo(chat, kind: str, key, compute):
    memo = chat.__dict__.setdefault("_rollout_memo", {})
    key = (kind, len(chat.tokenizer), key)      # (a tokenizer that gained tokens starts afresh)
    if key in memo:
        return memo[key]
    value = compute()
    if len(memo) >= MEMO_ENTRIES:
        memo.clear()
    memo[key] = value
    return value


def template_text(chat, messages: list[dict], tools=None, sampled_end: str | None = None) -> str:
    """chat.render(messages, tools), or chat.delta(messages, tools, sampled_end) when given."""
    def compute():
        return chat.render(messages, tools) if sampled_end is None else chat.delta(messages, tools, sampled_end)
    if "strftime" in (getattr(chat.tokenizer, "chat_template", None) or ""):
        return compute()
    try:
        key = json.dumps([messages, tools, sampled_end])      # keeps the order of keys: it is rendered
    except (TypeError, ValueError):
        return compute()
    return compute() if len(key) > MEMO_KEY_CHARS else _memo(chat, "text", key, compute)


def text_ids(chat, text: str) -> list[int]:
    """chat.tokenizer(text, add_special_tokens=False)["input_ids"] (a fresh list)."""
    def compute():
        return chat.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(text) > MEMO_KEY_CHARS:
        return compute()
    return list(_memo(chat, "ids", text, compute))


def ids_text(chat, ids: list[int]) -> str:
    """chat.tokenizer.decode(ids, skip_special_tokens=False)."""
    return _memo(chat, "decode", tuple(ids), lambda: chat.tokenizer.decode(ids, skip_special_tokens=False))


def with_system_suffix(messages: list[dict], suffix, episode) -> list[dict]:
    """`messages` with `suffix` (a string, or a function episode -> string) appended to the
    system message, or a system message of its own when there is none."""
    suffix = suffix(episode) if callable(suffix) else suffix
    if suffix:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + suffix}
        else:
            messages.insert(0, {"role": "system", "content": suffix})
    return messages
