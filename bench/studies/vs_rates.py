"""Verbalized Sampling of a real model: how often its answers parse, are retried, fall back.

The persuadee of Persuasion for Good (the fixture corpus unless --data) is played by the model
through `simulators.Verbalized` (k candidates with probabilities as JSON, `retries` further
attempts, then the raw text as the reply); the persuader is the same model. Prints the
counters of `verbalized.VSStats` and one example answer. The paper reports that small models
cannot verbalize; this measures it rather than tuning the prompt.

    python bench/studies/vs_rates.py --model smollm2    # SmolLM2-135M-Instruct, 8 episodes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from minscope.envs.p4g import P4GEnv  # noqa: E402
from minscope.models import load_model, quiet  # noqa: E402
from minscope.rollout import LMSpeaker, rollout  # noqa: E402
from minscope.simulators import Frozen, Verbalized  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default=str(REPO / "tests" / "fixtures" / "p4g" / "csv"))
    p.add_argument("--episodes", type=int, default=8, help="persuadee turns asked for (one per episode)")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--tokens", type=int, default=40, help="per candidate: the VS answer may be (k+1) x this long")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model)
    env = P4GEnv(args.data, split="all", max_turns=2)          # the persuader opens, the persuadee answers
    tasks = env.tasks()
    policy = LMSpeaker(model, tok, "agent", temperature=args.temperature, max_new_tokens=48)
    vs = Verbalized(Frozen(model, tok, temperature=args.temperature, max_new_tokens=args.tokens),
                    k=args.k, retries=args.retries, seed=args.seed)
    groups = [tasks[i % len(tasks)] for i in range(args.episodes)]
    t0 = time.perf_counter()
    episodes = rollout(env, groups, policy, vs, group_size=1)
    stats = vs.stats.as_dict()
    print(f"{args.model}: {args.episodes} VS requests (k={args.k}, retries={args.retries}, "
          f"{vs.speaker.max_new_tokens} tokens per answer) in {time.perf_counter() - t0:.0f} s")
    print(json.dumps(stats, indent=1))
    gens = stats["requests"] + stats["retries"]
    print(f"parsed {gens - stats['parse_failures']} of {gens} generations; retried {stats['retries']} times; "
          f"{stats['fallbacks']} of {stats['requests']} turns fell back to the raw text "
          f"(fallback rate {stats['fallback_rate']:.2f})")
    reply = episodes[0].turns[1]
    print("an answer as the persuader saw it:", repr(reply.text[:300]))


if __name__ == "__main__":
    main()
