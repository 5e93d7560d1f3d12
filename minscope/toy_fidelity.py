"""The fidelity gate of the toy's tiny simulators: how faithfully each reproduces its world
where the exploit lives, checked before any RL (`experiment._run`) and before tiny models
are shipped (`toy_models.rebuild`). Sharpening by gamma = 8 magnifies every error in the
order of a simulator's replies, so this is measured, not assumed.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from .envs.base import Episode, Turn
from .envs.toy import ToyEnv
from .envs.toy_world import World, sharpened, total_variation
from .simulators import Frozen, Verbalized
from .verbalized import draw
from .verbalized_parse import parse_candidates


def fidelity(simulator, world: World, gamma: float, episodes: int = 64, seed: int = 0,
             vs_simulator=None) -> dict:
    """How faithfully a simulator (a speaker) reproduces its world, where it matters.

    exploit_lm / exploit_exact: the value of the exploit (`World.exploit`: the best fixed act
    sequence inside the sharpened world) inside the gamma-sharpened simulator, sampled vs
    exact (lesson: sharpening magnifies simulator errors, so check this before RL).
    tv: mean total variation between the simulator's reply distribution (sampled at
    temperature 1) and the world's, at the histories the exploit and the probe pass through.
    tv_floor: what a perfect simulator scores there with as many samples (sampling noise).
    It is not small: the tv above is the simulator's error plus about this much.
    vs_tv (with `vs_simulator`): the same, for the distribution its VS answers state.
    """
    from .diversity import at_temperature, exact_replies, exploit_histories, exploit_value, mean_tv, sampled_replies

    env, seq = ToyEnv(world), world.exploit(gamma)
    torch.manual_seed(seed)
    exploit_lm = exploit_value(at_temperature(simulator, 1.0 / gamma), world, gamma, episodes)
    exploit_exact = world.exact_value(lambda h: seq[len(h) // 2], reply_dist=sharpened(world.reply_dist, gamma))
    histories = exploit_histories(world, gamma)
    tables = sampled_replies(at_temperature(simulator, 1.0), world, histories, episodes)
    tv = mean_tv(tables, exact_replies(world.reply_dist, world, histories))
    floor = sampling_tv_floor([world.reply_dist(task.persona, h) for h in histories for task in env.tasks()],
                              episodes)
    out = {"exploit": list(seq), "exploit_lm": exploit_lm, "exploit_exact": exploit_exact, "tv": tv,
           "tv_floor": floor}
    if vs_simulator is not None:
        # the verbalized distribution itself (what the VS draw uses) vs the real users'
        vs = Verbalized(vs_simulator, k=5, seed=seed)
        vs.speaker.temperature = 1.0 / gamma
        vtv, fails = [], 0
        for history in histories:
            for task in env.tasks():
                ep = Episode(task=task, group=0, turns=[Turn("agent" if i % 2 == 0 else "partner", u)
                                                        for i, u in enumerate(history)])
                texts, _, _ = vs.speaker.generate([ep], env)
                cands = parse_candidates(texts[0])
                if not cands:
                    fails += 1
                    continue
                _, dist = draw(cands, random.Random(0))
                stated = {}
                for c, p in zip(cands, dist):
                    stated[c.text.strip()] = stated.get(c.text.strip(), 0.0) + p
                vtv.append(total_variation(world.reply_dist(task.persona, history), stated))
        out.update(vs_tv=float(np.mean(vtv)) if vtv else float("nan"), vs_parse_failures=fails)
    return out


def aligned_fidelity(simulator, world: World, gamma: float, episodes: int = 64, seed: int = 0) -> dict:
    """The fidelity check of an aligned simulator *model* (`ToyModels.aligned`), whose own
    distribution at temperature 1 should be the gamma-sharpened users': the exploit's value
    inside it sampled at temperature 1 against the exact one, and the mean TV between its
    replies and the sharpened users' at the exploit's histories (with the sampling floor)."""
    from .diversity import at_temperature, exact_replies, exploit_histories, exploit_value, mean_tv, sampled_replies

    sharp_world, seq = sharpened(world.reply_dist, gamma), world.exploit(gamma)
    plain = at_temperature(simulator, 1.0)
    torch.manual_seed(seed)
    exploit_lm = exploit_value(plain, world, gamma, episodes)
    histories = exploit_histories(world, gamma)
    exact = exact_replies(sharp_world, world, histories)
    return {"gamma": gamma, "exploit_lm": exploit_lm,
            "exploit_exact": world.exact_value(lambda h: seq[len(h) // 2], reply_dist=sharp_world),
            "tv": mean_tv(sampled_replies(plain, world, histories, episodes), exact),
            "tv_floor": sampling_tv_floor(list(exact.values()), episodes)}


def sampling_tv_floor(dists: list[dict], n: int, reps: int = 400, seed: int = 0) -> float:
    """Mean total variation between each distribution and the empirical distribution of
    n samples from itself (Monte Carlo, on a generator of its own)."""
    rng = np.random.default_rng(seed)
    tvs = []
    for d in dists:
        p = np.array(list(d.values()), dtype=float)
        p /= p.sum()
        freq = rng.multinomial(n, p, size=reps) / n                      # [reps, len(p)]
        tvs.append(0.5 * np.abs(freq - p).sum(axis=1).mean())
    return float(np.mean(tvs))


# Below these, the tiny simulators are too far from their world for the toy to mean anything
# (builds that missed them: exploit worth 0.50 and 0.64 inside sim-a instead of 0.94 and 0.99;
# VS-stated TV 0.13 and 0.09, after which VS policies blew up into invalid text).
MIN_EXPLOIT_SHARE = 0.8      # exploit_lm / exploit_exact
MAX_VS_TV = 0.05


def fidelity_problems(fid: dict) -> list[str]:
    """What fails the fidelity check (an empty list: it passes)."""
    problems = []
    if fid["exploit_lm"] < MIN_EXPLOIT_SHARE * fid["exploit_exact"]:
        problems.append(f"the exploit is worth {fid['exploit_lm']:.3f} inside sim-a, below "
                        f"{MIN_EXPLOIT_SHARE:g} x its exact {fid['exploit_exact']:.3f}")
    a = fid.get("aligned")
    if a and a["exploit_lm"] < MIN_EXPLOIT_SHARE * a["exploit_exact"]:
        problems.append(f"the exploit is worth {a['exploit_lm']:.3f} inside the aligned simulator model, below "
                        f"{MIN_EXPLOIT_SHARE:g} x its exact {a['exploit_exact']:.3f}")
    if "vs_tv" in fid and not fid["vs_tv"] <= MAX_VS_TV:      # nan (nothing parsed) fails too
        problems.append(f"sim-a-vs states a distribution at TV {fid['vs_tv']:.3f} from the real users' "
                        f"(at most {MAX_VS_TV:g})")
    return problems


def fidelity_gate(models, gamma: float = 8.0) -> tuple[dict, list[str]]:
    """The check a run applies before any RL (`experiment._run`): sim-a and sim-a-vs against
    their world, the aligned model against the sharpened users. Returns (figures, problems).
    models: the tiny models (`toy_models.ToyModels`; this module does not import it, since
    toy_models calls this gate when it ships them)."""
    sim, _, world = models.simulator("sim-a")
    vs_sim = Frozen(models.simulator("sim-a-vs")[0], models.tokenizer, max_new_tokens=12)
    fid = fidelity(Frozen(sim, models.tokenizer, max_new_tokens=12), world, gamma, vs_simulator=vs_sim)
    model, world = models.aligned()
    fid["aligned"] = aligned_fidelity(Frozen(model, models.tokenizer, max_new_tokens=12), world,
                                      models.cfg.aligned_gamma)
    return fid, fidelity_problems(fid)
