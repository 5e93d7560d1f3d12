"""Token streams stay exact under real chat templates (Qwen3 with thinking on and off,
Llama 3.x Instruct, the tiny models' ChatML) and under none (a base model's plain transcript),
and reasoning is not shown to the other party.

The templates are the real ones (tests/fixtures/templates, see SOURCE.md there), put on a
tokenizer trained offline, with the special tokens those templates use.
"""
from pathlib import Path

import pytest
import torch

from minscope.batch import training_batch
from minscope.chat import ChatFormat, chat_format, strip_reasoning
from minscope.envs.base import Environment, Episode, Turn
from minscope.models import CHATML_TEMPLATE, build_tiny_model, build_tokenizer
from minscope.rollout import LMSpeaker, rollout
from minscope.stream import Stream, view_messages
from minscope.trainer import sequence_logprobs

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
CORPUS = ["hello there, would you like to donate to the children", "how are you today",
          "I can give one dollar", "no thanks", "<think>let me think</think> fine"]


def make_tokenizer(kind: str, corpus=CORPUS, vocab_size: int = 400):
    """A tokenizer trained offline carrying a real chat template: "qwen3", "llama3" or
    "chatml" (the tiny models' own), with the special tokens and EOS that template uses."""
    tok = build_tokenizer(corpus, vocab_size=vocab_size)
    if kind == "chatml":
        return tok
    if kind == "plain":                   # no chat template (a base model): a plain transcript
        tok.chat_template = None
        return tok
    if kind == "qwen3":
        # Qwen3 keeps these as added, non-special tokens (decode keeps them)
        tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                        "</tool_response>"])
        tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
        return tok
    if kind == "llama3":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>"]})
        tok.chat_template = (TEMPLATES / "llama3.jinja").read_text()
        return tok
    raise ValueError(kind)


class Talk(Environment):
    """Agent opens; strict alternation for ten generated turns."""
    max_turns = 10

    def tasks(self, split="train"):
        return ["t"]

    def agent_messages(self, task):
        return [{"role": "system", "content": "You persuade people to donate."}]

    def partner_messages(self, task):
        return [{"role": "system", "content": "You are a person being asked for money."}]

    def score(self, episode):
        return 0.0, {}


CASES = [("qwen3", "qwen3", False), ("qwen3", "qwen3", True), ("llama3", "llama", False),
         ("chatml", "qwen3", False), ("plain", "llama", False)]


@pytest.mark.parametrize("kind,arch,thinking", CASES, ids=["qwen3", "qwen3-thinking", "llama3", "chatml", "plain"])
def test_ten_turns_keep_both_streams_exact_and_trainable(kind, arch, thinking):
    tok = make_tokenizer(kind)
    torch.manual_seed(0)
    model = build_tiny_model(tok, arch, hidden_size=32, num_layers=2)
    agent = LMSpeaker(model, tok, "agent", max_new_tokens=6, thinking=thinking)
    partner = LMSpeaker(model, tok, "partner", max_new_tokens=6, thinking=thinking)
    episodes = rollout(Talk(), ["t"], agent, partner, group_size=3)
    for ep in episodes:
        assert len(ep.turns) == 10
        for key in ("agent", "partner"):
            stream = ep.info["streams"][key]
            assert stream.exact, f"{kind}: the {key} stream was restarted"
            sampled = [i for i, m in zip(stream.ids, stream.mask) if m]
            assert sampled == sum((t.token_ids for t in ep.turns if t.role == key), [])
    # the first prompt of each party is exactly what the template renders for it
    first = episodes[0].info["streams"]["partner"]
    fmt = chat_format(tok, thinking)
    shown = view_messages(Talk(), Episode(task="t", group=0, turns=episodes[0].turns[:1]), "partner")
    prompt = tok(fmt.render(shown), add_special_tokens=False)["input_ids"]
    assert first.ids[:len(prompt)] == prompt
    if kind == "qwen3" and not thinking:
        assert tok.decode(first.ids[:len(prompt)]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # the trainer recomputes exactly the sampled log-probs from the streams
    for key in ("agent", "partner"):
        batch = training_batch(episodes, key, tok.pad_token_id)
        assert batch.index == [0, 1, 2]
        with torch.no_grad():
            logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0, adapter=None)
        m = batch.loss_mask.bool()
        assert m.any() and torch.allclose(logp[m], batch.old_logp[m], atol=1e-5)


def test_a_tokenizer_without_a_template_gets_a_plain_transcript_that_extends_turn_by_turn():
    tok = make_tokenizer("plain")
    tok.bos_token = "<|endoftext|>"
    fmt = ChatFormat(tok)
    assert fmt.plain and fmt.incremental and not fmt.renders_tools
    assert tok.convert_tokens_to_ids("Ċ") in fmt.stop_ids          # byte-level BPE's "\n": a turn is a line
    system = {"role": "system", "content": "You are a person being asked for money."}
    first = fmt.render([system, {"role": "user", "content": "hello there"}])
    assert first == "<|endoftext|>You are a person being asked for money.\n\nPartner: hello there\nYou:"
    # the party samples " no thanks" and stops at a newline; the next message is appended
    delta = fmt.delta([{"role": "user", "content": "how are you today"}], sampled_end="\n")
    assert delta == "Partner: how are you today\nYou:"
    whole = fmt.render([system, {"role": "user", "content": "hello there"},
                        {"role": "assistant", "content": " no thanks"}, {"role": "user", "content": "how are you today"}])
    assert first + " no thanks\n" + delta == whole
    # stopped at the length cap (no newline sampled): the next line starts on a line of its own
    assert fmt.delta([{"role": "user", "content": "x"}], sampled_end="") == "\nPartner: x\nYou:"


def test_the_old_whole_conversation_rerender_breaks_on_qwen3():
    """What went wrong before: re-rendering the whole conversation with Qwen3's template
    does not extend the stream from the second turn on (the empty think block of the
    generation prompt is not in the history)."""
    tok = make_tokenizer("qwen3")
    fmt = ChatFormat(tok)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    first = fmt.render(msgs)
    again = fmt.render(msgs + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}])
    assert not again.startswith(first + "hello<|im_end|>")
    assert fmt.incremental               # the per-turn deltas hold for this template


def test_llama_dates_are_rendered_once(monkeypatch):
    """Llama 3.x writes today's date into the system turn at render time: a stream keeps
    the date of its first turn even when the day changes during the episode."""
    from datetime import datetime as real_datetime

    import transformers.utils.chat_template_utils as ctu

    days = iter(range(1, 28))

    class Clock:
        @staticmethod
        def now():
            return real_datetime(2026, 1, next(days))

    monkeypatch.setattr(ctu, "datetime", Clock)
    tok = make_tokenizer("llama3")
    torch.manual_seed(0)
    model = build_tiny_model(tok, "llama", hidden_size=32)
    speakers = [LMSpeaker(model, tok, role, max_new_tokens=4) for role in ("agent", "partner")]
    (ep,) = rollout(Talk(), ["t"], *speakers)
    for key in ("agent", "partner"):
        stream = ep.info["streams"][key]
        text = tok.decode(stream.ids)
        assert stream.exact and text.count("Cutting Knowledge Date") == 1 and text.count("Today Date") == 1


def test_think_blocks_stay_in_their_own_stream_and_are_hidden_from_the_other_party():
    tok = make_tokenizer("qwen3")
    fmt = chat_format(tok, thinking=True)
    env = Talk()
    ep = Episode(task="t", group=0)
    streams = {"agent": Stream(), "partner": Stream()}
    said = ["<think>\nshould I ask?\n</think>\n\nWould you donate?", "<think>hmm</think>\n\nMaybe one dollar.",
            "Thank you!", "<think>\nunfinished reasoning"]
    for i, raw in enumerate(said):
        role = "agent" if i % 2 == 0 else "partner"
        stream = streams[role]
        stream.extend_prompt(fmt, view_messages(env, ep, role))
        ids = tok(raw, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        shown = strip_reasoning(raw)
        stream.extend_sampled(ids, [-0.5] * len(ids), raw + tok.eos_token, shown=shown, end=tok.eos_token)
        ep.turns.append(Turn(role, shown, token_ids=ids))
    for role, stream in streams.items():
        assert stream.exact
        own = [t for t in said[(0 if role == "agent" else 1)::2]]
        text = tok.decode(stream.ids)
        for raw in own:                          # its own reasoning, as sampled
            assert raw in text
        other = said[(1 if role == "agent" else 0)::2]
        for raw in other:                        # the other party's reasoning: never
            if "<think>" in raw:
                assert raw not in text and raw.split("<think>")[1].split("</think>")[0] not in text
    assert [t.text for t in ep.turns] == ["Would you donate?", "Maybe one dollar.", "Thank you!", ""]


def test_a_rewritten_history_restarts_the_stream():
    """Verbalized Sampling shows the drawn reply instead of what was sampled: the stream
    cannot be extended, restarts from the full prompt and is marked not exact."""
    tok = make_tokenizer("qwen3")
    fmt = chat_format(tok)
    env = Talk()
    ep = Episode(task="t", group=0, turns=[Turn("agent", "hi")])
    stream = Stream()
    stream.extend_prompt(fmt, view_messages(env, ep, "partner"))
    ids = tok("raw candidates", add_special_tokens=False)["input_ids"]
    stream.extend_sampled(ids, [-1.0] * len(ids), "raw candidates", shown="raw candidates")
    ep.turns += [Turn("partner", "the drawn reply"), Turn("agent", "ok")]
    stream.extend_prompt(fmt, view_messages(env, ep, "partner"))
    assert not stream.exact and stream.mask == [0] * len(stream.ids)
    assert tok.decode(stream.ids) == fmt.render(view_messages(env, ep, "partner"))


def test_strip_reasoning():
    assert strip_reasoning("<think>\na\n</think>\n\nanswer") == "answer"
    assert strip_reasoning("plain text") == "plain text"
    assert strip_reasoning("<think>never closed") == ""
    assert strip_reasoning("reasoning only closed</think>\n\nanswer") == "answer"


def test_a_template_that_depends_on_the_history_fails_the_probe():
    tok = build_tokenizer(CORPUS, vocab_size=300)
    # numbers every message: a new message's rendering depends on how many came before
    tok.chat_template = ("{%- for m in messages %}{{ loop.index ~ ':' ~ m.role ~ ':' ~ m.content ~ '\\n' }}"
                         "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant:' }}{%- endif %}")
    assert "depends on the earlier conversation" in ChatFormat(tok).probe()
    tok.chat_template = CHATML_TEMPLATE
    assert ChatFormat(tok).probe() == ""
