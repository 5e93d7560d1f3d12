"""How different the members of a simulator pool are, where it matters (the toy).

Population Co-Training helps only insofar as its snapshots' modes differ (the paper's Lemma
B.9 / Remark B.10): a pool of copies of one collapsed simulator shares that simulator's
exploit. This module measures that, at the histories the exploit passes through:

    reply distributions   each member's, sampled (at the member's own temperature), per
                          persona and history; the real users' and sim-a's for comparison
    exploit value         the value of the collapsed simulators' exploit inside each member
                          (1.0-ish: the member still rewards the upsell; low: it does not)
    pairwise TV           the mean total variation between every two members, and between
                          each member and the frozen, collapsed sim-a

`pool_diversity` returns all of it as one JSON-able dict; the toy logs it at every snapshot
(`experiment.run_arm`), the report plots and summarises it. `fidelity` (toy_models) uses the
same pieces to check a simulator against its world before any RL.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np

from .envs.base import Episode, Turn
from .envs.toy import ACTS, ToyEnv, World, sharpened, total_variation
from .rollout import rollout


class FixedActs:
    """A persuader that plays one fixed act sequence (e.g. the exploit), whatever it hears."""

    def __init__(self, seq):
        self.seq = tuple(seq)

    def respond(self, episodes, env):
        return [Turn("agent", ACTS[self.seq[sum(t.role == "agent" for t in ep.turns)]]) for ep in episodes]


def exploit_histories(world: World, gamma: float) -> list[tuple]:
    """The probe, and the histories the exploit passes through when the gamma-sharpened users
    give their modal reply each time: where a collapsed simulator and the real users differ
    in the way that pays the exploit."""
    seq, sharp = world.exploit(gamma), sharpened(world.reply_dist, gamma)
    histories, h = [(ACTS["probe"],)], ()
    for act in seq:
        h = h + (ACTS[act],)
        histories.append(h)
        r = sharp(0, h)
        h = h + (max(r, key=r.get),)
    return list(dict.fromkeys(histories))


def sampled_replies(speaker, world: World, histories, n: int) -> dict:
    """{(persona, history): {reply: frequency}} from n replies of `speaker` per persona and
    history (one batch each; the speaker's own temperature)."""
    env = ToyEnv(world)
    out = {}
    for history in histories:
        for task in env.tasks():
            batch = [Episode(task=task, group=0, turns=[Turn("agent" if i % 2 == 0 else "partner", u)
                                                        for i, u in enumerate(history)]) for _ in range(n)]
            counts = {}
            for turn in speaker.respond(batch, env):
                counts[turn.text.strip()] = counts.get(turn.text.strip(), 0) + 1 / n
            out[(task.persona, tuple(history))] = counts
    return out


def exact_replies(reply_dist, world: World, histories) -> dict:
    """The same table from an exact reply model (`world.reply_dist`, or a sharpened one)."""
    return {(task.persona, tuple(h)): reply_dist(task.persona, h) for h in histories for task in ToyEnv(world).tasks()}


def mean_tv(a: dict, b: dict) -> float:
    """Mean total variation between two reply tables over their common (persona, history) keys."""
    return float(np.mean([total_variation(a[k], b[k]) for k in a if k in b]))


def exploit_value(speaker, world: World, gamma: float, episodes: int = 64) -> float:
    """The mean reward of the gamma-exploit played against `speaker` (at its own temperature)."""
    env = ToyEnv(world)
    eps = rollout(env, env.tasks(), FixedActs(world.exploit(gamma)), speaker, episodes // len(env.tasks()))
    return float(np.mean([e.reward for e in eps]))


def member_profile(speaker, world: World, gamma: float, n: int = 32) -> dict:
    """What `pool_diversity` needs of one member, JSON-able (computed once per snapshot)."""
    table = sampled_replies(speaker, world, exploit_histories(world, gamma), n)
    return {"exploit_value": exploit_value(speaker, world, gamma),
            "replies": [[p, list(h), d] for (p, h), d in table.items()]}


def _table(profile: dict) -> dict:
    return {(p, tuple(h)): d for p, h, d in profile["replies"]}


def pool_diversity(profiles: dict, reference: dict, world: World, gamma: float) -> dict:
    """Summarise a pool from its members' profiles (`member_profile`).

    profiles: {member name: profile}; reference: sim-a's profile (the frozen, collapsed
    simulator). Returns per member its exploit value and TV to sim-a, to the real users and
    to the exact sharpened users; the pool's mean pairwise TV; and the means over members.
    """
    hs = exploit_histories(world, gamma)
    real, sharp = exact_replies(world.reply_dist, world, hs), exact_replies(sharpened(world.reply_dist, gamma), world, hs)
    ref = _table(reference)
    tables = {name: _table(p) for name, p in profiles.items()}
    members = {name: {"exploit_value": profiles[name]["exploit_value"], "tv_sim_a": mean_tv(t, ref),
                      "tv_real": mean_tv(t, real), "tv_sharpened": mean_tv(t, sharp)}
               for name, t in tables.items()}
    pairs = [mean_tv(tables[a], tables[b]) for a, b in itertools.combinations(tables, 2)]
    mean = lambda key: float(np.mean([m[key] for m in members.values()]))   # noqa: E731
    return {"members": members, "pairwise_tv": float(np.mean(pairs)) if pairs else None,
            "tv_sim_a": mean("tv_sim_a"), "tv_real": mean("tv_real"), "exploit_value": mean("exploit_value"),
            "sim_a_exploit_value": reference["exploit_value"], "sim_a_tv_real": mean_tv(ref, real)}


def at_temperature(speaker, temperature: float):
    """A shallow copy of an LM speaker sampling at another temperature."""
    out = copy.copy(speaker)
    out.temperature = temperature
    return out
