"""Evaluation: a policy against a panel of simulators, confidence intervals, pass^k, and the
collapse meter.

The paper evaluates every 16 steps at temperature 0 against a panel of simulators (some
seen in training, some never seen) and keeps the checkpoint with the best panel mean.

The collapse meter splits the within-task reward variance into its two sources (the
paper's Eq. 6, the law of total variance with the agent's sampling noise N as the
condition):

    Var(R) = E_N[ Var_sim(R | N) ]  +  Var_N( E_sim[R | N] )
             └─ simulator-side ─┘     └─── agent-side ───┘

It is measured closed loop. For each task we draw `n_ref` seeds of the agent's noise (its
own random stream: the uniforms its sampler turns into tokens, `envs.base.turn_noise`),
and for each seed play `n_resample` episodes in which the agent keeps that noise and the
simulator samples afresh: the agent *reacts* to the simulator's new replies, with the same
draws. That gives a matrix of rewards R[seed, resample]. The simulator-side part is the
mean over seeds of each row's variance; the agent-side part is the variance, over seeds,
of the row means, less the part of it that is resampling noise (row variance /
n_resample), i.e. the unbiased between/within split of a one-way random-effects model.
Both are computed per task and averaged over tasks; every variance is the unbiased one
(ddof = 1), so the two parts add up, in expectation, to the within-task variance
(`total_var`, from the first episode of every row: independent draws of the whole
episode). The agent-side estimate can come out slightly below zero when the true part is
about 0. A mode-collapsed simulator gives near-zero simulator-side variance.

Everything the simulator draws is resampled, its ensemble member, pool snapshot or persona
included: that is simulator randomness too. (Replaying the agent's *turns* verbatim
instead, open loop, conditions on what the agent said, which already depends on the
simulator once the agent reacts: an agent that repeats the simulator's coin reads as all
simulator-side variance though every episode scores the same. `open_loop_meter` keeps that
older measurement under its own name.)

We also estimate the simulator's per-turn mode probability: how often repeated samples at
the same visited history give the same reply, from the simulator that served the episode
(its ensemble member, pool snapshot or persona), so an ensemble or a population is
measured member by member.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections import Counter

import numpy as np
import torch

from .envs.base import Episode, Turn
from .rollout import LMSpeaker, rollout


def bootstrap_ci(values, n_boot: int = 2000, alpha: float = 0.05, seed: int = 0):
    """Percentile bootstrap CI of the mean: (low, high)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(n_boot, v.size))].mean(axis=1)
    return (float(np.quantile(means, alpha / 2)), float(np.quantile(means, 1 - alpha / 2)))


def summarize(values) -> dict:
    lo, hi = bootstrap_ci(values)
    return {"mean": float(np.mean(values)) if len(values) else float("nan"), "ci95": [lo, hi], "n": len(values)}


def pass_hat_k(successes_per_task: list[list[bool]], k: int) -> float:
    """pass^k (tau-bench): the chance that k i.i.d. trials of a task all succeed, averaged
    over tasks, estimated without bias from n >= k trials as C(c, k) / C(n, k)."""
    vals = []
    for trials in successes_per_task:
        n, c = len(trials), sum(bool(t) for t in trials)
        if n < k:
            raise ValueError(f"pass^{k} needs at least {k} trials per task, got {n}")
        vals.append(math.comb(c, k) / math.comb(n, k))
    return float(np.mean(vals))


# --------------------------------------------------------------------------- panel evaluation
@contextlib.contextmanager
def isolated_rng(seed: int, *speakers):
    """Run a block on fresh random streams seeded by `seed`, then put every stream back:
    torch's (CPU and CUDA), numpy's and python's global generators, and the `rng` (and VS
    `stats`) of `speakers`. Training runs evaluate through this, so that evaluating more or
    less often does not change what training samples next, and an evaluation can be
    repeated exactly from the saved policy."""
    saved = random.getstate(), np.random.get_state()
    own = [(s, {a: copy.deepcopy(getattr(s, a)) for a in ("rng", "stats") if hasattr(s, a)}) for s in speakers]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            for s, attrs in own:
                for a, v in attrs.items():
                    setattr(s, a, v)


def eval_seed(seed: int, step: int) -> int:
    """The seed of the evaluation at `step` of the run (or toy arm) with training seed `seed`:
    distinct for every (seed, step) pair of a run shorter than 1,000,003 steps."""
    return 1_000_003 * (seed + 1) + step


def evaluate_panel(env, policy: LMSpeaker, panel: dict, tasks, episodes_per_task: int = 8,
                   policy_temperature: float = 0.0) -> dict:
    """Roll the policy out against every panel member.

    panel: name -> (partner, kind) with kind "seen" | "unseen" | "real".
    Returns name -> {"kind", "mean", "ci95", "se", "n", "episodes"}; plus "seen"/"unseen"
    group means, each with its standard error (the members' independent SEs combined) and a
    normal 95% interval, so that a fall between two evaluations can be read against their
    noise (`monitor`).
    """
    pol = copy.copy(policy)
    pol.temperature = policy_temperature
    out = {}
    for name, (partner, kind) in panel.items():
        eps = rollout(env, tasks, pol, partner, episodes_per_task)
        rewards = [e.reward for e in eps]
        out[name] = {"kind": kind, **summarize(rewards), "se": standard_error(rewards), "episodes": eps}
    for kind in ("seen", "unseen"):
        members = [v for v in out.values() if isinstance(v, dict) and v.get("kind") == kind]
        if members:
            mean = float(np.mean([v["mean"] for v in members]))
            se = float(np.sqrt(sum(v["se"] ** 2 for v in members)) / len(members))
            out[kind] = {"kind": "group", "mean": mean, "members": len(members), "se": se,
                         "ci95": [mean - 1.96 * se, mean + 1.96 * se]}
    return out


def standard_error(values) -> float:
    """The standard error of the mean (ddof = 1); 0 for fewer than two values."""
    v = np.asarray(values, dtype=float)
    return float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else 0.0


# --------------------------------------------------------------------------- collapse meter
class HeldNoise:
    """`agent` with its sampling noise held fixed per row: every episode of group g carries
    seed `seeds[g // per_row]` (`envs.base.turn_noise`). The agent must be able to use it
    (`holds_noise`: LM speakers, and scripted speakers that draw from `turn_noise`)."""

    def __init__(self, agent, seeds, per_row: int):
        if not getattr(agent, "holds_noise", False):
            raise ValueError(f"the collapse meter holds the agent's sampling noise fixed, and {type(agent).__name__} "
                             "cannot (give it holds_noise = True and draw its randomness from envs.base.turn_noise)")
        self.agent, self.seeds, self.per_row = agent, seeds, per_row
        self.name = getattr(agent, "name", "agent")

    def respond(self, episodes, env):
        for ep in episodes:
            ep.info.setdefault("noise", {})["agent"] = int(self.seeds[ep.group // self.per_row])
        return self.agent.respond(episodes, env)


class Replay:
    """A scripted speaker that repeats, turn by turn, what `role` said in reference episodes.

    Episode group g replays reference g (rollout numbers groups by task position)."""

    def __init__(self, role: str, reference: list[list[Turn]]):
        self.role, self.reference, self.name = role, reference, f"replay-{role}"

    def respond(self, episodes, env):
        out = []
        for ep in episodes:
            said = sum(t.role == self.role for t in ep.turns)
            ref = self.reference[ep.group]
            out.append(Turn(self.role, ref[said].text, public=ref[said].public) if said < len(ref)
                       else Turn(self.role, ""))
        return out


class _Pinned:
    """`partner` serving each episode of group g as it served reference episode g: the same
    ensemble member / pool snapshot (`partner_name`) and persona. Without it, `rollout`
    would let the partner draw afresh (and an Ensemble would rotate to another member)."""

    def __init__(self, partner, refs):
        self.partner, self.refs = partner, refs
        self.name = getattr(partner, "name", "partner")

    def assign(self, episodes):
        for ep in episodes:
            _serve_as(ep, self.refs[ep.group])

    def respond(self, episodes, env):
        return self.partner.respond(episodes, env)


def _serve_as(ep: Episode, ref: Episode):
    ep.partner_name = ref.partner_name
    if "persona" in ref.info:
        ep.info["persona"] = ref.info["persona"]


def variance_parts(rewards) -> tuple[float, float]:
    """(simulator-side, agent-side) variance of one task from R [n_ref, n_resample]: the
    rows share the agent's noise, the columns resample the simulator (see module docstring)."""
    r = np.asarray(rewards, dtype=float)
    n_ref, n_resample = r.shape
    if n_ref < 2 or n_resample < 2:
        raise ValueError(f"the collapse meter needs n_ref >= 2 and n_resample >= 2, got {n_ref} and {n_resample}")
    sim_side = r.var(axis=1, ddof=1).mean()
    agent_side = r.mean(axis=1).var(ddof=1) - sim_side / n_resample
    return float(sim_side), float(agent_side)


def _split(rewards, n_tasks: int, n_ref: int, n_resample: int, total) -> dict:
    r = np.asarray(rewards, dtype=float).reshape(n_tasks, n_ref, n_resample)
    parts = np.array([variance_parts(x) for x in r])                     # [tasks, 2]
    total = np.asarray(total, dtype=float).reshape(n_tasks, n_ref)
    return {"sim_side_var": float(parts[:, 0].mean()), "agent_side_var": float(parts[:, 1].mean()),
            # the within-task variance of independent whole episodes: what the two parts split
            "total_var": float(total.var(axis=1, ddof=1).mean())}


def mode_probability(env, partner, refs, n_mode: int) -> float:
    """At each history before a simulator turn of `refs`, sample the simulator `n_mode` times
    (the member that served the episode) and take the share of the most common reply."""
    shares = []
    for ep in refs:
        for j, turn in enumerate(ep.turns):
            if turn.role != "partner":
                continue
            copies = [Episode(task=ep.task, group=0, turns=list(ep.turns[:j])) for _ in range(n_mode)]
            for copy_ in copies:
                _serve_as(copy_, ep)
            replies = [t.text.strip() for t in partner.respond(copies, env)]
            shares.append(Counter(replies).most_common(1)[0][1] / n_mode)
    return float(np.mean(shares)) if shares else float("nan")


def collapse_meter(env, policy, partner, tasks, n_ref: int = 2, n_resample: int = 4,
                   n_mode: int = 6, seed: int | None = None) -> dict:
    """Eq. 6, closed loop: simulator-side vs agent-side reward variance, and the simulator's
    mode probability.

    For each task: `n_ref` seeds of the agent's noise (drawn from numpy's global generator,
    or from `seed`); for each, `n_resample` episodes with the agent on that noise and the
    simulator resampled, each episode its own rollout group (so a population or a persona
    bank draws afresh every episode); the parts come from that matrix (`variance_parts`),
    per task, averaged over tasks. `total_var` uses the first episode of every row. Mode
    probability: `mode_probability` at the histories of those first episodes.
    `policy` must hold its noise fixed (`holds_noise`, see `HeldNoise`).
    """
    n = len(tasks) * n_ref
    seeds = np.random.randint(0, 2**62, size=n) if seed is None else np.random.default_rng(seed).integers(0, 2**62, size=n)
    rows = [t for t in tasks for _ in range(n_ref)]
    eps = rollout(env, [t for t in rows for _ in range(n_resample)], HeldNoise(policy, seeds, n_resample), partner, 1)
    firsts = eps[::n_resample]
    out = _split([e.reward for e in eps], len(tasks), n_ref, n_resample, [e.reward for e in firsts])
    out["mode_prob"] = mode_probability(env, partner, firsts, n_mode)
    return out


def open_loop_meter(env, policy, partner, tasks, n_ref: int = 2, n_resample: int = 4,
                    n_mode: int = 6) -> dict:
    """The older, open-loop split: replay each reference episode's agent turns verbatim and
    resample the simulator that served it (its member and persona pinned). It conditions on
    the agent's *turns*, not its noise, so it is Eq. 6 only for an agent that does not react
    to the simulator; for one that does, the simulator-side part absorbs the agent's
    reaction (an agent repeating the simulator's coin reads 0.25 though every episode scores
    1). Kept to compare with `collapse_meter`, and because it needs nothing of the agent."""
    refs = rollout(env, tasks, policy, partner, n_ref)
    replay = Replay("agent", [[t for t in ep.turns if t.role == "agent"] for ep in refs])
    eps = rollout(env, [ep.task for ep in refs], replay, _Pinned(partner, refs), n_resample)
    out = _split([e.reward for e in eps], len(tasks), n_ref, n_resample, [e.reward for e in refs])
    out["mode_prob"] = mode_probability(env, partner, refs, n_mode)
    return out
