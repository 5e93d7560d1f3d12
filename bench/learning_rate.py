"""The LoRA learning rate of a real model, measured: success on `numbers` before and after GRPO.

For every learning rate and seed, the policy (a fresh rank-8 LoRA on every linear layer)
takes --steps GRPO updates (2 requests x G = 8 a step, temperature 0.7, KL 0.005: train.py's
real-model settings) against the environment's scripted asker; its success rate is measured
on the same fixed evaluation batch (every training request, --per-task episodes each, one
fixed random stream) before and after (`minscope.learning`). Prints one row per run and a
summary per learning rate; --out writes the rows as JSON.

    OMP_NUM_THREADS=1 python bench/learning_rate.py --lrs 1e-5,1e-4,5e-4,1e-3 --seeds 0,1
    OMP_NUM_THREADS=1 python bench/learning_rate.py --lrs 1e-3 --seeds 0 --broken sign   # must not learn

--broken breaks the update on purpose, to see that the check catches it: `sign` flips the
advantages, `mask` puts the loss on the prompt's tokens instead of the sampled ones.

The defaults (4 steps, 12 tokens an answer, 64 evaluation episodes) are those of the CI check,
tests/test_learning_smollm2.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from minscope import learning, methods, trainer  # noqa: E402
from minscope.adapters import add_adapters  # noqa: E402
from minscope.envs.numbers import Numbers  # noqa: E402
from minscope.models import load_model, quiet  # noqa: E402
from minscope.rollout import LMSpeaker  # noqa: E402


def break_update(how: str) -> None:
    """Break the GRPO update on purpose: flip the advantages' sign, or train on the wrong tokens."""
    if how == "sign":
        advantages = methods.group_advantages

        def flipped(rewards, group_size):
            adv, zero_var = advantages(rewards, group_size)
            return -adv, zero_var
        methods.group_advantages = flipped
    else:
        batch_of = trainer.training_batch

        def prompt_tokens(*a, **kw):
            b = batch_of(*a, **kw)
            return dataclasses.replace(b, loss_mask=b.attention_mask[:, 1:].to(b.loss_mask.dtype) * (1 - b.loss_mask))
        trainer.training_batch = prompt_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="policy model (default smollm2)")
    p.add_argument("--lrs", default="1e-5,1e-4,5e-4,1e-3", help="comma-separated learning rates")
    p.add_argument("--seeds", default="0,1", help="comma-separated training seeds")
    p.add_argument("--steps", type=int, default=4, help="GRPO updates per run (default 4, as the CI check)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="tokens per answer")
    p.add_argument("--per-task", type=int, default=16, help="evaluation episodes per request (default 16: 64 in all)")
    p.add_argument("--broken", choices=("sign", "mask"), help="break the update on purpose (see above)")
    p.add_argument("--out", help="write the rows here (JSON)")
    args = p.parse_args(argv)
    print("command: " + shlex.join(["python", "bench/learning_rate.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)
    if args.broken:
        break_update(args.broken)
    quiet()
    env = Numbers()
    model, tok = load_model(args.model)
    model = add_adapters(model, ["policy"])
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=0.7, max_new_tokens=args.max_new_tokens)
    fresh = learning.snapshot(policy)
    tasks = env.tasks("train")
    n = len(tasks) * args.per_task
    before, _ = learning.success_rate(policy, env, tasks, args.per_task)   # the base model: once
    print(f"success before training: {before:.3f} (n = {n}, SE {learning.standard_error(before, n):.3f})", flush=True)
    rows = []
    for lr in map(float, args.lrs.split(",")):
        for seed in map(int, args.seeds.split(",")):
            learning.reset(policy, fresh)
            t0 = time.perf_counter()
            kl = []
            rewards = learning.train(policy, env, args.steps, lr, seed, log=lambda s, m: kl.append(m["kl"]))
            after, eps = learning.success_rate(policy, env, tasks, args.per_task)
            row = dict(broken=args.broken or "", lr=lr, seed=seed, steps=args.steps, before=before, after=after, n=n,
                       train_reward=[round(r, 3) for r in rewards], max_kl=max(kl),
                       seconds=round(time.perf_counter() - t0, 1), sample=[e.turns[-1].text for e in eps[:3]])
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| lr | seed | success before | success after {args.steps} steps | training reward per step | largest KL |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lr']:g} | {r['seed']} | {r['before']:.3f} | {r['after']:.3f} | "
              f"{' '.join(f'{x:.2f}' for x in r['train_reward'])} | {r['max_kl']:.2g} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    main()
