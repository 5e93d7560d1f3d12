"""Evaluate saved runs against a simulator panel and (re)write their report.

    python eval.py runs/toy                 re-evaluate every arm's saved checkpoints, rewrite report.md
    python eval.py runs/toy --report-only   rewrite report.md / results.json / plots from metrics.jsonl
    python eval.py runs/toy --meter         also run the collapse meter on each arm's final policy

For the toy experiment each arm's final and best (by panel mean) adapters are evaluated on
the panel: the real users, the 3 seen and the 3 unseen simulators, on fresh episodes (so the
numbers differ from the logged ones by sampling noise; `minscope.experiment.eval_record`
reproduces a logged evaluation exactly); the results go to `eval.jsonl` and a section of
`report.md`. --meter adds the collapse meter of each final policy against sim-a (RL (Single)'s
simulator) to `eval.jsonl`.

Real-model runs (train.py --env p4g / tau2) are rebuilt from their config.json; the saved
policy adapter plays the test tasks against the run's panel (see minscope/real_eval.py):

    python eval.py runs/p4g-vs --episodes 4                  P4G: reward, donations, transcripts
    python eval.py runs/tau2-single --trials 4               tau2: success per domain, pass^1..4
    python eval.py runs/cooperbench-selfplay --trials 4      CooperBench: success, pass^1..4, per feature
    python eval.py runs/p4g-vs --checkpoint best --panel unseen:/models/Llama-3.2-3B-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from minscope.models import quiet
from train import whole

quiet()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory written by train.py (e.g. runs/toy)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from metrics.jsonl")
    p.add_argument("--episodes", type=whole(1), default=32, help="episodes per persona per panel member")
    p.add_argument("--meter", action="store_true", help="toy: also measure each final policy's collapse "
                   "meter against sim-a (into eval.jsonl)")
    p.add_argument("--cache-dir", default=".cache/minscope", help="where the toy's tiny models are cached")
    # real-model runs
    p.add_argument("--trials", type=whole(1), default=4, help="tau2, cooperbench: trials per task "
                   "(reports pass^1..K)")
    p.add_argument("--checkpoint", default="latest", help="real runs: latest | best | a step number")
    p.add_argument("--panel", help="real runs: replace the run's panel (train.py --panel syntax)")
    p.add_argument("--max-tasks", type=whole(1), help="real runs: evaluate only the first N test tasks")
    p.add_argument("--transcripts", type=whole(0), default=3, help="real runs: transcripts per panel member")
    return p.parse_args(argv)


def reevaluate_toy(run_dir: Path, cfg, episodes: int, meter: bool, cache_dir) -> str:
    """Evaluate each arm's final and best checkpoints; returns a markdown section."""
    import torch

    from minscope import experiment
    from minscope.adapters import load_adapter_state
    from minscope.evaluate import collapse_meter, evaluate_panel
    from minscope.files import load_state
    from minscope.report_results import label
    from minscope.report_tables import fmt

    toy = experiment.Toy(cfg, cache_dir, progress=False)
    # the new results are written beside eval.jsonl and replace it at the end: a crash or
    # Ctrl-C halfway leaves the previous results as they were
    rows, out = [], (run_dir / "eval.jsonl.tmp").open("w")
    for method, seed in cfg.arms():
        arm = experiment.arm_name(method, seed)
        for which in ("final", "best"):
            path = run_dir / "arms" / (f"{arm}.pt" if which == "final" else f"{arm}.best.pt")
            if not path.exists():
                continue
            state = load_state(path, needs=("step", "policy"))
            policy = toy.policy()
            load_adapter_state(policy.model, "policy", state["policy"])
            torch.manual_seed(seed)
            res = evaluate_panel(toy.env, policy, toy.panel(seed), toy.env.tasks(), episodes,
                                 policy_temperature=cfg.eval_temperature)
            rec = {"method": method, "seed": seed, "checkpoint": which, "step": state["step"],
                   **{k: v["mean"] for k, v in res.items()}}
            if meter and which == "final":
                rec["meter"] = collapse_meter(toy.env, policy, toy.frozen["sim-a"], toy.env.tasks())
            out.write(json.dumps(rec) + "\n")
            rows.append(rec)
    out.close()
    os.replace(run_dir / "eval.jsonl.tmp", run_dir / "eval.jsonl")
    lines = ["## Re-evaluation of saved checkpoints (`python eval.py`)", "",
             f"{episodes} episodes per persona per panel member; mean over seeds.", "",
             "| method | checkpoint | real users | seen sims | unseen sims |", "|---|---|---|---|---|"]
    for method in dict.fromkeys(m for m, _ in cfg.arms()):
        for which in ("final", "best"):
            rs = [r for r in rows if r["method"] == method and r["checkpoint"] == which]
            if rs:
                def avg(key):
                    vals = [r[key] for r in rs if r.get(key) is not None]
                    return sum(vals) / len(vals) if vals else None
                lines.append(f"| {label(method)} | {which} | {fmt(avg('real_users'))} | {fmt(avg('seen'))} | {fmt(avg('unseen'))} |")
    return "\n".join(lines)


def main(argv=None):
    from minscope.files import read_json
    from minscope.runfolder import check_format, read_log

    args = parse_args(argv)
    if args.report_only and args.meter:
        raise SystemExit("--meter measures policies, --report-only measures nothing: pass one of them")
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} has no metrics.jsonl: pass a directory written by train.py")
    config = read_json(run_dir / "config.json")
    check_format(config, run_dir, "evaluate")     # a run of another format: one line, before any work
    read_log(run_dir / "metrics.jsonl")      # a damaged log: one message naming it, before any work
    if "models" not in config:       # a real-model run (train.py --env p4g / tau2 / wordgame)
        from minscope.errors import RunStopped
        from minscope.real_args import check_saved_settings

        check_saved_settings(config, run_dir / "config.json")
        from minscope.real_report import write_real_report

        try:
            path = write_real_report(run_dir, evaluate=not args.report_only,
                                     transcripts_per_member=args.transcripts, episodes=args.episodes,
                                     trials=args.trials, checkpoint=args.checkpoint, panel=args.panel,
                                     max_tasks=args.max_tasks)
        except RunStopped as e:          # e.g. a served panel member's endpoint kept failing
            raise SystemExit(f"stopped: {e}") from None
        print(f"wrote {path}")
        return
    from minscope import experiment, report

    cfg = experiment.load_config(run_dir / "config.json")
    extra = "" if args.report_only else reevaluate_toy(run_dir, cfg, args.episodes, args.meter, args.cache_dir)
    report.write_report(run_dir, experiment.reference_values(cfg.gamma, cfg.world), extra_md=extra)
    print(f"wrote {run_dir / 'report.md'}")


if __name__ == "__main__":
    main()
