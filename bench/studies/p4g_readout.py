"""Does the P4G readout (`--p4g-reward expected`) separate persuader messages, and personas?

A scripted persuader says one fixed message to each of the first --personas test personas;
the persuadee (SmolLM2 by default, at the training temperature) answers once, and is then
read at both decision points (envs/p4g.py READOUTS): the training readout "decision" and the
held-out "asked" (minscope/readout.py: the expected gift at the persuadee's temperature, to the
dime). Per message it prints the expected gift in dollars (mean over personas, and its standard
deviation over them: how much the persona matters), the probability that the persuadee writes a
readable amount after `[DONATE $` (coverage), the mean gift it sampled there, the parsed reward,
and the share of replies that stated an amount. A reward a policy can learn from should move
with what the message asks, and a persuadee worth training against should answer
differently for different people.

    python bench/studies/p4g_readout.py --data PATH/TO/p4g --personas 8
    python bench/studies/p4g_readout.py --data PATH --adapter runs/RUN/simulator-step20    # a trained persuadee
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

MESSAGES = {
    "mentions $2, asks nothing": "Hi! Hope your day is going well. You earned $2 for this task, nice work.",
    "asks, no amount": "Would you consider donating some of your earnings to Save the Children? It helps kids in need.",
    "asks for $2": "Please donate your full $2 to Save the Children. Every dollar helps a child in need.",
    "asks for $1": "Could you give $1 to Save the Children? Half of your bonus would help a child.",
    "off topic": "What is your favorite movie, and why do you like it?",
    "says keep it": "You don't have to donate anything. Keep your money, that is completely fine.",
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="the Persuasion for Good data (as train.py --data)")
    p.add_argument("--model", default="smollm2", help="the persuadee model (default smollm2)")
    p.add_argument("--personas", type=int, default=8, help="test personas (the first N)")
    p.add_argument("--temperature", type=float, default=0.7, help="the persuadee's sampling temperature")
    p.add_argument("--max-new-tokens", type=int, default=24, help="the persuadee's reply cap (tokens)")
    p.add_argument("--adapter", help="a persuadee adapter saved by a Co-Training run (RUN/simulator-stepN): "
                   "read the trained persuadee instead of the base model")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from minscope.envs.p4g import P4GEnv, Says, words_for_tokens
    from minscope.models import load_model, quiet
    from minscope.real_models import _attach_adapter, adapter_folder
    from minscope.rollout import rollout
    from minscope.simulators import Frozen

    quiet()
    model, tok = load_model(args.model)
    adapter = None
    if args.adapter:
        folder = adapter_folder(args.adapter)
        if folder is None:
            raise SystemExit(f"{args.adapter}: no PEFT adapter there (adapter_config.json)")
        model, adapter = _attach_adapter(model, "persuadee", folder), "persuadee"
    env = P4GEnv(args.data, split="test", max_turns=2, max_words=words_for_tokens(args.max_new_tokens),
                 reward="expected")
    tasks = env.tasks()[: args.personas]
    persuadee = Frozen(model, tok, adapter=adapter, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    print(f"{args.model}{' + ' + args.adapter if adapter else ''} as persuadee, temperature {args.temperature:g}, {args.max_new_tokens} tokens a reply, "
          f"{len(tasks)} test personas, seed {args.seed}; expected gift in dollars: mean over personas "
          "(SD over personas)\n")
    print("| persuader's message | training readout `[DONATE $` | coverage | sampled decision | "
          "held-out readout `I will give $` | parsed reward | stated an amount | s |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for label, text in MESSAGES.items():
        t0 = time.perf_counter()
        eps = rollout(env, tasks, Says([text], per=len(tasks)), persuadee, group_size=1, seed=args.seed)
        seconds = time.perf_counter() - t0
        d = np.array([2 * ep.info["readout_decision"] for ep in eps])
        a = np.array([2 * ep.info["readout_asked"] for ep in eps])
        parsed = np.mean([ep.info["reward_parsed"] for ep in eps])
        stated = np.mean([ep.info["donation_stated"] for ep in eps])
        coverage = np.mean([ep.info["readout_coverage"] for ep in eps])
        sampled = np.mean([2 * ep.info["reward_sampled"] for ep in eps])
        rows[label] = d
        print(f"| {label} | ${d.mean():.2f} ({d.std(ddof=1):.2f}) | {coverage:.2f} | ${sampled:.2f} | "
              f"${a.mean():.2f} ({a.std(ddof=1):.2f}) | {parsed:.2f} | {stated:.2f} | {seconds:.0f} |")
    spread = np.ptp([v.mean() for v in rows.values()])
    within = np.mean([v.std(ddof=1) for v in rows.values()])
    print(f"\ntraining readout: spread of the message means ${spread:.2f}; mean SD over personas ${within:.2f}")


if __name__ == "__main__":
    main()
