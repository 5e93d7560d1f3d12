"""What the P4G reward parser reads in a run's persuadee turns, at the run's own settings.

A training step's episodes are not saved (metrics.jsonl keeps their means: donation_rate,
tagged_turns, stated_turns), so this plays fresh ones the way training does: the run's
config.json rebuilds the environment (its --max-turns, --max-new-tokens), the policy at the
training temperature (its base, or a saved adapter with --checkpoint) and the method's
training simulator (for --method vs, the Verbalized persuadee with its retries and
fallbacks), on the first --tasks training personas. It prints how many persuadee turns hold a
`[DONATE $N]` tag or any amount the parser reads, every such turn with the amount read, and
two episodes in which nothing was stated.

    python bench/studies/p4g_persuadee.py runs/p4g-single --tasks 8 --episodes 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a P4G run folder written by train.py (its config.json is read)")
    p.add_argument("--tasks", type=int, default=8, help="training personas played (the first N)")
    p.add_argument("--episodes", type=int, default=2, help="episodes per persona")
    p.add_argument("--checkpoint", help="a step whose saved policy adapter plays (default: the base model)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from minscope.adapters import load_adapter
    from minscope.envs.p4g_parse import _TAG, parse_donation
    from minscope.evaluate import evaluate_panel
    from minscope.files import read_json
    from minscope.models import quiet
    from minscope.real_args import make_env, setting
    from minscope.real_models import build_real_method
    from minscope.real_eval import pick_checkpoint

    quiet()
    config = Path(args.run_dir) / "config.json"
    if not config.is_file():
        raise SystemExit(f"{args.run_dir}: no config.json there; pass a run folder written by train.py")
    run = argparse.Namespace(**read_json(config))
    temperature = setting(run, "temperature")            # the run's training temperature
    if run.env != "p4g":
        raise SystemExit(f"{args.run_dir} is a {run.env} run; this reads P4G persuadee turns")
    env = make_env(run)
    models, method = build_real_method(run, env, None)
    if args.checkpoint is not None:
        step, folder = pick_checkpoint(Path(args.run_dir), args.checkpoint)
        load_adapter(models.policy_model, "policy", folder)
    torch.manual_seed(args.seed)
    res = evaluate_panel(env, models.policy, {"persuadee": (method.partner, "seen")}, env.tasks("train")[: args.tasks],
                         episodes_per_task=args.episodes, policy_temperature=temperature)
    episodes = res["persuadee"]["episodes"]
    turns = [t.text for ep in episodes for t in ep.turns if t.role == "partner"]
    read = [(t, parse_donation(t)) for t in turns]
    stated = [(t, amount) for t, amount in read if amount is not None]
    print(f"{run.method}, {run.max_turns if getattr(run, 'max_turns', None) else 10} turns of at most "
          f"{run.max_new_tokens} tokens, temperature {temperature}: {len(episodes)} episodes, "
          f"{len(turns)} persuadee turns; with a tag {sum(bool(_TAG.search(t)) for t in turns)}, "
          f"with an amount the parser reads {len(stated)}; mean reward "
          f"{sum(ep.reward for ep in episodes) / max(1, len(episodes)):.3f}")
    for text, amount in stated:
        print(f"--- read as ${amount:.2f}:\n{text}")
    print("=== two episodes in which the persuadee stated no amount:")
    for ep in [e for e in episodes if not e.info.get("donation_stated")][:2]:
        for t in ep.turns:
            print(f"{'persuader' if t.role == 'agent' else 'persuadee'}: {t.text}")
        print("---")


if __name__ == "__main__":
    main()
