"""Evaluate a real-model run (P4G, tau2-bench, CooperBench) from its saved policy adapter.

    python eval.py runs/p4g-vs                       the latest policy-step*/ vs the run's panel
    python eval.py runs/p4g-vs --checkpoint best     the step with the best seen-panel mean in training
    python eval.py runs/tau2-single --trials 4       tau2: 4 trials per task -> pass^1..pass^4
    python eval.py runs/cooperbench-selfplay --trials 4   CooperBench: the same, per pair

The run's config.json (train.py's arguments) rebuilds the environment and the models
(`runner.build_models`); the policy adapter is loaded from `policy-step{N}/` (PEFT format).
The policy decodes greedily, as during training-time evaluation; each panel member plays
every test task `episodes` times (tau2: `trials` times) at its sampling temperature.
Each member's episodes are summed up per environment (`p4g_summary`, `tau2_summary`,
`cooperbench_summary`); `real_tables.py` turns the summaries into report.md's tables.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import torch

from .adapters import load_adapter
from .evaluate import evaluate_panel, pass_hat_k, summarize
from .files import RunFileError, read_json
from .real_args import eval_tasks, make_env
from .real_models import build_models, models_thinking

SUCCESS = 1.0 - 1e-6           # tau2 rewards are products of 0/1 evaluator scores
# (label, lo, hi): lo <= donation < hi, so every amount (99.5 cents too) lands in one bin
DONATION_BINS = [("$0", 0.0, 0.01), ("$0.01-0.49", 0.01, 0.5), ("$0.50-0.99", 0.5, 1.0),
                 ("$1.00-1.49", 1.0, 1.5), ("$1.50-1.99", 1.5, 2.0), ("$2", 2.0, float("inf"))]


# --------------------------------------------------------------------------- checkpoints
def find_checkpoints(run_dir) -> dict[int, Path]:
    """step -> policy adapter folder, for every `policy-step{N}/` in the run."""
    out = {}
    for path in Path(run_dir).glob("policy-step*"):
        m = re.fullmatch(r"policy-step(\d+)", path.name)
        if m and path.is_dir():
            out[int(m[1])] = path
    return out


def pick_checkpoint(run_dir, which: str = "latest") -> tuple[int, Path]:
    """`latest`, `best` (best.json: the best seen-panel mean during training) or a step number."""
    run_dir = Path(run_dir)
    found = find_checkpoints(run_dir)
    if not found:
        raise SystemExit(f"{run_dir} has no policy-step*/ adapters: train first (they are "
                         "saved at every --eval-every step)")
    if which == "latest":
        step = max(found)
    elif which == "best":
        best = run_dir / "best.json"
        if not best.exists():
            raise SystemExit(f"{run_dir} has no best.json; use --checkpoint latest or a step")
        step = read_json(best).get("step")          # damaged: RunFileError naming it
        if not isinstance(step, int) or isinstance(step, bool):
            raise RunFileError(f"{best} is damaged: \"step\" is {step!r}, not a step number; use "
                               "--checkpoint latest or a step")
    elif which.isdigit():
        step = int(which)
    else:
        raise SystemExit(f"--checkpoint must be latest, best or a step number, not {which!r}")
    if step not in found:
        raise SystemExit(f"{run_dir} has no policy-step{step}/; saved steps: {sorted(found)}")
    return step, found[step]


# --------------------------------------------------------------------------- summaries
def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


READINGS = ("readout_decision", "readout_asked", "reward_parsed", "reward_sampled", "readout_coverage")


def p4g_summary(episodes) -> dict:
    """Reward, donations, dialogue length and donation asks of one member's episodes."""
    donations = [ep.info["donation"] for ep in episodes]
    return {
        "reward": summarize([ep.reward for ep in episodes]),
        "donation": summarize(donations),
        "donation_stated": _mean([ep.info["donation_stated"] for ep in episodes]),
        "donation_bins": {label: sum(lo <= d < hi for d in donations)
                          for label, lo, hi in DONATION_BINS},
        "turns": _mean([ep.info["turns"] for ep in episodes]),
        "words": _mean([ep.info["words"] for ep in episodes]),
        "asks": _mean([ep.info["asks"] for ep in episodes]),
        "any_ask": _mean([ep.info["asks"] > 0 for ep in episodes]),
        # --p4g-reward expected: the training readout (the reward), the held-out one, the parsed reward
        "readings": {k: _mean([ep.info[k] for ep in episodes if k in ep.info])
                     for k in READINGS if any(k in ep.info for ep in episodes)},
    }


def tau2_summary(episodes, trials: int) -> dict:
    """Success rate with CI, pass^1..pass^trials, endings and tool use of one member."""
    success = [ep.reward >= SUCCESS for ep in episodes]
    per_task = [success[i:i + trials] for i in range(0, len(success), trials)]   # rollout groups
    endings = {}
    for ep in episodes:
        key = ep.info.get("tau2_termination", "unknown")
        endings[key] = endings.get(key, 0) + 1
    calls = [sum(len(t.meta.get("tool_calls") or []) for t in ep.turns if t.role == "agent")
             for ep in episodes]
    errors = [sum(bool(t.meta.get("error")) for t in ep.turns if t.role == "env") for ep in episodes]
    return {
        "success": summarize([float(s) for s in success]),
        "reward": _mean([ep.reward for ep in episodes]),
        "pass_hat_k": {k: pass_hat_k(per_task, k) for k in range(1, trials + 1)},
        "tasks": len(per_task),
        "endings": endings,
        "turns": _mean([sum(t.role != "env" for t in ep.turns) for ep in episodes]),
        "tool_calls": _mean(calls),
        "tool_errors": _mean(errors),
    }


def cooperbench_summary(episodes, trials: int) -> dict:
    """Success with CI, pass^k, per-feature pass rates, merges, messages and turns per coder."""
    info = [ep.info.get("cooperbench") for ep in episodes]
    scored = [c for c in info if c]
    success = [ep.reward >= SUCCESS for ep in episodes]
    per_task = [success[i:i + trials] for i in range(0, len(success), trials)]   # rollout groups

    def per_coder(key):
        return {name: _mean([c[key][name] for c in scored]) for name in (scored[0][key] if scored else {})}

    merges = {}
    for c in scored:
        k = c["merge"] if c["merge"] != "conflicts" else f"conflicts ({c['merge_strategy']})"
        merges[k] = merges.get(k, 0) + 1
    return {
        "success": summarize([float(s) for s in success]),
        "pass_hat_k": {k: pass_hat_k(per_task, k) for k in range(1, trials + 1)},
        "tasks": len(per_task),
        "feature1_pass": _mean([c["feature1_passed"] for c in scored]),
        "feature2_pass": _mean([c["feature2_passed"] for c in scored]),
        "merges": merges,
        "messages": per_coder("messages"), "turns": per_coder("turns"),
        "submitted": per_coder("submitted"), "tool_errors": per_coder("tool_errors"),
        "score_errors": sum("score_error" in ep.info for ep in episodes),
    }


# --------------------------------------------------------------------------- evaluation
def evaluate_run(run_dir, episodes: int = 4, trials: int = 4, checkpoint: str = "latest",
                 panel: str | None = None, max_tasks: int | None = None) -> dict:
    """Rebuild a run's env and models, load its policy adapter, play the panel.

    Returns {"config", "step", "split", "tasks", "per_task", "members": name -> {"kind",
    "summary", "episodes"}}. panel: a train.py-style panel spec replacing the run's.
    """
    run_dir = Path(run_dir)
    args = argparse.Namespace(**read_json(run_dir / "config.json"))
    step, folder = pick_checkpoint(run_dir, checkpoint)
    env = make_env(args)
    tasks, split = eval_tasks(env)
    tasks = tasks[:max_tasks] if max_tasks else tasks
    models = build_models(args, panel_spec=panel, partner=env.scripted_partner())
    models_thinking(models, bool(getattr(args, "thinking", False)))   # as the run was trained
    load_adapter(models.policy_model, "policy", folder)
    per_task = trials if args.env in ("tau2", "cooperbench") else episodes
    torch.manual_seed(0)
    res = evaluate_panel(env, models.policy, models.panel, tasks, episodes_per_task=per_task)
    members = {}
    for name, r in res.items():
        if "episodes" not in r:
            continue                              # the seen/unseen group means
        eps = r["episodes"]
        summary = tau2_summary(eps, trials) if args.env == "tau2" else (
            cooperbench_summary(eps, trials) if args.env == "cooperbench" else
            p4g_summary(eps) if args.env == "p4g" else {"reward": summarize([e.reward for e in eps])})
        members[name] = {"kind": r["kind"], "summary": summary, "episodes": eps}
    return {"config": vars(args), "step": step, "checkpoint": checkpoint, "split": split,
            "tasks": len(tasks), "per_task": per_task, "members": members,
            "names": (env.agent_name, env.partner_name)}
