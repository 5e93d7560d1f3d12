"""What an environment is: the data an episode carries and the hooks the rollout engine calls.

An environment never imports the trainer or the simulators. It says, for a task:
  - what each party is told (`agent_messages`, `partner_messages`: leading chat messages,
    usually one system message; `agent_tools`: JSON tool schemas for the agent's template),
  - who speaks first, and after every turn who speaks next, or that the episode is over
    (`after_turn`, which may also inject environment turns such as tool results),
  - the reward (`score`), and which simulator reward Co-Training uses by default,
  - optionally, a scripted partner of its own (`scripted_partner`): then train.py plays
    that partner instead of a simulator LM (WordGame, Numbers).

Roles inside an episode are always "agent" (the policy being trained), "partner" (the user
simulator, or a second agent in symmetric tasks) and "env" (tool results and other
environment text, never trained on). An env turn is addressed to one party (`Turn.to`; the
agent by default): tool results are private to the party that called the tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Turn:
    role: str                       # "agent" | "partner" | "env"
    text: str                       # what enters the conversation
    token_ids: list[int] | None = None   # exact sampled ids (generated turns only)
    public: bool = True             # False: the partner does not see it (e.g. tool calls)
    meta: dict = field(default_factory=dict)  # e.g. VS candidates, tool name
    to: str | None = None           # env turns: the party it is addressed to (None: the agent)


@dataclass
class Episode:
    task: Any
    group: int                      # index of the rollout group (same task, G samples)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0             # the policy's reward
    sim_reward: float = 0.0         # the simulator's reward (Co-Training)
    info: dict = field(default_factory=dict)
    done: bool = False
    partner_name: str = ""          # which simulator / pool member served this episode

    def texts(self, role: str) -> list[str]:
        return [t.text for t in self.turns if t.role == role]

    def transcript(self, names=("agent", "partner")) -> str:
        label = {"agent": names[0], "partner": names[1], "env": "env"}
        return "\n".join(f"{label[t.role]}: {t.text}" for t in self.turns)


def turn_noise(episode: Episode, role: str) -> np.random.Generator | None:
    """The random stream of `role`'s next turn in `episode` when the episode holds that
    party's sampling noise fixed, else None. The seed is `episode.info["noise"][role]` (set by
    `evaluate.collapse_meter`); the stream depends only on it and on how many turns `role` has
    taken, so episodes that share a seed give the party the same draws turn by turn, whatever
    the other party answered: the party still reacts to what it hears, with the same noise."""
    seed = episode.info.get("noise", {}).get(role)
    if seed is None:
        return None
    return np.random.default_rng([int(seed), sum(t.role == role for t in episode.turns)])


@dataclass
class Step:
    """What the environment says after a turn."""
    next_speaker: str | None        # "agent" | "partner", or None when the episode is over
    inject: list[Turn] = field(default_factory=list)  # env turns appended before the next one


def read_personas(path) -> list[str]:
    """A persona bank from a text file: one persona per paragraph (blank-line separated)."""
    text = Path(path).read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


class Environment:
    """Base class; subclasses override what differs. Defaults: agent opens, strict
    alternation, `max_turns` generated turns in total."""

    name = "base"
    agent_name = "agent"            # display names used in transcripts
    partner_name = "user"
    max_turns = 10
    default_simulator_reward = "adversarial"
    symmetric = False               # both roles are the same kind of player (self-play)
    tasks_are_personas = False      # each task is a user persona already (P4G): no Persona-Guided

    def tasks(self, split: str) -> list[Any]:
        raise NotImplementedError

    def agent_messages(self, task) -> list[dict]:
        return []

    def partner_messages(self, task) -> list[dict]:
        return []

    def agent_tools(self, task) -> list[dict] | None:
        return None

    def partner_tools(self, task) -> list[dict] | None:
        """Tool schemas for the partner's template (symmetric tasks where both parties act)."""
        return None

    def first_speaker(self, task) -> str:
        return "agent"

    def scripted_partner(self):
        """The environment's own partner (a speaker: `respond(episodes, env)`), when it has one;
        train.py then trains the policy against it instead of a simulator LM. None: the partner
        is a simulator LM."""
        return None

    def after_turn(self, episode: Episode) -> Step:
        generated = sum(t.role != "env" for t in episode.turns)
        if generated >= self.max_turns:
            return Step(None)
        last = episode.turns[-1].role
        return Step("partner" if last == "agent" else "agent")

    def score(self, episode: Episode) -> tuple[float, dict]:
        raise NotImplementedError

    def reward_note(self, episode: Episode) -> str | None:
        """One line on why `episode` got its reward, where the text alone does not make it plain
        (shown beside the dialogue in report.html); None: nothing to add."""
        return None


def task_label(task) -> str:
    """A short name of a task for the reports: its id or name, else its text (cut at 40)."""
    for attr in ("id", "name", "task_id"):
        value = getattr(task, attr, None)
        if value is not None:
            return str(value)
    text = " ".join(str(task).split())
    return text if len(text) <= 40 else text[:39] + "…"
