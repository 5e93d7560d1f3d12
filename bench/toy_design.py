"""Checks the toy persuasion world's design with a tabular policy (numpy, no LMs).

Prints the reference values (random, best fixed, best adaptive), the exploit's value on the
real users and inside the gamma-sharpened users, then trains a tabular softmax policy over
histories with the GRPO recipe against several reply models and prints each arm's
real-user value. What the world must show (docs/ARCHIVE.md, "What decided the design"):
  - against the gamma-8-sharpened users, train reward climbs while the real-user value
    ends LOW (the exploit) and entropy collapses;
  - against the un-sharpened users (what Verbalized Sampling recovers: top-k of the true
    distribution, renormalised) or the real users themselves (oracle), the policy ends
    CLEARLY above the best fixed sequence: there is headroom above what VS reaches by luck.

GRPO here: per step 16 groups (4 per persona) of G=8 episodes, z-scored advantages within
a group (population std), clipped ratio (0.2 / 0.28), 2 inner epochs, per-decision mean,
Adam on the logits of each history. A tabular policy shares nothing between histories,
so it is an upper bound on how easily an LM can learn the adaptive strategy.

    python bench/toy_design.py                 # all arms, 3 seeds (about 3 minutes on 1 core)
    python bench/toy_design.py --steps 100 --seeds 1
    python bench/toy_design.py --steps 50 --groups 2 --base 0.6,0.5 --lr 0.05
        # the toy run's budget (50 steps x 8 groups), starting from the LM policy base's acts
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/toy_design.py
from minscope.envs.toy_words import ACT_KEYS, ACTS, BLAND, PERSONAS, canonical_reply  # noqa: E402
from minscope.envs.toy_world import World, sharpened  # noqa: E402
from minscope.toy_models import ToyModelConfig  # noqa: E402


@dataclass
class Config:
    steps: int = 300
    groups_per_persona: int = 4
    group_size: int = 8
    lr: float = 0.02
    eps_low: float = 0.2
    eps_high: float = 0.28
    inner_epochs: int = 2
    gamma: float = 8.0
    eval_every: int = 25
    seeds: int = 3
    skill: float | None = None  # start from the LM policy base's distribution (None: uniform)
    asks: float = 0.5


def vs_reply_model(world: World, k: int = 5):
    """What a perfect Verbalized-Sampling simulator samples from: top-k, renormalised."""
    return lambda persona, history: dict(world.vs_target(persona, history, k))


class TabularPolicy:
    """Softmax over the 7 acts, one logit vector per history; Adam on the logits."""

    def __init__(self, lr: float, prior=None):
        self.lr, self.t, self.prior = lr, 0, prior
        self.logits, self.m, self.v = {}, {}, {}

    def initial_logits(self, history) -> np.ndarray:
        if self.prior is None:
            return np.zeros(len(ACT_KEYS))
        return np.log(self.prior(history))

    def probs(self, history) -> np.ndarray:
        z = self.logits.get(history)
        if z is None:
            z = self.initial_logits(history)
        e = np.exp(z - z.max())
        return e / e.sum()

    def as_function(self):
        return lambda h: dict(zip(ACT_KEYS, self.probs(h)))

    def adam_step(self, grads: dict):
        """Gradient ASCENT on the surrogate for every history in `grads`."""
        self.t += 1
        b1, b2 = 0.9, 0.98
        for h, g in grads.items():
            self.logits.setdefault(h, self.initial_logits(h))
            for d in (self.m, self.v):
                d.setdefault(h, np.zeros(len(ACT_KEYS)))
            self.m[h] = b1 * self.m[h] + (1 - b1) * g
            self.v[h] = b2 * self.v[h] + (1 - b2) * g * g
            mhat, vhat = self.m[h] / (1 - b1 ** self.t), self.v[h] / (1 - b2 ** self.t)
            self.logits[h] += self.lr * mhat / (np.sqrt(vhat) + 1e-8)


def rollout(world, policy, persona, reply_model, rng):
    """One episode: returns (decisions [(history, act index, old prob)], reward, entropies)."""
    history, decisions, ents = (), [], []
    for _ in range(world.n_turns):
        p = policy.probs(history)
        a = rng.choice(len(ACT_KEYS), p=p)
        decisions.append((history, a, p[a]))
        ents.append(-(p * np.log(p + 1e-12)).sum())
        history = history + (ACTS[ACT_KEYS[a]],)
        history = history + (world.sample_reply(persona, history, rng, reply_model),)
    return decisions, world.reward(history), ents


def train(world: World, reply_models, cfg: Config, seed: int):
    """GRPO on a tabular policy; each group draws one member of `reply_models`.
    Returns a dict of curves."""
    rng = np.random.default_rng(seed)
    policy = TabularPolicy(cfg.lr, base_prior(world, cfg.skill, cfg.asks) if cfg.skill is not None else None)
    curves = {"step": [], "real": [], "train": [], "entropy": []}
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0:
            curves["step"].append(step)
            curves["real"].append(world.exact_value(policy.as_function()))
        if step == cfg.steps:
            break
        batch, rewards, ents = [], [], []
        for persona in range(len(PERSONAS)):
            for _ in range(cfg.groups_per_persona):
                model = reply_models[rng.integers(len(reply_models))]
                group = [rollout(world, policy, persona, model, rng) for _ in range(cfg.group_size)]
                r = np.array([g[1] for g in group])
                std = r.std()
                adv = np.zeros_like(r) if std < 1e-6 else (r - r.mean()) / std
                for (decisions, _, e), a in zip(group, adv):
                    batch += [(h, act, p_old, a) for h, act, p_old in decisions]
                    ents += e
                rewards += list(r)
        curves["train"].append(float(np.mean(rewards)))
        curves["entropy"].append(float(np.mean(ents)))
        for _ in range(cfg.inner_epochs):
            grads = {}
            for h, act, p_old, a in batch:
                p = policy.probs(h)
                ratio = p[act] / p_old
                # d/dlogits of min(r A, clip(r) A): zero when the clipped branch is active
                if (a > 0 and ratio > 1 + cfg.eps_high) or (a < 0 and ratio < 1 - cfg.eps_low):
                    continue
                g = -ratio * a * p
                g[act] += ratio * a
                grads[h] = grads.get(h, 0.0) + g / len(batch)
            policy.adam_step(grads)
    return curves


def base_prior(world: World, skill: float, asks: float, blind: str = ToyModelConfig.policy_blind):
    """The LM policy base's act distribution (minscope.toy_models.base_persuader): the best
    adaptive act with probability `skill` (but `blind` after a probe that revealed nothing),
    else an ask with probability `asks`, else another act."""
    table = world.best_adaptive()[1]
    others = [a for a in ACT_KEYS if not a.endswith("_ask")]

    def prior(history):
        p = np.array([(1 - skill) * (asks / 2 if a.endswith("_ask") else (1 - asks) / len(others))
                      for a in ACT_KEYS])
        skilled = table.get(history, "probe")
        if blind and len(history) == 2 and canonical_reply(history[1]) == BLAND:
            skilled = blind
        p[ACT_KEYS.index(skilled)] += skill
        return p
    return prior


def fixed_policy(seq):
    return lambda h: seq[len(h) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=Config.steps)
    ap.add_argument("--seeds", type=int, default=Config.seeds)
    ap.add_argument("--lr", type=float, default=Config.lr)
    ap.add_argument("--groups", type=int, default=Config.groups_per_persona, help="groups per persona per step")
    ap.add_argument("--base", default=None, metavar="SKILL,ASKS",
                    help="start from the LM policy base's act distribution, e.g. 0.6,0.5 (default: uniform)")
    ap.add_argument("--arms", default="single,vs,oracle,ensemble")
    args = ap.parse_args()
    skill, asks = (None, 0.5) if args.base is None else map(float, args.base.split(","))
    cfg = Config(steps=args.steps, seeds=args.seeds, lr=args.lr, groups_per_persona=args.groups,
                 skill=skill, asks=asks)

    world = World()
    sharp = sharpened(world.reply_dist, cfg.gamma)
    t0 = time.time()
    print(f"== reference values (real users, exact; {len(PERSONAS)} personas, {world.n_turns} turns)")
    print(f"random policy          {world.random_value():.3f}")
    v_fixed, seq_fixed = world.best_fixed()
    print(f"best fixed sequence    {v_fixed:.3f}  {' / '.join(seq_fixed)}")
    v_adapt, table = world.best_adaptive()
    print(f"best adaptive policy   {v_adapt:.3f}  (opens with {table[()]}, then the cue's strategy)")
    v_sfix, seq_sfix = world.best_fixed(sharp)
    exploit = fixed_policy(seq_sfix)
    print(f"== inside the gamma-{cfg.gamma:g} sharpened users")
    print(f"exploit = best fixed there: {' / '.join(seq_sfix)}: sharpened {v_sfix:.3f}, real users "
          f"{world.exact_value(exploit):.3f}")
    print(f"best adaptive (real) policy: sharpened {world.exact_value(lambda h: table[h], sharp):.3f}")
    v_sad, sad_table = world.best_adaptive(sharp)
    print(f"best adaptive there          sharpened {v_sad:.3f}, real users "
          f"{world.exact_value(lambda h: sad_table[h]):.3f}  (uses replies the sharpened users almost never give)")
    print(f"random policy                sharpened {world.random_value(sharp):.3f}")
    adaptive = lambda h: table[h]  # noqa: E731
    for gamma in (1, 2, 4, 8):
        s = sharpened(world.reply_dist, gamma)
        print(f"gamma {gamma}: exploit {world.exact_value(exploit, s):.3f} vs best adaptive policy "
              f"{world.exact_value(adaptive, s):.3f} inside; mean TV to real users "
              f"{world.mean_total_variation(s):.3f}")
    print(f"VS top-5 renormalised: mean TV to real users {world.mean_total_variation(vs_reply_model(world)):.3f}")
    print(f"({time.time() - t0:.1f}s)")

    ensemble = [sharpened(w.reply_dist, cfg.gamma) for w in
                (world, World(cue_rate=0.75), World(pressure_yes=0.45, upsell_yes=0.2))]
    arms = {"single": ("RL (Single), sharpened gamma 8", [sharp]),
            "vs": ("VS (top-5 of the true replies, renormalised)", [vs_reply_model(world)]),
            "oracle": ("oracle: trained on the real users", [world.reply_dist]),
            "ensemble": ("ensemble: sharpened default, cue 0.75, pressure+upsell", ensemble)}
    print(f"== tabular GRPO, {cfg.steps} steps, {len(PERSONAS) * cfg.groups_per_persona} groups x "
          f"G={cfg.group_size}, lr {cfg.lr}, {cfg.seeds} seeds; real-user values are exact")
    print(f"{'arm':50s} {'final real':>12s} {'peak real':>10s} {'train end':>9s} {'entropy':>12s}")
    for key in args.arms.split(","):
        label, models = arms[key]
        t = time.time()
        runs = [train(world, models, cfg, seed) for seed in range(cfg.seeds)]
        final = np.array([c["real"][-1] for c in runs])
        peak = np.array([max(c["real"]) for c in runs])
        tr_end = np.array([np.mean(c["train"][-10:]) for c in runs])
        e0 = np.mean([c["entropy"][0] for c in runs])
        e1 = np.mean([np.mean(c["entropy"][-10:]) for c in runs])
        print(f"{label:50s} {final.mean():.3f} ± {final.std():.3f} {peak.mean():10.3f} {tr_end.mean():9.3f} "
              f"{e0:5.2f} -> {e1:4.2f}   ({time.time() - t:.0f}s)")
        print(f"{'':50s} seeds: " + ", ".join(f"{v:.3f}" for v in final))


if __name__ == "__main__":
    main()
