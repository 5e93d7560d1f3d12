"""How different the members of a simulator pool are, where it matters (the toy).

Population Co-Training helps only insofar as its snapshots' modes differ (the paper's Lemma
B.9 / Remark B.10): a pool of copies of one collapsed simulator shares that simulator's
exploit. This module measures that, at the probe and along every exploit the trained
policies end on (`EXPLOITS`: the upsell "probe, small ask, big ask", "big ask, small ask,
big ask", "small ask, big ask, probe", "big ask x3"):

    reply distributions   each member's, sampled (at the member's own temperature), per
                          persona and history; the real users' and sim-a's for comparison
    exploit values        the value of each exploit inside each member (1.0-ish: the member
                          still pays for it; low: it does not); `exploit_value` is the upsell's
    cue rate              P(own cue | probe): how often a probe makes the member name what
                          its persona cares about (real users 0.60, a collapsed simulator
                          0.00): the information channel that real-user reward needs
    pairwise TV           the mean total variation between every two members, and between
                          each member and the frozen, collapsed sim-a
    noise floor           the TV two *identical* members show at the same number of sampled
                          replies (n per persona and history): a sampled table is never
                          exact, so TV between samples is never 0. `pairwise_floor` is the
                          members' mean floor (each the expected TV between two independent
                          n-samples of it, parametric bootstrap from its own table) and
                          `pairwise_tv_excess` = pairwise TV - floor, overall and per exploit
                          (`excess_by`). The excess is ~0 for copies; for members that differ
                          it under-reads their TV by at most the floor (E TV(samples) >= TV).

`pool_diversity` returns all of it as one JSON-able dict; the toy logs it at every snapshot
(`experiment.run_arm`), the report plots and summarises it. `fidelity` (toy_models) uses the
same pieces to check a simulator against its world before any RL.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np

from .envs.base import Episode, Turn
from .envs.toy import ToyEnv
from .envs.toy_words import ACTS
from .envs.toy_world import World, sharpened, total_variation
from .rollout import rollout


class FixedActs:
    """A persuader that plays one fixed act sequence (e.g. the exploit), whatever it hears."""

    def __init__(self, seq):
        self.seq = tuple(seq)

    def respond(self, episodes, env):
        return [Turn("agent", ACTS[self.seq[sum(t.role == "agent" for t in ep.turns)]]) for ep in episodes]


class GroupActs:
    """A persuader that plays, in every episode of rollout group g, the act sequence
    `seqs[g]`: several fixed sequences played in one batched rollout."""

    def __init__(self, seqs):
        self.seqs = [tuple(s) for s in seqs]

    def respond(self, episodes, env):
        return [Turn("agent", ACTS[self.seqs[ep.group][sum(t.role == "agent" for t in ep.turns)]])
                for ep in episodes]


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


def exploits(world: World, gamma: float) -> dict:
    """name -> act sequence of every exploit `pool_diversity` follows: the sharpened users'
    own (the upsell, at gamma 8) and its siblings the co-trained policies end on."""
    out = {"upsell": tuple(world.exploit(gamma))}
    for name, seq in EXPLOITS.items():
        if seq not in out.values():
            out[name] = seq
    return out


EXPLOITS = {"big_small_big": ("big_ask", "small_ask", "big_ask"),
            "small_big_probe": ("small_ask", "big_ask", "probe"),
            "big_x3": ("big_ask", "big_ask", "big_ask")}


def _modal_path(world: World, gamma: float, seq) -> list[tuple]:
    """The histories `seq` passes through when the gamma-sharpened users give their modal
    reply each time (persona 0)."""
    sharp, histories, h = sharpened(world.reply_dist, gamma), [], ()
    for act in seq:
        h = h + (ACTS[act],)
        histories.append(h)
        r = sharp(0, h)
        h = h + (max(r, key=r.get),)
    return histories


def diversity_histories(world: World, gamma: float) -> dict:
    """name -> histories: "probe" (the opening probe), and the modal path of every exploit."""
    out = {"probe": [(ACTS["probe"],)]}
    out.update({name: _modal_path(world, gamma, seq) for name, seq in exploits(world, gamma).items()})
    return out


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


def sequence_value(speaker, world: World, seq, episodes: int = 64) -> float:
    """The mean reward of the fixed act sequence `seq` played against `speaker`."""
    env = ToyEnv(world)
    eps = rollout(env, env.tasks(), FixedActs(seq), speaker, episodes // len(env.tasks()))
    return float(np.mean([e.reward for e in eps]))


def sequence_values(speaker, world: World, seqs: dict, episodes: int = 64) -> dict:
    """name -> `sequence_value` of every act sequence in `seqs`, all played in ONE batched
    rollout (group g of the rollout plays its sequence against persona g mod #personas)."""
    env = ToyEnv(world)
    tasks = env.tasks()
    names = list(seqs)
    per = episodes // len(tasks)
    eps = rollout(env, [t for _ in names for t in tasks], GroupActs([seqs[name] for name in names for _ in tasks]),
                  speaker, per)
    block = per * len(tasks)
    return {name: float(np.mean([e.reward for e in eps[i * block:(i + 1) * block]])) for i, name in enumerate(names)}


def member_profile(speaker, world: World, gamma: float, n: int = 32, episodes: int = 64) -> dict:
    """What `pool_diversity` needs of one member, JSON-able (computed once per snapshot):
    its sampled reply table at every `diversity_histories` history (n replies each), the
    value of every exploit inside it, and n (for the noise floor). Every exploit is played
    in one batched rollout (fewer calls). The tables stay one call per persona and history:
    one call for all of them was no faster (their cost is prefilling the same prompt n times,
    not the calls). Draws from torch's global generator: the callers run it on a stream of
    its own (`evaluate.isolated_rng`)."""
    histories = list(dict.fromkeys(h for hs in diversity_histories(world, gamma).values() for h in hs))
    table = sampled_replies(speaker, world, histories, n)
    values = sequence_values(speaker, world, exploits(world, gamma), episodes)
    return {"exploit_value": values["upsell"], "exploit_values": values, "n": n,
            "replies": [[p, list(h), d] for (p, h), d in table.items()]}


def _table(profile: dict) -> dict:
    return {(p, tuple(h)): d for p, h, d in profile["replies"]}


def cue_rate(table: dict) -> float | None:
    """P(own cue | probe), averaged over personas, from a reply table (None without the probe)."""
    from .envs.toy_words import CUES

    rates = [sum(d.get(c, 0.0) for c in CUES[p]) for (p, h), d in table.items() if h == (ACTS["probe"],)]
    return float(np.mean(rates)) if rates else None


def sampling_floor(dist: dict, n: int, reps: int = 200, seed: int = 0) -> float:
    """The expected TV between two independent n-samples of `dist` (Monte Carlo, a
    generator of its own): what two identical members read at n replies."""
    p = np.array([v for v in dist.values() if v > 0], dtype=float)
    if p.size <= 1 or n <= 0:
        return 0.0
    draws = np.random.default_rng(seed).multinomial(n, p / p.sum(), size=(reps, 2)) / n
    return float(0.5 * np.abs(draws[:, 0] - draws[:, 1]).sum(axis=1).mean())


def table_floor(table: dict, n: int | None, keys=None) -> float | None:
    """The mean `sampling_floor` over a table's (persona, history) keys (or `keys`)."""
    if not n:
        return None
    keys = [k for k in (table if keys is None else keys) if k in table]
    return float(np.mean([sampling_floor(table[k], n) for k in keys])) if keys else None


def pool_diversity(profiles: dict, reference: dict, world: World, gamma: float) -> dict:
    """Summarise a pool from its members' profiles (`member_profile`).

    profiles: {member name: profile}; reference: sim-a's profile (the frozen, collapsed
    simulator). Returns per member its exploit value and TV to sim-a, to the real users and
    to the exact sharpened users; the pool's mean pairwise TV; and the means over members.
    """
    groups = diversity_histories(world, gamma)
    hs = list(dict.fromkeys(h for g in groups.values() for h in g))
    real, sharp = exact_replies(world.reply_dist, world, hs), exact_replies(sharpened(world.reply_dist, gamma), world, hs)
    ref = _table(reference)
    tables = {name: _table(p) for name, p in profiles.items()}
    members = {name: {"exploit_value": profiles[name]["exploit_value"],
                      "exploit_values": profiles[name].get("exploit_values"), "cue_rate": cue_rate(t),
                      "floor": table_floor(t, profiles[name].get("n")), "tv_sim_a": mean_tv(t, ref),
                      "tv_real": mean_tv(t, real), "tv_sharpened": mean_tv(t, sharp)}
               for name, t in tables.items()}
    pairs = list(itertools.combinations(tables, 2))
    mean = lambda key: _mean([m[key] for m in members.values()])   # noqa: E731
    out = {"members": members, "pairwise_tv": _mean([mean_tv(tables[a], tables[b]) for a, b in pairs]),
           "tv_sim_a": mean("tv_sim_a"), "tv_real": mean("tv_real"), "exploit_value": mean("exploit_value"),
           "cue_rate": mean("cue_rate"), "real_cue_rate": cue_rate(real),
           "sim_a_exploit_value": reference["exploit_value"], "sim_a_cue_rate": cue_rate(ref),
           "sim_a_tv_real": mean_tv(ref, real)}
    out["exploit_values"] = {name: _mean([(m["exploit_values"] or {}).get(name) for m in members.values()])
                             for name in exploits(world, gamma)}
    out["pairwise_floor"] = _mean([_mean([members[a]["floor"], members[b]["floor"]], strict=True) for a, b in pairs],
                                  strict=True)
    out["pairwise_tv_excess"] = _minus(out["pairwise_tv"], out["pairwise_floor"])
    # the same split per exploit's histories (and the probe's): where the members differ
    out["excess_by"] = {}
    for group, group_hs in groups.items():
        keys = [(task.persona, tuple(h)) for h in group_hs for task in ToyEnv(world).tasks()]
        sub = {name: {k: t[k] for k in keys if k in t} for name, t in tables.items()}
        tv = _mean([mean_tv(sub[a], sub[b]) for a, b in pairs])
        floor = _mean([_mean([table_floor(sub[x], profiles[x].get("n")) for x in (a, b)], strict=True)
                       for a, b in pairs], strict=True)
        out["excess_by"][group] = _minus(tv, floor)
    return out


def _mean(values, strict: bool = False):
    """The mean of the values that are not None (strict: None if any is None); None if none."""
    if strict and any(v is None for v in values):
        return None
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def _minus(a, b):
    return None if a is None or b is None else float(a - b)


def at_temperature(speaker, temperature: float):
    """A shallow copy of an LM speaker sampling at another temperature."""
    out = copy.copy(speaker)
    out.temperature = temperature
    return out
