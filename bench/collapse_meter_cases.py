"""The collapse meter on cases whose Eq. 6 split is known exactly: the closed-loop meter
(`evaluate.collapse_meter`) and the older open-loop one (`evaluate.open_loop_meter`) side by
side, against the exact values.

    python bench/collapse_meter_cases.py [--refs 200] [--resamples 8] [--seed 0]

Cases (tests/test_collapse_meter.py checks the same ones):
  echo            the simulator tosses a coin, the agent repeats it; R = 1 when they match.
                  Every episode scores 1: both parts are 0.
  reactive xor    the simulator tosses s, the agent says s xor n (n: its own coin); R = the
                  agent's word xor s = n. All agent-side: sim 0, agent 0.25.
  xor             the agent tosses a, then the simulator s; R = a xor s: sim 0.25, agent 0.
  adaptive        the toy's best adaptive persuader (deterministic) against the real users:
                  agent-side 0, simulator-side = the within-task variance (enumerated).
  noisy adaptive  the same, but each turn with probability 0.3 (its noise) a big ask:
                  both parts, enumerated over the 8 noise cells.
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minscope.envs.base import Step, Turn, turn_noise  # noqa: E402
from minscope.envs.toy import RealUsers, ScriptedPersuader, ToyEnv  # noqa: E402
from minscope.envs.toy_world import World  # noqa: E402
from minscope.evaluate import collapse_meter, open_loop_meter  # noqa: E402


class CoinGame:
    """One turn each, "0" or "1"; `first` speaks first; R = rule(agent's word, partner's word)."""
    max_turns = 2
    name = "coins"

    def __init__(self, rule, first="agent"):
        self.rule, self.first = rule, first

    def tasks(self, split="train"):
        return list(range(4))

    def first_speaker(self, task):
        return self.first

    def after_turn(self, ep):
        return Step(None if len(ep.turns) == 2 else ("partner" if self.first == "agent" else "agent"))

    def score(self, ep):
        said = {t.role: int(t.text) for t in ep.turns}
        return float(self.rule(said["agent"], said["partner"])), {}


class Coin:
    """A fair coin for `role`: from the episode's fixed noise when it has one."""
    holds_noise = True

    def __init__(self, role, seed):
        self.role, self.name, self.rng = role, f"coin-{role}", np.random.default_rng(seed)

    def respond(self, episodes, env):
        return [Turn(self.role, str((turn_noise(ep, self.role) or self.rng).integers(2))) for ep in episodes]


class Reacting:
    """The agent hears the partner's coin s and says f(s, n), n its own coin."""
    holds_noise = True
    name = "reacting"

    def __init__(self, f, seed=0):
        self.f, self.rng = f, np.random.default_rng(seed)

    def respond(self, episodes, env):
        out = []
        for ep in episodes:
            n = int((turn_noise(ep, "agent") or self.rng).integers(2))
            s = int(next(t.text for t in ep.turns if t.role == "partner"))
            out.append(Turn("agent", str(self.f(s, n))))
        return out


def cases(world: World | None = None):
    """name -> (env, agent, partner, exact {sim_side_var, agent_side_var, total_var})."""
    world = world or World()
    table = world.best_adaptive()[1]
    adaptive = lambda h, u: table.get(h) or "probe"                          # noqa: E731
    noisy = lambda h, u: "big_ask" if u < 0.3 else adaptive(h, u)            # noqa: E731
    turns = world.n_turns
    # the noisy persuader's noise cells: per turn, big ask (0.3) or the adaptive act (0.7)
    cells = [(float(np.prod([0.3 if b else 0.7 for b in bits])),
              lambda h, bits=bits: "big_ask" if bits[len(h) // 2] else adaptive(h, None))
             for bits in product((True, False), repeat=turns)]
    env = ToyEnv(world)
    return {
        "echo": (CoinGame(lambda a, s: a == s, first="partner"), Reacting(lambda s, n: s), Coin("partner", 1),
                 {"sim_side_var": 0.0, "agent_side_var": 0.0, "total_var": 0.0}),
        "reactive xor": (CoinGame(lambda a, s: a ^ s, first="partner"), Reacting(lambda s, n: s ^ n), Coin("partner", 1),
                         {"sim_side_var": 0.0, "agent_side_var": 0.25, "total_var": 0.25}),
        "xor": (CoinGame(lambda a, s: a ^ s), Coin("agent", 0), Coin("partner", 1),
                {"sim_side_var": 0.25, "agent_side_var": 0.0, "total_var": 0.25}),
        "adaptive": (env, ScriptedPersuader(adaptive), RealUsers(world, seed=1),
                     world.variance_parts([(1.0, lambda h: adaptive(h, None))])),
        "noisy adaptive": (env, ScriptedPersuader(noisy), RealUsers(world, seed=1), world.variance_parts(cells)),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--refs", type=int, default=200, help="agent-noise seeds (rows) per task")
    p.add_argument("--resamples", type=int, default=8, help="episodes per row")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(f"{'case':15s} {'':10s} {'sim-side':>9s} {'agent-side':>10s} {'sum':>7s} {'total':>7s}")
    t0 = time.time()
    for name, (env, agent, partner, exact) in cases().items():
        np.random.seed(args.seed)
        new = collapse_meter(env, agent, partner, env.tasks(), n_ref=args.refs, n_resample=args.resamples, n_mode=2)
        old = open_loop_meter(env, agent, partner, env.tasks(), n_ref=args.refs, n_resample=args.resamples, n_mode=2)
        for label, m in (("exact", exact), ("closed", new), ("open-loop", old)):
            print(f"{name if label == 'exact' else '':15s} {label:10s} {m['sim_side_var']:9.4f} {m['agent_side_var']:10.4f} "
                  f"{m['sim_side_var'] + m['agent_side_var']:7.4f} {m['total_var']:7.4f}")
    print(f"({args.refs} rows x {args.resamples} episodes per task, 4 tasks; {time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
