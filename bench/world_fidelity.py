"""Which tiny-model settings let a toy world's training simulator (sim-a) pass the fidelity
gate: sim-a alone is trained per setting (cached like every toy model) and checked as a run
checks it, the exploit's value inside it at temperature 1/gamma and its TV to the real users,
with 64 episodes (the gate's) and 256 (less noise). No arm runs: a world's model settings are
chosen on the models alone (docs/RESULTS.md).

    python bench/world_fidelity.py --world distortion '{"sim_a_steps": 3000}' \\
        '{"sim_a_steps": 3000, "transcripts": 6000}'

Each argument is a JSON object of ToyModelConfig fields over the defaults (`{}`: the defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="+", help="JSON objects of ToyModelConfig fields, e.g. '{\"sim_a_steps\": 3000}'")
    p.add_argument("--world", default="distortion", help="a world of minscope/envs/toy_world.py WORLDS")
    p.add_argument("--gamma", type=float, default=8.0)
    p.add_argument("--cache-dir", default=".cache/minscope")
    args = p.parse_args(argv)

    import torch

    from minscope.models import quiet
    from minscope.simulators import Frozen
    from minscope.toy_fidelity import MIN_EXPLOIT_SHARE, fidelity
    from minscope.toy_models import ToyModelConfig, ToyModels

    quiet()
    torch.set_num_threads(1)
    print(f"{'settings':46s} {'upsell inside sim-a (64 / 256 eps)':>34s} {'exact':>6s} {'TV (floor)':>14s}  gate")
    for spec in args.settings:
        over = json.loads(spec)
        cfg = replace(ToyModelConfig(world_name=args.world), **over)
        t0 = time.time()
        models = ToyModels(args.cache_dir, cfg, progress=False, shipped=None, log=lambda *a: None)
        sim = Frozen(models.get("sim-a"), models.tokenizer, max_new_tokens=12)
        fid = {n: fidelity(sim, models.world(), args.gamma, episodes=n) for n in (64, 256)}
        ok = fid[64]["exploit_lm"] >= MIN_EXPLOIT_SHARE * fid[64]["exploit_exact"]
        print(f"{json.dumps(over):46s} {fid[64]['exploit_lm']:>16.3f} / {fid[256]['exploit_lm']:.3f}"
              f"{fid[64]['exploit_exact']:>13.3f} {fid[64]['tv']:>7.3f} ({fid[64]['tv_floor']:.3f})  "
              f"{'passes' if ok else 'fails'}   [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
