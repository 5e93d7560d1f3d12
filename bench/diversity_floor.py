"""The noise floor of pool diversity: pairs of *identical* members (the exact gamma-sharpened
users, two generators) profiled with n sampled replies each, read by `pool_diversity`. The
raw pairwise TV is all sampling noise; the excess above the floor should be ~0.

    python bench/diversity_floor.py [--replies 32] [--pairs 8] [--gammas 1,2,4,8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from minscope.diversity import member_profile, pool_diversity  # noqa: E402
from minscope.envs.toy import SharpenedUsers  # noqa: E402
from minscope.envs.toy_world import World  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=int, default=32, help="sampled replies per persona and history (the toy's default)")
    p.add_argument("--pairs", type=int, default=8, help="independent pairs per gamma")
    p.add_argument("--gammas", default="1,2,4,8", help="sharpening of the identical members")
    p.add_argument("--histories-gamma", type=float, default=8.0, help="the exploits' gamma (the toy's)")
    args = p.parse_args(argv)
    world, g0, t0 = World(), args.histories_gamma, time.time()
    reference = member_profile(SharpenedUsers(g0, world, seed=0), world, g0, args.replies, episodes=16)
    print(f"identical members, {args.replies} replies, {args.pairs} pairs per gamma: mean (SD over pairs)")
    for gamma in (float(g) for g in args.gammas.split(",")):
        rows = []
        for k in range(args.pairs):
            pair = {f"m{s}": member_profile(SharpenedUsers(gamma, world, seed=100 * k + s), world, g0, args.replies,
                                            episodes=16) for s in (1, 2)}
            d = pool_diversity(pair, reference, world, g0)
            rows.append([d["pairwise_tv"], d["pairwise_floor"], d["pairwise_tv_excess"]])
        r = np.array(rows)
        sd = r.std(axis=0, ddof=1) if len(r) > 1 else np.zeros(3)
        print(f"gamma {gamma:g}: raw pairwise TV {r[:, 0].mean():.3f} ({sd[0]:.3f}), floor {r[:, 1].mean():.3f}, "
              f"excess {r[:, 2].mean():+.3f} ({sd[2]:.3f})")
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
