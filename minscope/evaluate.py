"""Evaluation: a policy against a panel of simulators, confidence intervals, pass^k, and the
collapse meter.

The paper evaluates every 16 steps at temperature 0 against a panel of simulators (some
seen in training, some never seen) and keeps the checkpoint with the best panel mean.

The collapse meter estimates the two parts of the within-task reward variance (the
paper's Eq. 6, by the law of total variance):

    Var(R) = E_agent[ Var_sim(R | agent turns) ]  +  E_sim[ Var_agent(R | simulator turns) ] + ...
             └──── simulator-side ────┘             └──── agent-side ────┘

We estimate each part by *replaying* one side's sampled turns verbatim and resampling only
the other side: a mode-collapsed simulator gives near-zero simulator-side variance. We also
estimate the simulator's per-turn mode probability: how often repeated samples at the same
visited history give the same reply. (Replaying is open-loop: the fixed side does not react
to the resampled side. That is the standard way to isolate one source of randomness. Where
the reward is read off the simulator's words — the toy and P4G, whose reward is the donation
the persuadee states — replaying the simulator fixes the reward, so the agent-side term is 0
by construction there; it is informative where the reward depends on the agent's actions,
as in tau2-bench.)
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
    Returns name -> {"kind", "mean", "ci95", "n", "episodes"}; plus "seen"/"unseen" means.
    """
    pol = copy.copy(policy)
    pol.temperature = policy_temperature
    out = {}
    for name, (partner, kind) in panel.items():
        eps = rollout(env, tasks, pol, partner, episodes_per_task)
        out[name] = {"kind": kind, **summarize([e.reward for e in eps]), "episodes": eps}
    for kind in ("seen", "unseen"):
        members = [v["mean"] for v in out.values() if isinstance(v, dict) and v.get("kind") == kind]
        if members:
            out[kind] = {"kind": "group", "mean": float(np.mean(members)), "members": len(members)}
    return out


# --------------------------------------------------------------------------- collapse meter
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


def _replayed(env, refs, fixed_role, fresh, n_resample):
    """Rewards [len(refs), n_resample]: `fixed_role` replayed verbatim, `fresh` resampled."""
    replay = Replay(fixed_role, [[t for t in ep.turns if t.role == fixed_role] for ep in refs])
    agent, partner = (replay, fresh) if fixed_role == "agent" else (fresh, replay)
    eps = rollout(env, [ep.task for ep in refs], agent, partner, n_resample)
    return np.array([e.reward for e in eps]).reshape(len(refs), n_resample)


def collapse_meter(env, policy, partner, tasks, n_ref: int = 2, n_resample: int = 4,
                   n_mode: int = 6) -> dict:
    """Simulator-side vs agent-side reward variance, and the simulator's mode probability.

    For each task: `n_ref` reference episodes; for each, replay the agent's turns and
    resample the simulator `n_resample` times (-> simulator-side variance), and replay the
    simulator's turns and resample the agent (-> agent-side variance). Mode probability:
    at each visited history before a simulator turn, sample the simulator `n_mode` times and
    take the share of the most common reply.
    """
    refs = rollout(env, tasks, policy, partner, n_ref)
    sim_var = _replayed(env, refs, "agent", partner, n_resample).var(axis=1).mean()
    agent_var = _replayed(env, refs, "partner", policy, n_resample).var(axis=1).mean()
    # mode probability at visited histories
    shares = []
    for ep in refs:
        for j, turn in enumerate(ep.turns):
            if turn.role != "partner":
                continue
            copies = [Episode(task=ep.task, group=0, turns=list(ep.turns[:j])) for _ in range(n_mode)]
            if hasattr(partner, "assign"):
                partner.assign(copies)
            replies = [t.text.strip() for t in partner.respond(copies, env)]
            shares.append(Counter(replies).most_common(1)[0][1] / n_mode)
    return {"sim_side_var": float(sim_var), "agent_side_var": float(agent_var),
            "mode_prob": float(np.mean(shares)) if shares else float("nan"),
            # the within-task variance of the reference episodes: what the two parts split
            "total_var": float(np.array([e.reward for e in refs]).reshape(len(tasks), n_ref).var(axis=1).mean())}
