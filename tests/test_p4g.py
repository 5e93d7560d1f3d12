"""Persuasion for Good: loading both official formats, personas, the split, the donation
parser and the environment. Fixtures in tests/fixtures/p4g are small hand-written corpora
in the CSV release layout and the two ConvoKit layouts (speakers.json and users.json)."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minscope.envs.base import Episode, Turn
from minscope.envs.p4g import (
    PERSUADEE_PROMPT,
    READOUTS,
    P4GEnv,
    words_for_tokens,
)
from minscope.envs.p4g_data import (
    DataError,
    P4GDataNotFound,
    clean_survey,
    load_p4g,
    persona_split,
    render_persona,
)
from minscope.envs.p4g_parse import episode_donation, is_donation_ask, parse_donation

FIXTURES = Path(__file__).parent / "fixtures" / "p4g"
CSV = FIXTURES / "csv"
CONVOKIT = [FIXTURES / "convokit_speakers", FIXTURES / "convokit_users"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def csv_corpus():
    return load_p4g(CSV)


def episode(*turns):
    """An episode from (role, text) pairs."""
    return Episode(task=None, group=0, turns=[Turn(role, text) for role, text in turns])


# ------------------------------------------------------------------------------ loading

def test_csv_sentences_of_one_speaker_become_one_message(csv_corpus):
    first = csv_corpus.dialogues[0]
    assert first.messages[2] == ("persuader", "Great. Have you heard of Save the Children? "
                                 "They help kids in poor countries get food and school.")
    roles = [role for role, _ in first.messages]
    assert roles == ["persuader", "persuadee"] * (len(roles) // 2)


def test_bad_dialogues_are_dropped(csv_corpus):
    assert csv_corpus.dropped_bad == 1
    assert not any(d.id.startswith("BAD_") for d in csv_corpus.dialogues)
    assert "user_9003" not in csv_corpus.persuadee_ids()


def test_donation_above_two_dollars_is_unknown_not_clipped(csv_corpus):
    d = next(d for d in csv_corpus.dialogues if d.persuadee_id == "user_9005")
    assert d.donation is None and d.donation_raw == 50.0


@pytest.mark.parametrize("folder", CONVOKIT, ids=lambda p: p.name)
def test_convokit_layouts_give_the_same_personas_as_csv(folder, csv_corpus):
    corpus = load_p4g(folder)
    assert corpus.persuadee_ids() == csv_corpus.persuadee_ids()
    for user in csv_corpus.persuadee_ids():
        assert corpus.surveys[user] == pytest.approx(csv_corpus.surveys[user])
        assert render_persona(corpus.surveys[user]) == render_persona(csv_corpus.surveys[user])


@pytest.mark.parametrize("folder", CONVOKIT, ids=lambda p: p.name)
def test_convokit_layouts_give_the_same_dialogues_and_donations_as_csv(folder, csv_corpus):
    corpus = load_p4g(folder)
    assert corpus.dropped_bad == csv_corpus.dropped_bad
    as_tuples = lambda c: [(d.id, d.persuader_id, d.persuadee_id, d.messages, d.donation)  # noqa: E731
                           for d in c.dialogues]
    assert as_tuples(corpus) == as_tuples(csv_corpus)


def test_missing_data_path_says_where_to_get_the_data_and_which_flag(tmp_path):
    with pytest.raises(P4GDataNotFound) as err:
        P4GEnv(tmp_path / "nowhere")
    message = str(err.value)
    assert "--data" in message and "persuasionforgood-corpus" in message
    assert "Persuasion for Good" in message and "nowhere" in message


def test_folder_without_corpus_files_is_the_same_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not the data")
    with pytest.raises(P4GDataNotFound, match="--data"):
        load_p4g(tmp_path)


def test_convokit_folder_without_survey_answers_is_a_clear_error(tmp_path):
    shutil.copytree(CONVOKIT[0], tmp_path / "corpus")
    (tmp_path / "corpus" / "speakers.json").unlink()
    with pytest.raises(P4GDataNotFound, match="speakers.json"):
        load_p4g(tmp_path / "corpus")


def test_windows_line_endings_of_the_release_read_the_same(tmp_path, csv_corpus):
    # the official full_dialog.csv / full_info.csv use CRLF line endings
    for name in ("full_dialog.csv", "full_info.csv"):
        (tmp_path / name).write_bytes((CSV / name).read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    crlf = load_p4g(tmp_path)
    assert b"\r\n" in (tmp_path / "full_dialog.csv").read_bytes()
    assert [(d.id, d.messages, d.donation) for d in crlf.dialogues] == \
        [(d.id, d.messages, d.donation) for d in csv_corpus.dialogues]
    assert crlf.persuadee_ids() == csv_corpus.persuadee_ids()


def test_the_persuader_is_told_how_many_messages_it_has():
    for max_turns, messages in ((10, 5), (7, 4)):
        env = P4GEnv(CSV, max_turns=max_turns)
        prompt = env.agent_messages(env.tasks("all")[0])[0]["content"]
        assert f"you have {messages} messages in total" in prompt


def test_corpus_is_found_one_folder_down(tmp_path, csv_corpus):
    shutil.copytree(CSV, tmp_path / "FullData")
    assert load_p4g(tmp_path).persuadee_ids() == csv_corpus.persuadee_ids()


# ----------------------------------------------------------------------------- personas

def test_persona_omits_missing_answers_and_never_prints_nan(csv_corpus):
    text = render_persona(csv_corpus.surveys["user_9002"])   # no demographics, some blanks
    assert "nan" not in text.lower() and "none" not in text.lower() and "NA" not in text
    assert "Age" not in text and "agreeableness" not in text and "openness" not in text
    assert "neuroticism 1.8" in text


def test_persona_renders_every_group_of_a_complete_survey(csv_corpus):
    text = render_persona(csv_corpus.surveys["user_9001"])
    for expected in ["Age: 41", "Religion: Catholic", "Big Five personality (1-5): extraversion 2.6",
                     "Moral foundations (1-6): care 4.6", "loyalty 3.3",
                     "Schwartz values (1-6): conformity 5",
                     "Decision style (1-5): rational 4, intuitive 2.5"]:
        assert expected in text


def test_implausible_age_is_left_out(csv_corpus):
    assert "age" not in csv_corpus.surveys["user_9005"]
    assert "Age" not in render_persona(csv_corpus.surveys["user_9005"])


def test_persuadee_without_survey_answers_gets_no_task():
    ids = [t.id for t in P4GEnv(CSV).tasks("all")]
    assert "user_9004" not in ids
    assert ids == ["user_9001", "user_9002", "user_9005"]    # one task per persuadee


def test_clean_survey_reads_numeric_strings_and_other_key_spellings():
    raw = {"Open.x": "3.5", "self-direction": 4, "sex.x": " Female ", "care.x": "nan",
           "age.x": "NA", "B6": "1.0", "income": float("nan")}
    assert clean_survey(raw) == {"open": 3.5, "self_direction": 4.0, "sex": "Female"}


# -------------------------------------------------------------------------------- split

def test_split_is_disjoint_and_covers_every_persona():
    env = P4GEnv(CSV, test_fraction=0.5)
    train = {t.id for t in env.tasks("train")}
    test = {t.id for t in env.tasks("test")}
    assert not train & test
    assert train | test == {t.id for t in env.tasks("all")}


def test_split_depends_only_on_the_user_id():
    env = P4GEnv(CSV)
    for split in ("train", "test"):
        assert [t.id for t in env.tasks(split)] == [
            t.id for t in env.tasks("all") if persona_split(t.id) == split]


def test_split_holds_out_about_the_requested_fraction():
    ids = [f"user_{i}" for i in range(4000)]
    share = sum(persona_split(u, 0.2) == "test" for u in ids) / len(ids)
    assert 0.17 < share < 0.23


def test_split_is_the_same_in_a_fresh_python_process():
    ids = [f"user_{i}" for i in range(200)]
    here = "".join(persona_split(u)[1] for u in ids)
    code = ("from minscope.envs.p4g_data import persona_split; "
            "print(''.join(persona_split(f'user_{i}')[1] for i in range(200)))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout.strip()
    assert out == here


def test_p4g_tasks_are_personas_so_persona_guided_does_not_apply():
    env = P4GEnv(CSV)
    assert env.tasks_are_personas and not hasattr(env, "persona_bank")


# ------------------------------------------------------------------------------- parser

@pytest.mark.parametrize("text, amount", [
    ("[DONATE $1.25]", 1.25),
    ("Sure. [GIVE $0.5]", 0.5),
    ("[DONATE 50 cents]", 0.5),
    ("[DONATE $0]", 0.0),
])
def test_tag_is_read(text, amount):
    assert parse_donation(text) == pytest.approx(amount)


def test_tag_wins_over_plain_language():
    assert parse_donation("[DONATE $0.25] Honestly I'd give a dollar if I could.") == 0.25


@pytest.mark.parametrize("text, amount", [
    ("I'll give a dollar.", 1.0),
    ("I can donate $0.50.", 0.5),
    ("OK, I will give 50 cents.", 0.5),
    ("Fine, I'll donate the whole $2!", 2.0),
    ("I'll donate twenty-five cents", 0.25),
    ("I'll donate $1 of my $2 payment.", 1.0),
    ("I can't give $2, but I'll give $1.", 1.0),
    ("I'll donate $1, is that okay?", 1.0),
    ("I will donate .50 cents.", 0.5),
])
def test_plain_language_fallback(text, amount):
    assert parse_donation(text) == pytest.approx(amount)


@pytest.mark.parametrize("text", [
    "I won't donate.",
    "Sorry, I don't want to donate anything today.",
    "I'd rather keep my $2.",
    "I will not be donating.",
])
def test_refusals_read_as_zero(text):
    assert parse_donation(text) == 0.0


@pytest.mark.parametrize("text, amount", [
    ("I donated $20 last year, but I can't give $2 now.", 0.0),   # a past gift, then a negated pledge
    ("I won't donate $2", 0.0),
    ("I would not donate $2.", 0.0),
    ("I'm not going to give $1.", 0.0),
    ("I can't give a dollar, maybe 50 cents.", 0.5),
    ("I can't give $2 or $1.", 0.0),
    ("I gave $5 to a food bank yesterday, so I'll give $1 now.", 1.0),
    ("I've already donated $2 to them before, but I will donate 50 cents.", 0.5),
    ("I have given it some thought, I'll give $1.", 1.0),
    ("I think I would donated to donate .50", 0.5),             # a modal: not the past tense
    ("I can't give more than $1.", None),                          # a limit, not an amount
])
def test_negated_and_past_gifts_are_not_pledges(text, amount):
    assert parse_donation(text) == amount


@pytest.mark.parametrize("text", [
    "Hi! How are you today?",
    "Would $1 be enough?",
    "I donated $20 to a food bank last year.",
    "I'm not sure if I will donate.",
])
def test_no_amount_stated_is_none(text):
    assert parse_donation(text) is None


@pytest.mark.parametrize("text, amount", [
    ("[DONATE $0.5] ... okay, you convinced me. [DONATE $1]", 1.0),
    ("I'll donate $1. Actually, I'll give 50 cents.", 0.5),
    ("I'll donate $1. On second thought, I won't donate.", 0.0),
])
def test_the_last_amount_stated_counts(text, amount):
    assert parse_donation(text) == pytest.approx(amount)


@pytest.mark.parametrize("text", ["[DONATE $5]", "[GIVE $100]", "I will donate $10 to them."])
def test_amounts_above_two_dollars_are_clamped(text):
    assert parse_donation(text) == 2.0


def test_episode_donation_reads_only_the_persuadee():
    ep = episode(("agent", "Could you [DONATE $2]?"), ("partner", "I'll give 50 cents."),
                 ("agent", "Would you give $1 instead?"), ("partner", "Okay, that's fine."))
    assert episode_donation(ep) == 0.5


def test_episode_donation_is_the_last_amount_across_turns():
    ep = episode(("agent", "Hi!"), ("partner", "[DONATE $0.5]"),
                 ("agent", "Thanks! Could you do $1?"), ("partner", "Alright. [DONATE $1]"))
    assert episode_donation(ep) == 1.0


# What SmolLM2-135M wrote as the persuadee in a learning run, each read as a $2 pledge before:
# the persuadee repeating the prompt or narrating, not deciding.
NOT_PLEDGES = [
    "[Donate $2 to Save the Children]\n\nDecision style: fairness",       # no "]" right after the amount
    "[Donate $2 to Save",                                                  # no closing bracket at all
    "[DONATE $2",
    "Donate $2 to Save the Children, a nonprofit organization dedicated to helping children and their "
    "families, and in your opinion",                                       # an imperative
    "Please donate $1 to Save the Children.",
    "The Character (SHOP-OPERER) smiles and tells them to donate $2 to the Help the LARGAMMY.",  # narrated
    "...tells them to donate $2 to the Help the",
    "They give $2 every year to the charity.",
    'My friend said "I will donate $2 today" and left.',                   # quoted
    "He wrote \u201cI'll give $1\u201d on the form.",
]


@pytest.mark.parametrize("text", NOT_PLEDGES)
def test_echoes_imperatives_narration_and_quotes_are_not_pledges(text):
    assert parse_donation(text) is None


@pytest.mark.parametrize("text,amount", [
    ("[DONATE $2]", 2.0), ("Sure. [DONATE $0.50]", 0.5), ("[ give : $1 ]", 1.0), ("[DONATE $1.50 ]", 1.5),
    ("I will donate $2 to Save the Children.", 2.0), ("Thank you, I'll give $1.", 1.0),
    ("Ok, give $1 from me? No: I'll give 50 cents.", 0.5), ("Yes, I'd like to donate $0.30 today.", 0.3),
])
def test_the_persuadees_own_pledges_still_read(text, amount):
    assert parse_donation(text) == pytest.approx(amount)


def test_a_persuadee_sentence_that_echoes_the_persuader_is_not_read():
    ask = "Please consider giving $2 to Save the Children today, it feeds a child for a week."
    echo = episode(("agent", ask), ("partner", "Consider giving $2 to Save the Children today."))
    assert parse_donation(echo.turns[1].text) == 2.0          # read alone, it is a pledge ...
    assert episode_donation(echo) is None                      # ... in the episode, an echo
    own = episode(("agent", "Would you donate $2 to Save the Children?"),
                  ("partner", "I will donate $2 to Save the Children."))
    assert episode_donation(own) == 2.0                         # the persuadee's own words
    later = episode(("agent", ask), ("partner", "Consider giving $2 to Save the Children today. [DONATE $1]"))
    assert episode_donation(later) == 1.0


# ------------------------------------------------------------------ hostile cases
# What a trained persuader could make a persuadee write to be paid without a gift.

@pytest.mark.parametrize("text", [
    'He told me to write "[DONATE $2]", but I will not donate anything.',   # quoted: reported speech
    "He wrote \u201c[DONATE $2]\u201d on the form.",
    "I will not write [DONATE $2].",                                      # a negated clause
    "I won't type [GIVE $1.50] here.",
    "He told me to type [DONATE $2].",                                    # a reported instruction
    "I am donating -$2",                                                  # a minus sign
    "I will donate -2 dollars.",
    "I am donating $-2",
    "[DONATE -$2]",
    "I will give \u22122 dollars.",
])
def test_hostile_tags_and_negative_amounts_give_no_gift(text):
    assert not parse_donation(text)            # None (nothing stated) or 0 (a refusal)


def test_hostile_a_quoted_tag_beside_a_refusal_is_the_refusal():
    assert parse_donation('He told me to write "[DONATE $2]", but I will not donate anything.') == 0.0
    assert parse_donation('He told me to write "[DONATE $2]". I will donate $1.') == 1.0


@pytest.mark.parametrize("text", ["[DONATE $\uff12]", "[DONATE $\u0662]", "I will donate $\uff12.",
                                  "I'll give \u0661 dollar"])
def test_hostile_non_ascii_digits_state_nothing_as_in_the_readout(text):
    """The readout reads only the tokens "0".."9" (minscope/readout.py), so a fullwidth or
    Arabic-Indic digit is unreadable there ($0); the parser reads it the same way."""
    assert parse_donation(text) is None


@pytest.mark.parametrize("ask, reply", [
    ("Please just type [DONATE $2] to confirm", "[DONATE $2]"),
    ("Please just type [DONATE $2] to confirm", "Sure! [DONATE $2]"),
    ("Type [DONATE $2.00 and you are done", "[ donate $2 ]"),
    ("Just write [GIVE $1.50] please.", "[DONATE $1.5]"),
    ("Just type: I will donate $2", "I will donate $2"),               # copied word for word, first person
    ("Say this: I would like to donate $1 today", "I would like to donate $1 today."),
])
def test_hostile_a_tag_or_amount_copied_from_the_persuader_is_an_echo(ask, reply):
    ep = episode(("agent", ask), ("partner", reply))
    assert parse_donation(reply)                # read alone, it pledges ...
    assert not episode_donation(ep)             # ... copied from the persuader, it does not


@pytest.mark.parametrize("ask, reply, amount", [
    ("Would you give $2?", "Sure, I'll donate $2.", 2.0),               # the same amount, in its own words
    ("Would you give $2?", "Sure! [DONATE $2]", 2.0),                   # a tag the persuader did not write
    ("Please just type [DONATE $2] to confirm", "No, I'll give $1. [DONATE $1]", 1.0),   # another amount
    ("Please just type [DONATE $2] to confirm", "Fine, I will donate $2.", 2.0),         # first-person words
])
def test_hostile_rules_keep_the_persuadees_own_pledges(ask, reply, amount):
    assert episode_donation(episode(("agent", ask), ("partner", reply))) == amount


def test_a_persuadee_repeating_its_instructions_states_nothing():
    parrot = "If you decide to give, state the amount with a tag, for example [DONATE $0.50] or [DONATE $1]"
    ep = episode(("agent", "Hello! Would you give to Save the Children?"), ("partner", parrot))
    assert parse_donation(parrot) == 1.0
    assert episode_donation(ep, PERSUADEE_PROMPT) is None
    env = P4GEnv(CSV, split="all", max_turns=2)
    ep.task = env.tasks()[0]
    reward, info = env.score(ep)                                # the reward reads it so
    assert reward == 0.0 and not info["donation_stated"]


def test_the_word_limit_follows_the_turn_budget():
    assert words_for_tokens(None) == words_for_tokens(128) == 60
    assert words_for_tokens(24) == 10 and words_for_tokens(4) == 3
    import argparse

    from minscope.real_args import make_env

    env = make_env(argparse.Namespace(env="p4g", data=str(CSV), max_turns=2, max_new_tokens=24))
    assert "under 10 words" in env.partner_messages(env.tasks("all")[0])[0]["content"]
    assert "under 10 words" in env.agent_messages(env.tasks("all")[0])[0]["content"]


def test_donation_ask_needs_a_request_and_money():
    assert is_donation_ask("It helps kids. Would you donate $1 of your payment?")
    assert not is_donation_ask("How are you today?")
    assert not is_donation_ask("Save the Children spends most donations on programs.")


# -------------------------------------------------------------------------- environment

def test_prompts_state_the_task_the_situation_and_the_tag_rule():
    env = P4GEnv(CSV, max_words=42)
    task = env.tasks("all")[0]
    agent = env.agent_messages(task)
    partner = env.partner_messages(task)
    assert [m["role"] for m in agent] == ["system"] and [m["role"] for m in partner] == ["system"]
    for phrase in ["Save the Children", "$2", "deducted", "specific amount", "42 words"]:
        assert phrase in agent[0]["content"]
    for phrase in [task.persona_text, "earned $2", "free to keep", "[DONATE $0.50]", "[GIVE $1]", "[DONATE $0]",
                   "42 words"]:
        assert phrase in partner[0]["content"]
    assert env.first_speaker(task) == "agent"


def test_turns_alternate_until_max_turns_even_after_a_donation():
    env = P4GEnv(CSV, max_turns=4)
    ep = episode(("agent", "Hello, would you donate?"))
    assert env.after_turn(ep).next_speaker == "partner"
    ep.turns.append(Turn("partner", "[DONATE $2]"))
    assert env.after_turn(ep).next_speaker == "agent"
    ep.turns += [Turn("agent", "Thank you!"), Turn("partner", "You're welcome.")]
    assert env.after_turn(ep).next_speaker is None


def test_score_is_half_the_donation_with_info():
    env = P4GEnv(CSV)
    ep = episode(("agent", "Hi! Could you donate $1 to Save the Children?"),
                 ("partner", "Maybe. Why?"),
                 ("agent", "It feeds kids. Would you give $2?"),
                 ("partner", "Okay. [DONATE $1.5]"))
    reward, info = env.score(ep)
    assert reward == pytest.approx(0.75)
    assert info["donation"] == 1.5 and info["donation_stated"]
    assert info["asks"] == 2 and info["turns"] == 4


def test_score_without_a_stated_donation_is_zero():
    reward, info = P4GEnv(CSV).score(episode(("agent", "Hello!"), ("partner", "Hi.")))
    assert reward == 0.0 and info["donation"] == 0.0 and not info["donation_stated"]


def test_step_metrics_say_what_the_reward_parser_saw():
    env = P4GEnv(CSV)
    eps = [episode(("agent", "Would you give $1?"), ("partner", "Sure, I'll give $1."),
                   ("agent", "Thanks!"), ("partner", "[DONATE $0.50] after all")),
           episode(("agent", "Hi."), ("partner", "No, I won't donate."),
                   ("agent", "Okay."), ("partner", "Bye.")),
           episode(("agent", "Hi."), ("partner", "Hello."), ("agent", "Bye."), ("partner", "Bye."))]
    for ep in eps:
        ep.info.update(env.score(ep)[1])
    m = env.step_metrics(eps)
    assert m["donation_rate"] == pytest.approx(1 / 3) and m["donation_stated"] == pytest.approx(2 / 3)
    assert m["donation_mean"] == pytest.approx(0.5 / 3)
    assert m["tagged_turns"] == pytest.approx(1 / 6) and m["stated_turns"] == pytest.approx(3 / 6)


def test_simulator_reward_defaults_to_adversarial():
    assert P4GEnv(CSV).default_simulator_reward == "adversarial"


# ------------------------------------------------------------ parser on hostile and huge text

@pytest.mark.parametrize("text, amount", [
    ("I will give \u017fix cents", 0.06),      # long s: matches "s" case-insensitively
    ("I will give f\u0130ve cents", 0.05),     # dotted capital I
    ("I will give n\u0131ne cents", 0.09),     # dotless i
    ("I will give \u017fEVENTY \u017fIX cents", 0.76),
])
def test_letters_that_case_fold_to_ascii_read_as_the_number_word(text, amount):
    assert parse_donation(text) == pytest.approx(amount)


def parse_seconds(text):
    start = time.perf_counter()
    parse_donation(text)
    return time.perf_counter() - start


@pytest.mark.parametrize("text", [
    "I will give " + "1" * 4000,                # a number could start at every digit
    "I will give " + "$1 " * 3000,              # every amount checked against every other
    "[donate" + " " * 600 + "x",                # three adjacent \s* in the tag pattern
    "can't give $1 " * 2000,                    # every amount checked against every negation
    "I will give " + "of my $2 " * 2000,        # the "of my" look-back rescanned the sentence
], ids=["digits", "amounts", "tag-spaces", "negations", "base-refs"])
def test_long_hostile_text_parses_in_linear_time(text):
    assert parse_seconds(text) < 1.0


def test_plain_language_is_read_in_the_last_sentences_of_a_very_long_text():
    chatter = "Nice weather today. " * 1000                 # 20 KB without a statement
    assert parse_donation("I'll donate $1. " + chatter + "I'll give 50 cents.") == 0.5
    assert parse_donation("[DONATE $1] " + chatter) == 1.0     # tags count anywhere
    assert parse_donation("I'll donate $1. " + chatter) is None  # only the last 10,000 characters


DONATION_PIECES = ["I'll give ", "donate ", "$", "1", "0.5", " ", ".", "?", "\n", "cents", "dollars",
                   "can't ", "not ", "of my ", "[DONATE ", "[give:", "]", "six", "twenty", "half a ",
                   "all of it", "keep it", "\u017f", "\u0130", "\u0131", "\u2019", "\u0663", "9" * 40]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(DONATION_PIECES) | st.text(max_size=4), max_size=30))
def test_any_text_gives_none_or_an_amount_in_range(pieces):
    amount = parse_donation("".join(pieces))
    assert amount is None or (isinstance(amount, float) and 0.0 <= amount <= 2.0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(DONATION_PIECES), min_size=1, max_size=6))
def test_long_repeated_text_parses_fast(pieces):
    unit = "".join(pieces)
    text = unit * (50_000 // len(unit) + 1)       # about 50 KB
    start = time.perf_counter()
    amount = parse_donation(text)
    assert time.perf_counter() - start < 2.0
    assert amount is None or 0.0 <= amount <= 2.0


# ------------------------------------------------------------------- broken data files

def copy_csv(tmp_path) -> Path:
    folder = tmp_path / "p4g"
    shutil.copytree(CSV, folder)
    return folder


def edit(path: Path, fn):
    path.write_text(fn(path.read_text(encoding="utf-8")), encoding="utf-8")


def test_a_renamed_column_is_a_data_error_naming_the_file_and_column(tmp_path):
    folder = copy_csv(tmp_path)
    edit(folder / "full_info.csv", lambda s: s.replace("B2,B3,B4", "B2,UserID,B4", 1))
    with pytest.raises(DataError, match=r"full_info\.csv.*B3") as err:
        load_p4g(folder)
    assert isinstance(err.value, ValueError) and "UserID" in str(err.value)   # says what it found


def test_a_short_row_is_a_data_error_naming_the_file_and_line(tmp_path):
    folder = copy_csv(tmp_path)
    lines = (folder / "full_info.csv").read_text().splitlines(keepends=True)
    lines[3] = ",".join(lines[3].split(",")[:4]) + "\n"          # line 4 keeps 4 of 37 fields
    (folder / "full_info.csv").write_text("".join(lines))
    with pytest.raises(DataError, match=r"full_info\.csv.*line 4.*4 of 37"):
        load_p4g(folder)


def test_non_utf8_bytes_are_a_data_error_naming_the_file_and_line(tmp_path):
    folder = copy_csv(tmp_path)
    raw = (folder / "full_dialog.csv").read_bytes().replace(b"Not really.", b"Not r\xe9ally.")
    (folder / "full_dialog.csv").write_bytes(raw)
    with pytest.raises(DataError, match=r"full_dialog\.csv.*line 12.*UTF-8"):
        load_p4g(folder)


def test_a_file_cut_off_in_the_middle_of_its_last_row_is_reported(tmp_path):
    folder = copy_csv(tmp_path)
    raw = (folder / "full_info.csv").read_text()
    (folder / "full_info.csv").write_text(raw[:raw.rstrip("\n").rfind("\n") + 30])   # last row cut
    with pytest.raises(DataError, match=r"full_info\.csv.*line 13.*truncated"):
        load_p4g(folder)


def test_dialogues_without_a_persuadee_row_are_reported_with_counts(tmp_path, capsys):
    folder = copy_csv(tmp_path)
    raw = (folder / "full_info.csv").read_text()
    (folder / "full_info.csv").write_text(raw[:raw.rstrip("\n").rfind("\n") + 1])   # cut at a row end
    corpus = load_p4g(folder)
    assert "20180902-100000_6_live" in {d.id for d in corpus.dialogues}
    message = "full_info.csv has no persuadee row for 1 of 5 dialogues"
    assert any(message in w for w in corpus.warnings)
    assert message in capsys.readouterr().err


def test_dialogues_without_messages_are_reported_with_counts(tmp_path, capsys):
    folder = copy_csv(tmp_path)
    edit(folder / "full_dialog.csv", lambda s: s[:s.index("27,Hello again")])   # cut at a row end
    corpus = load_p4g(folder)
    message = "full_dialog.csv has no messages for 1 of 5 dialogues in full_info.csv"
    assert any(message in w for w in corpus.warnings) and message in capsys.readouterr().err


def test_the_fixture_corpora_load_without_warnings(csv_corpus):
    assert csv_corpus.warnings == []
    for folder in CONVOKIT:
        assert load_p4g(folder).warnings == []


def test_an_unknown_role_is_a_data_error_naming_the_file_and_line(tmp_path):
    folder = copy_csv(tmp_path)
    edit(folder / "full_dialog.csv", lambda s: s.replace("Not really.,0,1,", "Not really.,0,2,"))
    with pytest.raises(DataError, match=r"full_dialog\.csv.*line 12.*B4.*'2'"):
        load_p4g(folder)


@pytest.mark.parametrize("damage, where", [
    (lambda s: s.replace('"meta": {"role": 1, "turn": 0}', '"meta": {"role": 1, "turn": 0', 1),
     r"utterances\.jsonl.*line 2"),
    (lambda s: s.replace("\n", "\n[1, 2]\n", 1), r"utterances\.jsonl.*line 2.*object"),
])
def test_a_broken_convokit_utterance_is_a_data_error_naming_the_line(tmp_path, damage, where):
    folder = tmp_path / "corpus"
    shutil.copytree(CONVOKIT[0], folder)
    edit(folder / "utterances.jsonl", damage)
    with pytest.raises(DataError, match=where):
        load_p4g(folder)


@pytest.mark.parametrize("name", ["conversations.json", "speakers.json"])
def test_a_broken_convokit_json_file_is_a_data_error_naming_it(tmp_path, name):
    folder = tmp_path / "corpus"
    shutil.copytree(CONVOKIT[0], folder)
    edit(folder / name, lambda s: s[: len(s) // 2])
    with pytest.raises(DataError, match=re.escape(name)):
        load_p4g(folder)


def test_the_environment_passes_data_errors_on(tmp_path):
    folder = copy_csv(tmp_path)
    edit(folder / "full_dialog.csv", lambda s: s.replace(",Unit,", ",Text,", 1))
    with pytest.raises(DataError, match=r"full_dialog\.csv.*Unit"):
        P4GEnv(folder)


def test_anchor_conversations_are_the_real_persuadees_of_the_split_with_their_donation(csv_corpus):
    # --sim-anchor's data: the persuadee's own prompt, the persuader as "user", the real
    # persuadee's messages as trained "assistant" turns, then its recorded donation as a tag
    env = P4GEnv(FIXTURES / "csv", max_turns=2, reward="expected")
    convs = env.anchor_conversations()
    kept = [d for d in csv_corpus.dialogues if d.donation is not None
            and d.persuadee_id in {t.id for t in env.tasks()}]
    assert len(convs) == len(kept) > 0
    for conv, d in zip(convs, kept):
        assert conv[0] == env.partner_messages(next(t for t in env.tasks() if t.id == d.persuadee_id))[0]
        body = conv[1:-2]
        assert [m["content"] for m in body] == [text for _, text in d.messages[:2]]
        assert [m["role"] for m in body] == ["user" if r == "persuader" else "assistant" for r, _ in d.messages[:2]]
        assert conv[-2]["content"] == READOUTS["decision"][0]
        tag = conv[-1]["content"]
        assert parse_donation(tag) == pytest.approx(d.donation)     # the tag states the real gift
    assert len(env.anchor_conversations(turns=4)[0]) == len(convs[0]) + 2


def test_sim_anchor_is_refused_for_a_method_that_trains_no_simulator(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--env", "p4g", "--data", str(FIXTURES / "csv"), "--method",
                        "single", "--sim-anchor", "0.5", "--runs-dir", str(tmp_path)],
                       cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert r.returncode == 2 and "--sim-anchor is for --method cotrain|population" in r.stderr
