"""minscope: train policies against user simulators and watch simulator collapse happen.

With no arguments this runs the toy persuasion experiment offline, on the CPU (also where
there is a GPU: its models are 64 wide, one process per core suits them): tiny
language models are trained from scratch and cached, then Base, RL (Single), Verbalized
Sampling, Ensemble, Co-Training, Population Co-Training and an oracle arm are trained for
3 seeds each (plus four Co-Training variants, seed 0) and evaluated on a held-out panel:
about 20 minutes on 2 CPU cores the first time, 14 once the tiny models are cached; Ctrl-C
loses at most one step (--resume continues). Results land in runs/<name>/ (report.md,
results.json, plots). `--quick` runs the same code path in about two minutes (1 seed,
4 arms, small models: a smoke run, too small to show the effect).

Real models and benchmarks:
    python train.py --env p4g --data PATH --policy Qwen/Qwen3-1.7B --simulator Qwen/Qwen3-1.7B --method vs
    python train.py --env tau2 --domain retail --policy ... --simulator ... --method population
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields, replace
from pathlib import Path

from minscope.models import quiet

quiet()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="toy", choices=["toy", "p4g", "tau2", "wordgame"],
                   help="environment (default: the built-in toy persuasion experiment)")
    p.add_argument("--quick", action="store_true", help="toy: a ~2 minute smoke run of the same code path (too small to show the effect)")
    p.add_argument("--name", help="run name: results go to RUNS_DIR/NAME (default: toy / toy-quick / env-method)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its saved state")
    p.add_argument("--runs-dir", default="runs", help="where runs are written (default: runs)")
    p.add_argument("--cache-dir", default=".cache/minscope", help="toy: where the tiny models are cached")
    p.add_argument("--methods", help="toy: comma-separated arms (default: all). Choices: "
                   "base,single,vs,ensemble,cotrain,population,oracle")
    p.add_argument("--ablations", help="toy: comma-separated Co-Training variants run with seed 0 "
                   "(default: cotrain:adversarial,cotrain:anchor,population:anchor; "
                   "none when --methods is given; 'none' for none). Variants after the colon: "
                   "adversarial|cooperative|curriculum (simulator reward), anchor (realism anchor: "
                   "BC on real transcripts), group|batch (simulator baseline; default group-wise, "
                   "batch-wide for curriculum, which group refuses), joined by '+'")
    p.add_argument("--seeds", help="toy: comma-separated seeds (default: 0,1,2)")
    p.add_argument("--steps", type=int, help="policy updates per arm")
    p.add_argument("--workers", type=int, help="toy: arms trained in parallel processes, one CPU "
                   "thread each (default 2; use the number of cores)")
    # real models
    p.add_argument("--method", default="single", help="real env: single|vs|ensemble|persona|cotrain|"
                   "population|selfplay|population-selfplay")
    p.add_argument("--personas", help="--method persona: a text file of simulator personas, one per "
                   "paragraph (default: the environment's bank; tau2: minscope/envs/personas.txt)")
    p.add_argument("--data", help="p4g: path to the Persuasion for Good data (CSV release or ConvoKit dir)")
    p.add_argument("--domain", default="retail", help="tau2: mock | airline | retail")
    p.add_argument("--policy", help="policy model: Hugging Face name or local path")
    p.add_argument("--simulator", help="simulator model (default: same base as the policy)")
    p.add_argument("--panel", default="", help="held-out evaluation simulators, comma-separated "
                   "models or adapter dirs; prefix with 'unseen:' to mark unseen ones")
    p.add_argument("--load-in-4bit", action="store_true", help="4-bit NF4 base (CUDA + bitsandbytes)")
    p.add_argument("--groups", type=int, default=16, help="real env: tasks per step")
    p.add_argument("--group-size", type=int, default=8, help="real env: trajectories per task (G)")
    p.add_argument("--lr", type=float, default=1e-5, help="real env: policy LoRA learning rate")
    p.add_argument("--sim-lr", type=float, default=1e-5, help="real env: simulator LoRA learning rate")
    p.add_argument("--eval-every", type=int, default=16, help="real env: evaluate every N steps")
    p.add_argument("--max-new-tokens", type=int, default=128, help="real env: per-turn token cap")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward")
    p.add_argument("--rollout-batch", type=int, metavar="N", help="real env: at most N episodes generated "
                   "at once (default: what fits in half the free GPU memory; 32 on CPU)")
    p.add_argument("--eval-temperature", type=float, metavar="T", help="real env: sampling temperature of "
                   "the policy and the panel during evaluation (default 0: greedy, as the paper evaluates)")
    p.add_argument("--no-grad-checkpointing", action="store_true", help="real env: keep every layer's "
                   "activations for the backward pass (faster, far more memory; default: recompute them)")
    p.add_argument("--thinking", action="store_true", help="real env: let thinking chat templates (Qwen3) "
                   "think; default enable_thinking=False for both parties")
    return p.parse_args(argv)


def run_toy(args):
    from minscope import experiment, report
    from minscope.report import fmt

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.json").is_file():
            raise SystemExit(f"--resume {run_dir}: no config.json there; pass a run directory written by train.py")
        saved = json.loads((run_dir / "config.json").read_text())
        models = experiment.ToyModelConfig(**saved.pop("models"))
        cfg = experiment.ToyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()},
                                   models=models)
        if args.steps is not None and args.steps != cfg.steps:
            raise SystemExit(f"--steps {args.steps}: a toy run keeps its settings on --resume ({cfg.steps} "
                             "steps); start a new run with --name to train longer")
        if args.workers:                    # how many processes share the arms: no effect on results
            cfg = replace(cfg, workers=args.workers)
        runs_dir = run_dir.parent
    else:
        cfg = experiment.ToyConfig.quick() if args.quick else experiment.ToyConfig()
        over = {}
        if args.name:
            over["name"] = args.name
        if args.methods:
            over["methods"] = tuple(m.strip() for m in args.methods.split(","))
            over["ablations"] = ()          # only what was asked for, unless --ablations says more
        if args.ablations is not None:
            over["ablations"] = tuple(m.strip() for m in args.ablations.split(",") if m.strip() not in ("", "none"))
        if args.seeds:
            over["seeds"] = tuple(int(s) for s in args.seeds.split(","))
        if args.steps is not None:
            over["steps"] = args.steps
        if args.workers:
            over["workers"] = args.workers
        cfg = replace(cfg, **over)
        runs_dir = Path(args.runs_dir)
    print("minscope toy experiment — settings:")
    for f in fields(cfg):
        print(f"  {f.name:14s} {getattr(cfg, f.name)}")
    run_dir = experiment.run(cfg, runs_dir, args.cache_dir, resume=bool(args.resume))
    reference = experiment.reference_values(cfg.gamma)
    results = report.write_report(run_dir, reference)
    print(f"\nresults: {run_dir}/report.md\n")
    print(f"{'method':34s} {'real users final':>16s} {'best':>6s} {'unseen':>7s} {'train first->last':>18s}")
    for m, r in results["methods"].items():
        h = r["heldout"]["real_users"]
        print(f"{r['label']:34s} {h['final_mean']:16.3f} {h['best_mean']:6.3f} "
              f"{r['heldout']['unseen']['final_mean']:7.3f} "
              f"{fmt(r['train_reward']['first'], 2):>8s} -> {fmt(r['train_reward']['last'], 2)}")
    print(f"reference: random {reference['random']:.3f}, best fixed {reference['best_fixed']:.3f}, "
          f"best adaptive {reference['best_adaptive']:.3f}")


def main(argv=None):
    args = parse_args(argv)
    if args.resume and args.env == "toy":
        saved = Path(args.resume) / "config.json"
        if saved.exists() and "models" not in json.loads(saved.read_text()):
            args.env = json.loads(saved.read_text()).get("env", args.env)   # a real-model run
    try:
        if args.env == "toy":
            run_toy(args)
        else:
            from minscope.runner import run_real

            run_real(args)
    except KeyboardInterrupt:
        default = ("toy-quick" if args.quick else "toy") if args.env == "toy" else f"{args.env}-{args.method}"
        where = args.resume or Path(args.runs_dir) / (args.name or default)
        print(f"\ninterrupted: every finished step is saved; continue with --resume {where}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
