"""Toy persuasion: a small explicit model of "real users" with exact reference values.

A persuader (the policy) has `n_turns` (3) short turns to get a donation of up to 2 dollars
from a persuadee. The persuadee population is an explicit stochastic model, so any policy
can be valued exactly, and the ceilings every report shows are computed, not estimated.

  - 4 persona types are the tasks; persona i is won over by strategy i only. The simulator
    is told the persona, the policy is not (as in P4G).
  - 7 persuader acts, each a fixed short utterance (ACTS); any other text is "invalid".
  - 23 persuadee replies (REPLIES), each with a unique FIRST WORD, so that sharpening an
    LM's first token is sharpening the reply distribution.
  - Reward = last stated donation / 2: "yes i give 2 dollars" 1, "sure i give 1 dollar" 0.5,
    "no thanks" / "forget it" / "never mind then" 0 (they state 0), nothing stated 0.

Why this shape: the probe's information is SPREAD over three
phrasings, each less likely than the bland reply, and retractions are spread over three
phrasings, each less likely than "yes", so that the mode is not the mean. Gamma-sharpening
(`sharpened`) deletes the minority replies: the sharpened users never name what they care
about and never take a pledge back, so inside them the upsell beats everything: "probe,
small ask, big ask" (the exploit, 0.99 at gamma 8) while real users give it 0.24, less
than the cautious "probe, small ask, probe" (0.30; 0.50 inside) it grows out of by one
act. ("small ask, big ask, probe": 0.94 inside, 0.18 real, and "big ask x3": 0.88 inside,
0.23 real, are exploits too.) Real users pay for probing and then using the matched
strategy (best adaptive 0.69), far above the best fixed sequence (0.34): the headroom a
method better than Verbalized Sampling needs.

The toy is three files: toy_words.py (the acts, the replies and how text is read as them),
toy_world.py (the real users' reply rules and the exact values of policies), and this one:
the environment the rollout engine plays, and the speakers that play it without an LM (a
scripted persuader, the real users, the sharpened users).
"""

from __future__ import annotations

import numpy as np

from .base import Environment, Episode, Step, Turn, turn_noise
from .toy_words import ACTS, INVALID, REPLIES, donation, text_to_act
from .toy_world import World, sharpened


def history_from_turns(turns) -> tuple[str, ...]:
    """The world's history (alternating agent / partner utterances) from Episode turns."""
    return tuple(t.text for t in turns if t.role in ("agent", "partner"))


# ---------------------------------------------------------------------------- environment

AGENT_PROMPT = "persuade the user to donate up to 2 dollars to save the children"


class ToyEnv(Environment):
    """The toy persuasion task for the rollout engine: persona tasks, agent opens,
    strict alternation, `n_turns` acts each answered, reward = donation / 2."""

    name = "toy"
    agent_name = "persuader"
    partner_name = "persuadee"
    default_simulator_reward = "adversarial"

    def __init__(self, world: World | None = None):
        self.world = world or World()
        self.max_turns = 2 * self.world.n_turns

    def tasks(self, split: str = "train"):
        return list(self.world.tasks)

    def agent_messages(self, task):
        return [{"role": "system", "content": AGENT_PROMPT}]

    def partner_messages(self, task):
        return [{"role": "system", "content": f"you are {task.name}. someone asks you to donate"}]

    def after_turn(self, episode: Episode):
        generated = [t for t in episode.turns if t.role != "env"]
        if len(generated) >= self.max_turns:
            return Step(None)
        return Step("partner" if generated[-1].role == "agent" else "agent")

    def score(self, episode: Episode):
        acts = [text_to_act(t) for t in episode.texts("agent")]
        amount = donation(episode.texts("partner"))
        info = {"acts": acts, "n_invalid": acts.count(INVALID), "donation": amount,
                "probed": "probe" in acts}
        return min(amount / 2.0, 1.0), info

    def sft_conversations(self, transcripts, role: str = "partner") -> list[list[dict]]:
        """Chat conversations for SFT from `sample_transcripts` output, seen by `role`:
        its own utterances are the assistant's, the other side's the user's."""
        prompt = self.partner_messages if role == "partner" else self.agent_messages
        out = []
        for task, turns in transcripts:
            msgs = list(prompt(task))
            msgs += [{"role": "assistant" if speaker == role else "user", "content": text}
                     for speaker, text in turns]
            out.append(msgs)
        return out

    def corpus(self):
        """Every string the game uses, for training a tokenizer."""
        prompts = [AGENT_PROMPT] + [self.partner_messages(t)[0]["content"] for t in self.world.tasks]
        return (list(ACTS.values()) + list(REPLIES)) * 4 + prompts



class ScriptedPersuader:
    """A persuader given by `policy(history, u) -> act key`, u a uniform draw per turn: from
    the episode's fixed noise when it has one (`envs.base.turn_noise`, the collapse meter),
    else from its own generator. A policy that ignores u is deterministic; one that reads u
    through thresholds is a finite mixture of deterministic policies (`World.variance_parts`
    values it exactly)."""
    holds_noise = True

    def __init__(self, policy, seed: int = 0, name: str = "scripted"):
        self.policy, self.rng, self.name = policy, np.random.default_rng(seed), name

    def respond(self, episodes, env=None):
        out = []
        for ep in episodes:
            u = (turn_noise(ep, "agent") or self.rng).random()
            out.append(Turn("agent", ACTS[self.policy(history_from_turns(ep.turns), u)]))
        return out


class RealUsers:
    """The real-user population as a partner: samples each reply from the exact model."""
    name = "real_users"

    def __init__(self, world: World | None = None, seed: int = 0, reply_dist=None):
        self.world = world or World()
        self.reply_dist = reply_dist or self.world.reply_dist
        self.rng = np.random.default_rng(seed)

    def assign(self, episodes):
        for ep in episodes:
            ep.partner_name = self.name

    def respond(self, episodes, env=None):
        out = []
        for ep in episodes:
            history = history_from_turns(ep.turns)
            out.append(Turn(role="partner", text=self.world.sample_reply(ep.task.persona, history, self.rng, self.reply_dist)))
        return out


class SharpenedUsers(RealUsers):
    """The exact gamma-sharpened users (a mode-collapsed simulator without an LM)."""

    def __init__(self, gamma: float = 8.0, world: World | None = None, seed: int = 0):
        world = world or World()
        super().__init__(world, seed, sharpened(world.reply_dist, gamma))
        self.name = f"sharpened_users_g{gamma:g}"
