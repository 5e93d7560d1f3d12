"""Evaluation: a policy against a panel of simulators, confidence intervals, pass^k, and the
collapse meter.

The paper evaluates every 16 steps at temperature 0 against a panel of simulators (some
seen in training, some never seen) and keeps the checkpoint with the best panel mean.

The collapse meter splits the within-task reward variance into its two sources (the
paper's Eq. 6, the law of total variance with the agent's turns A as the condition):

    Var(R) = E_A[ Var_sim(R | A) ]  +  Var_A( E_sim[R | A] )
             └─ simulator-side ─┘     └─── agent-side ───┘

For each task we sample `n_ref` reference episodes (draws of A), and for each of them we
*replay* the agent's turns verbatim and resample the simulator `n_resample` times, which
gives a matrix of rewards R[ref, resample]. The simulator-side part is the mean over
references of each row's variance; the agent-side part is the variance, over references,
of the row means, less the part of it that is resampling noise (row variance /
n_resample), i.e. the unbiased between/within split of a one-way random-effects model.
Both are computed per task and averaged over tasks; every variance is the unbiased one
(ddof = 1), so the two parts add up, in expectation, to the within-task variance of the
reference episodes (`total_var`). The agent-side estimate can come out slightly below
zero when the true part is about 0. A mode-collapsed simulator gives near-zero
simulator-side variance. (Replaying is open-loop: the replayed agent does not react to the
resampled simulator. That is the standard way to isolate one source of randomness.)

We also estimate the simulator's per-turn mode probability: how often repeated samples at
the same visited history give the same reply. Every resample and repeat is served by the
simulator that served the reference episode (its ensemble member, pool snapshot or
persona), so an ensemble or a population is measured member by member.
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


def _replayed(env, refs, partner, n_resample):
    """Rewards [len(refs), n_resample]: the agent's turns of each reference replayed
    verbatim, the simulator that served it resampled."""
    replay = Replay("agent", [[t for t in ep.turns if t.role == "agent"] for ep in refs])
    eps = rollout(env, [ep.task for ep in refs], replay, _Pinned(partner, refs), n_resample)
    return np.array([e.reward for e in eps]).reshape(len(refs), n_resample)


def variance_parts(rewards) -> tuple[float, float]:
    """(simulator-side, agent-side) variance of one task from R [n_ref, n_resample]: the
    rows share the agent's turns, the columns resample the simulator (see module docstring)."""
    r = np.asarray(rewards, dtype=float)
    n_ref, n_resample = r.shape
    if n_ref < 2 or n_resample < 2:
        raise ValueError(f"the collapse meter needs n_ref >= 2 and n_resample >= 2, got {n_ref} and {n_resample}")
    sim_side = r.var(axis=1, ddof=1).mean()
    agent_side = r.mean(axis=1).var(ddof=1) - sim_side / n_resample
    return float(sim_side), float(agent_side)


def collapse_meter(env, policy, partner, tasks, n_ref: int = 2, n_resample: int = 4,
                   n_mode: int = 6) -> dict:
    """Simulator-side vs agent-side reward variance, and the simulator's mode probability.

    For each task: `n_ref` reference episodes; for each, replay the agent's turns and
    resample the simulator `n_resample` times; the parts come from that matrix
    (`variance_parts`), per task, averaged over tasks. Mode probability: at each visited
    history before a simulator turn, sample the simulator `n_mode` times (the member that
    served the episode) and take the share of the most common reply.
    """
    refs = rollout(env, tasks, policy, partner, n_ref)
    rewards = _replayed(env, refs, partner, n_resample).reshape(len(tasks), n_ref, n_resample)
    parts = np.array([variance_parts(r) for r in rewards])                # [tasks, 2]
    # mode probability at visited histories
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
    return {"sim_side_var": float(parts[:, 0].mean()), "agent_side_var": float(parts[:, 1].mean()),
            "mode_prob": float(np.mean(shares)) if shares else float("nan"),
            # the within-task variance of the reference episodes: what the two parts split
            "total_var": float(np.array([e.reward for e in refs]).reshape(len(tasks), n_ref).var(axis=1, ddof=1).mean())}
