"""Persuasion for Good: the agent persuades a simulated crowd worker to donate to charity.

The agent is the persuader and opens the conversation; the simulator (the "partner") is
the persuadee, played from a real participant's survey answers (see p4g_data.py). The
persuadee has just earned $2 and may give any part of it to Save the Children; a gift is
stated as `[DONATE $N]` or `[GIVE $N]`. Reward = min(donation / 2, 1), where the donation
is the last amount the persuadee stated (`episode_donation`), $0 when none was stated.

Choices made here:
  - Episodes always run `max_turns` turns (10: 5 persuader, 5 persuadee; the persuadee
    has the last word). They do not end at the first tag, because the last amount stated
    counts and a persuadee may revise a pledge.
  - `max_words` is a per-message word cap stated in both prompts; the rollout engine's
    per-turn token cap is the hard limit, and train.py states a cap that fits it
    (`words_for_tokens`: a decision tag must fit in a turn). Messages are not cut here, since cutting could
    drop a donation tag at the end of a message.
  - Tasks are persuadee personas (one per user id), split train/test by a hash of the id
    (`persona_split`); held-out evaluation uses `tasks("test")` only.
  - The simulator's Co-Training reward defaults to adversarial (-r_policy), as in the
    paper for this benchmark; Verbalized Sampling, when used, applies to the persuadee.
  - `reward="expected"` (train.py --p4g-reward expected) reads the persuadee instead of
    parsing it: after the dialogue the persuadee that played the episode is asked for its
    decision, its reply is begun with "[DONATE $", and it samples the amount in its own token
    stream (three tokens, trained with its turns: minscope/readout.py). The policy's reward
    is the expected gift under the persuadee's sampling distribution at its temperature, / 2,
    an unreadable answer counting $0 (exact, in float64; lower variance than the sampled gift,
    exactly its expectation), and the persuadee's
    own (Co-Training) reward is built from the gift it sampled (`partner_reward_key`): the
    score-function gradient of its decision needs the reward of the decision it made.
    `reward="sampled"` pays the policy the sampled gift too. The share of the persuadee's
    probability that is a readable amount is logged (readout_coverage), and the expected gift
    given a readable amount (readout_decision_conditional), as diagnostics. A second question in
    other words ("asked": "I will give $") and the parsed reward are logged beside it, never
    trained on: a policy that games the training readout shows reward up and those flat.

The donation parser, which reads a pledge from the persuadee's words (tags, plain language,
echoes), is p4g_parse.py; this file is the environment that pays it.
"""

from __future__ import annotations

from dataclasses import dataclass

from minscope.envs.base import Environment, Episode, Turn
from minscope.envs.p4g_data import load_p4g, persona_split, render_persona
from minscope.envs.p4g_parse import _TAG, MAX_DONATION, episode_donation, is_donation_ask, parse_donation

P4G_REWARDS = ("parsed", "expected", "sampled")
# The readouts of reward="expected"|"sampled": name -> (question, the start of the persuadee's
# answer). "decision" is sampled in the persuadee's stream and pays; "asked" is held out.
READOUTS = {
    "decision": ("The chat is over. State your final decision now, with the tag.", "[DONATE $"),
    "asked": ("Before you go: how many of your $2 will you give to Save the Children?", "I will give $"),
}
DECISION = "decision"
# The floor of a group's reward standard deviation in the advantages' z-score, for the read
# rewards: the reading is to the dime ($0.10 = 0.05 of reward), so a group whose readings differ
# by less is not a signal worth +-1 advantages (grpo.group_advantages; DESIGN_NOTES).
READ_STD_FLOOR = 0.05
REFUSAL = 0.05            # dollars: an episode whose persuadee gives at most this refused (a reading)
MAX_WORDS = 60            # the per-message word limit the prompts state, for long enough turns
TAG_TOKENS = 10           # "[DONATE $0.50]" is 10 tokens for SmolLM2's tokenizer
TOKENS_PER_WORD = 1.3     # chat English is about 1.1 for SmolLM2's tokenizer; some room


def words_for_tokens(max_new_tokens: int | None) -> int:
    """The per-message word limit to state in the prompts when a turn is cut at
    `max_new_tokens` tokens: the words and a `[DONATE $N]` tag must fit, so that a persuadee
    that follows the prompt can state its decision before the cut. MAX_WORDS (60) from 88
    tokens up (train.py's default 128 included), 10 at 24 tokens, never under 3."""
    if not max_new_tokens:
        return MAX_WORDS
    return max(3, min(MAX_WORDS, int((max_new_tokens - TAG_TOKENS) / TOKENS_PER_WORD)))


# ---------------------------------------------------------------------------- prompts

PERSUADER_PROMPT = """\
You are chatting online with another crowd worker. Your goal is to persuade them to donate \
to Save the Children, a charity that helps children in developing countries with health \
care, education and safety. They have just earned $2 for this task. Ask them for a \
specific amount out of that $2 (anything from $0.01 to the full $2), and make clear that \
whatever they pledge is deducted from their $2 payment and passed on to the charity by the \
research team. You open the conversation. Be honest and friendly, keep each message under \
{max_words} words, and remember you have {agent_turns} messages in total."""

PERSUADEE_PROMPT = """\
You are a crowd worker taking part in an online chat study, and you have just earned $2 \
for it. Your chat partner will talk to you about a charity. The $2 is yours: you are free \
to keep all of it, give part of it, or give all of it; whatever you decide to give is \
deducted from your $2. Decide carefully, the way the person described below would, and do \
not give just because you are asked.

About you:
{persona}

If you decide to give, state the amount with a tag, for example [DONATE $0.50] or \
[DONATE $1] (or [GIVE $1]); to give nothing, write [DONATE $0]. If you change your mind, state \
the new amount the same way: the last amount you state counts. Reply as this person would \
in a chat, not as an assistant, and keep each message under {max_words} words."""


# ------------------------------------------------------------------------ environment

@dataclass
class P4GTask:
    id: str                         # the persuadee's user id
    persona: dict                   # clean survey answers (see p4g_data.clean_survey)
    persona_text: str               # render_persona(persona)


class P4GEnv(Environment):
    """Persuasion for Good over the persuadee personas of one split."""

    name = "p4g"
    agent_name = "persuader"
    partner_name = "persuadee"
    default_simulator_reward = "adversarial"
    tasks_are_personas = True       # the paper's Persona-Guided baseline is N/A here

    def __init__(self, data_path, split: str = "train", max_turns: int = 10,
                 max_words: int = MAX_WORDS, test_fraction: float = 0.2, reward: str = "parsed"):
        if reward not in P4G_REWARDS:
            raise ValueError(f"unknown P4G reward {reward!r}; use {' or '.join(P4G_REWARDS)}")
        self.reward = reward
        self.corpus = load_p4g(data_path)   # raises P4GDataNotFound with how to get the data
        self.split = split
        self.max_turns = max_turns
        self.max_words = max_words
        self.test_fraction = test_fraction
        self._tasks = [P4GTask(id=u, persona=self.corpus.surveys[u],
                               persona_text=render_persona(self.corpus.surveys[u]))
                       for u in self.corpus.persuadee_ids()]

    def tasks(self, split: str | None = None) -> list[P4GTask]:
        """Tasks of "train", "test" or "all" (default: the split given at construction)."""
        split = split or self.split
        if split not in ("train", "test", "all"):
            raise ValueError(f"P4G split must be 'train', 'test' or 'all', not {split!r}")
        return [t for t in self._tasks
                if split == "all" or persona_split(t.id, self.test_fraction) == split]

    def agent_messages(self, task: P4GTask) -> list[dict]:
        agent_turns = (self.max_turns + 1) // 2
        return [{"role": "system", "content": PERSUADER_PROMPT.format(
            max_words=self.max_words, agent_turns=agent_turns)}]

    def partner_messages(self, task: P4GTask) -> list[dict]:
        return [{"role": "system", "content": PERSUADEE_PROMPT.format(
            persona=task.persona_text, max_words=self.max_words)}]

    def first_speaker(self, task) -> str:
        return "agent"

    @property
    def decision(self) -> str | None:
        """The readout the persuadee samples in its own stream (rollout.LMSpeaker.read_amount)."""
        return DECISION if self.reward != "parsed" else None

    @property
    def partner_reward_key(self) -> str | None:
        """Where a trained persuadee's reward is built from (methods.train_step): the gift it
        sampled, not the policy's expected reward (whose advantage would not depend on the
        decision the persuadee made)."""
        return "reward_sampled" if self.reward != "parsed" else None

    @property
    def reward_std_floor(self) -> float:
        return READ_STD_FLOOR if self.reward != "parsed" else 0.0

    def readouts(self) -> dict:
        """What the rollout reads of the persuadee after each episode (READOUTS; none when the
        reward is parsed)."""
        return READOUTS if self.reward != "parsed" else {}

    def score(self, episode: Episode) -> tuple[float, dict]:
        instructions = (self.partner_messages(episode.task)[0]["content"] if isinstance(episode.task, P4GTask)
                        else PERSUADEE_PROMPT)
        donation = episode_donation(episode, instructions)
        amount = 0.0 if donation is None else donation
        info = {
            "donation": amount,
            "donation_stated": donation is not None,
            "asks": sum(is_donation_ask(t) for t in episode.texts("agent")),
            "turns": sum(t.role != "env" for t in episode.turns),
            "words": sum(len(t.text.split()) for t in episode.turns if t.role != "env"),
        }
        parsed = min(amount / MAX_DONATION, 1.0)
        if self.reward == "parsed":
            return parsed, info
        reads = episode.info.get("readouts", {})
        if DECISION not in reads:
            raise ValueError(f"--p4g-reward {self.reward}: the episode has no readout of its persuadee")
        info["reward_parsed"] = parsed
        for name, r in reads.items():
            info[f"readout_{name}"] = r["amount"] / MAX_DONATION          # an unreadable answer: $0
            if "conditional" in r:                                        # a diagnostic: given readable
                info[f"readout_{name}_conditional"] = r["conditional"] / MAX_DONATION
        info["readout_coverage"] = reads[DECISION]["coverage"]
        if "asked" in reads:
            info["readout_asked_coverage"] = reads["asked"]["coverage"]
        stated = reads[DECISION].get("stated")
        info["decision_read"] = stated is not None
        info["decision_text"] = reads[DECISION].get("text", "")
        info["reward_sampled"] = (stated or 0.0) / MAX_DONATION     # unreadable: no gift
        return info["readout_decision" if self.reward == "expected" else "reward_sampled"], info

    def readings(self, episodes: list[Episode]) -> dict:
        """With a read reward, the means of every reading of the episodes: the training
        readout (readout_decision: the expected gift / 2, an unreadable answer giving $0), the
        held-out one (readout_asked), the sampled decision (reward_sampled; decision_read: the
        share readable), the probability of a readable amount at each (readout_coverage,
        readout_asked_coverage), the expected gift / 2 given a readable amount at each
        (readout_decision_conditional, readout_asked_conditional: diagnostics) and the parsed
        reward (reward_parsed); {} otherwise."""
        keys = ("reward_parsed", *(f"readout_{name}" for name in READOUTS), "reward_sampled", "decision_read",
                "readout_coverage", "readout_asked_coverage",
                *(f"readout_{name}_conditional" for name in READOUTS))
        out = {}
        for key in keys:
            values = [ep.info[key] for ep in episodes if key in ep.info]
            if values:
                out[key] = sum(values) / len(values)
        # refusals: the share of episodes whose persuadee gives at most REFUSAL dollars, read
        # (the expected gift) and sampled (the decision it wrote)
        for name, key in (("refusal_share", f"readout_{DECISION}"), ("refusal_share_sampled", "reward_sampled")):
            values = [ep.info[key] for ep in episodes if key in ep.info]
            if values:
                out[name] = sum(v * MAX_DONATION <= REFUSAL for v in values) / len(values)
        return out

    def step_metrics(self, episodes: list[Episode]) -> dict:
        """What the reward parser saw in a training step, for metrics.jsonl: the share of
        episodes that gave more than $0 (donation_rate) and that stated any amount, $0
        included (donation_stated); the mean donation in dollars; and per persuadee turn, the
        share holding a `[DONATE $N]`/`[GIVE $N]` tag (tagged_turns) and the share stating
        an amount in any form (stated_turns)."""
        scored = [ep.info for ep in episodes if "donation" in ep.info]
        turns = [t.text for ep in episodes for t in ep.turns if t.role == "partner"]
        out = {}
        if scored:
            n = len(scored)
            out.update(donation_rate=sum(i["donation"] > 0 for i in scored) / n,
                       donation_stated=sum(bool(i["donation_stated"]) for i in scored) / n,
                       donation_mean=sum(i["donation"] for i in scored) / n)
        if turns:
            out.update(tagged_turns=sum(_TAG.search(t) is not None for t in turns) / len(turns),
                       stated_turns=sum(parse_donation(t) is not None for t in turns) / len(turns))
        out.update(self.readings(episodes))
        return out

    def anchor_conversations(self, turns: int | None = None) -> list[list[dict]]:
        """The realism anchor's data (`--sim-anchor`): the corpus's real persuadees of this
        split, as the trained persuadee sees a chat (its persona prompt; the persuader as
        "user", the real persuadee's own messages as "assistant", trained), cut after `turns`
        messages (default max_turns), then the decision question answered with the donation the
        real persuadee made after its whole chat, as a tag ("[DONATE $0.50]"). Dialogues
        without a recorded donation or a survey are left out."""
        personas = {t.id: t for t in self.tasks()}
        question = READOUTS[DECISION][0]
        out = []
        for d in self.corpus.dialogues:
            task = personas.get(d.persuadee_id)
            if task is None or d.donation is None:
                continue
            conv = self.partner_messages(task)
            for role, text in d.messages[:turns or self.max_turns]:
                conv.append({"role": "user" if role == "persuader" else "assistant", "content": text})
            amount = f"{d.donation:.2f}".rstrip("0").rstrip(".") if d.donation % 1 == 0 else f"{d.donation:.2f}"
            conv += [{"role": "user", "content": question}, {"role": "assistant", "content": f"[DONATE ${amount}]"}]
            out.append(conv)
        return out


# ------------------------------------------------------------------- the probe set
# Fixed persuader messages read at every evaluation of a run that trains its persuadee, so a
# persuadee that learns to refuse everything (the adversary's easiest optimum), or only the
# messages that write an amount for it to copy, is seen (runner.evaluate_and_save, the report).
PROBE_MESSAGES = {
    "asks for $2": "Please donate your full $2 to Save the Children. Every dollar helps a child in need.",
    "asks for $1": "Could you give $1 to Save the Children? Half of your bonus would help a child.",
    "asks, no amount": "Would you consider donating some of your earnings to Save the Children? It helps kids in need.",
    "off topic": "What is your favorite movie, and why do you like it?",
}
PROBE_PERSONAS = 2


class Says:
    """A scripted persuader: episode group g hears messages[g // per] (one message per block of
    `per` personas)."""

    holds_noise = False

    def __init__(self, messages: list[str], per: int = 1):
        self.messages, self.per = messages, per

    def respond(self, episodes, env):
        return [Turn("agent", self.messages[ep.group // self.per]) for ep in episodes]


def probe(env: "P4GEnv", persuadees: dict, messages: dict = PROBE_MESSAGES, personas: int = PROBE_PERSONAS,
          seed: int = 0) -> dict:
    """{persuadee name: {message label: expected gift in dollars, mean over the first `personas`
    test personas}}: each message is said once, the persuadee answers once and is read
    (`readouts`: its decision). One rollout per persuadee, all messages in one batch."""
    import copy

    from minscope.rollout import rollout

    probe_env = copy.copy(env)
    probe_env.max_turns, probe_env.reward = 2, "expected"
    tasks = probe_env.tasks("test")[:personas] or probe_env.tasks("all")[:personas]
    labels = list(messages)
    out = {}
    for name, speaker in persuadees.items():
        eps = rollout(probe_env, [t for _ in labels for t in tasks], Says([messages[k] for k in labels], len(tasks)),
                      speaker, group_size=1, seed=seed)
        out[name] = {label: sum(MAX_DONATION * ep.info["readout_decision"] for ep in eps[i * len(tasks):(i + 1) * len(tasks)])
                     / len(tasks) for i, label in enumerate(labels)}
    return out
