"""Evaluate a real-model run (P4G, tau2-bench) from its saved policy adapter; write report.md.

    python eval.py runs/p4g-vs                       the latest policy-step*/ vs the run's panel
    python eval.py runs/p4g-vs --checkpoint best     the step with the best seen-panel mean in training
    python eval.py runs/tau2-single --trials 4       tau2: 4 trials per task -> pass^1..pass^4
    python eval.py runs/cooperbench-selfplay --trials 4   CooperBench: the same, per pair

The run's config.json (train.py's arguments) rebuilds the environment and the models
(`runner.build_models`); the policy adapter is loaded from `policy-step{N}/` (PEFT format).
The policy decodes greedily, as during training-time evaluation; each panel member plays
every test task `episodes` times (tau2: `trials` times) at its sampling temperature.

What the report holds:
  P4G   reward per panel member (mean, 95% bootstrap CI), donations (mean, CI, how often
        an amount was stated, distribution), dialogue length, donation asks per episode,
        the training log, and transcripts (highest, middle and lowest reward per member).
  tau2  success rate per member and domain (95% bootstrap CI over episodes), pass^k for
        k = 1..trials (unbiased, per task, averaged over tasks), how episodes ended, tool
        use, the training log and transcripts.
  CooperBench  success (both features pass on the merged patches) per member with CI, pass^k
        over trials, each feature's pass rate, merges (clean / union), messages sent, turns
        used and submissions per coder, the training log and transcripts.
Summaries (no transcripts) also go to eval.json.

One file, though long: the three environments' sections are short and share the evaluation
and the transcript formatting; splitting them would give three files of 100 lines that
import each other.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch

from .evaluate import evaluate_panel, pass_hat_k, summarize
from .files import RunFileError, read_json
from .adapters import load_adapter
from .real_args import eval_tasks, make_env, setting
from .real_models import build_models, models_thinking
from .readout import low_coverage
from .report_html import code_fence, write_html, write_report_file
from .runfolder import read_log

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
# what an evaluation during training logs of them (P4GEnv.readings); the unseen members' as "unseen_" + key
EVAL_READINGS = ("readout_decision", "readout_asked", "reward_parsed", "reward_sampled", "decision_read",
                 "readout_coverage", "readout_asked_coverage", "refusal_share", "refusal_share_sampled")
# logged beside them, not tabled: the amounts given a readable answer (diagnostics, readout.py)
EVAL_DIAGNOSTICS = ("readout_decision_conditional", "readout_asked_conditional")


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


# --------------------------------------------------------------------------- markdown
def _f(x, nd=3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{nd}f}"


def _ci(s: dict, nd=3) -> str:
    lo, hi = s["ci95"]
    return f"[{_f(lo, nd)}, {_f(hi, nd)}]"


def _group_means(members: dict, key) -> list[str]:
    lines = []
    for kind in ("seen", "unseen"):
        vals = [key(m["summary"]) for m in members.values() if m["kind"] == kind]
        if vals:
            lines.append(f"Mean over {kind} members ({len(vals)}): {_f(float(np.mean(vals)))}.")
    return lines


def p4g_sections(members: dict) -> list[str]:
    out = ["## Reward per panel member", "",
           "Reward = min(donation / $2, 1); mean over episodes with a 95% bootstrap CI.", "",
           "| member | kind | mean reward | 95% CI | episodes |", "|---|---|---|---|---|"]
    for name, m in members.items():
        s = m["summary"]["reward"]
        out.append(f"| {name} | {m['kind']} | {_f(s['mean'])} | {_ci(s)} | {s['n']} |")
    out += [""] + _group_means(members, lambda s: s["reward"]["mean"])
    out += ["", "## Donations", "",
            "The last amount the persuadee stated (none stated counts as $0); the columns on the "
            "right count episodes per amount.", "",
            "| member | mean $ | 95% CI | amount stated | " + " | ".join(b[0] for b in DONATION_BINS) + " |",
            "|---|---|---|---|" + "---|" * len(DONATION_BINS)]
    for name, m in members.items():
        s = m["summary"]
        bins = " | ".join(str(s["donation_bins"][b[0]]) for b in DONATION_BINS)
        out.append(f"| {name} | {_f(s['donation']['mean'], 2)} | {_ci(s['donation'], 2)} | "
                   f"{_f(100 * s['donation_stated'], 0)}% | {bins} |")
    out += ["", "## Dialogue", "",
            "Per episode: generated turns, words, and persuader messages that ask for a donation.", "",
            "| member | turns | words | donation asks | episodes with an ask |", "|---|---|---|---|---|"]
    for name, m in members.items():
        s = m["summary"]
        out.append(f"| {name} | {_f(s['turns'], 1)} | {_f(s['words'], 1)} | {_f(s['asks'], 2)} | "
                   f"{_f(100 * s['any_ask'], 0)}% |")
    if any(m["summary"].get("readings") for m in members.values()):
        out += ["", "## Readings of the persuadee (--p4g-reward expected|sampled)", "",
                "Mean over episodes: the training readout (the expected gift after `[DONATE $`, / $2: the reward "
                "of `expected`), the held-out readout (asked in other words, `I will give $`), the parsed reward, "
                "the gift the persuadee sampled in its own stream (/ $2: the reward of `sampled`, and a trained "
                "persuadee's), and the coverage: the persuadee's probability of writing a readable amount "
                "(minscope/readout.py).", "",
                "| member | training readout | held-out readout | parsed reward | sampled decision | coverage |",
                "|---|---|---|---|---|---|"]
        for name, m in members.items():
            r = m["summary"].get("readings", {})
            out.append(f"| {name} ({m['kind']}) | " + " | ".join(_f(r.get(k)) for k in READINGS) + " |")
        for kind in ("seen", "unseen"):       # the seen and the unseen members' means, apart
            rows = [m["summary"].get("readings", {}) for m in members.values() if m["kind"] == kind]
            if rows:
                out.append(f"| mean over {kind} ({len(rows)}) | " + " | ".join(
                    _f(float(np.mean(v)) if (v := [x[k] for x in rows if k in x]) else None) for k in READINGS) + " |")
    return out


def tau2_sections(members: dict, domain: str, trials: int) -> list[str]:
    ks = range(1, trials + 1)
    out = ["## Success per panel member", "",
           f"Success = reward 1 from the official evaluators; 95% bootstrap CI over episodes. "
           f"pass^k: the chance that k of the {trials} trials of a task all succeed, averaged over tasks.", "",
           "| member | kind | domain | success | 95% CI | " + " | ".join(f"pass^{k}" for k in ks) + " | tasks |",
           "|---|---|---|---|---|" + "---|" * trials + "---|"]
    for name, m in members.items():
        s = m["summary"]
        phk = " | ".join(_f(s["pass_hat_k"][k]) for k in ks)
        out.append(f"| {name} | {m['kind']} | {domain} | {_f(s['success']['mean'])} | {_ci(s['success'])} | "
                   f"{phk} | {s['tasks']} |")
    out += [""] + _group_means(members, lambda s: s["success"]["mean"])
    out += ["", "## Episodes", "", "| member | turns | tool calls | tool errors | endings |",
            "|---|---|---|---|---|"]
    for name, m in members.items():
        s = m["summary"]
        endings = ", ".join(f"{k} {v}" for k, v in sorted(s["endings"].items()))
        out.append(f"| {name} | {_f(s['turns'], 1)} | {_f(s['tool_calls'], 2)} | {_f(s['tool_errors'], 2)} | {endings} |")
    return out


def cooperbench_sections(members: dict, trials: int) -> list[str]:
    ks = range(1, trials + 1)
    out = ["## Success per panel member", "",
           "The trained coder (agent1) works with the panel member as agent2. Success = both features' "
           "hidden tests pass on the two patches merged as CooperBench's evaluator merges them; 95% "
           f"bootstrap CI over episodes. pass^k: the chance that k of the {trials} trials of a pair all "
           "succeed, averaged over pairs.", "",
           "| member | kind | success | 95% CI | " + " | ".join(f"pass^{k}" for k in ks) +
           " | feature 1 passes | feature 2 passes | pairs |", "|---|---|---|---|" + "---|" * trials + "---|---|---|"]
    for name, m in members.items():
        s = m["summary"]
        phk = " | ".join(_f(s["pass_hat_k"][k]) for k in ks)
        out.append(f"| {name} | {m['kind']} | {_f(s['success']['mean'])} | {_ci(s['success'])} | {phk} | "
                   f"{_f(s['feature1_pass'])} | {_f(s['feature2_pass'])} | {s['tasks']} |")
    out += [""] + _group_means(members, lambda s: s["success"]["mean"])
    out += ["", "## Episodes", "",
            "Per episode and coder (agent1 / agent2): messages sent, turns used, submitted (share), tool "
            "errors; how the two patches merged.", "",
            "| member | messages | turns | submitted | tool errors | merges | evaluator errors |",
            "|---|---|---|---|---|---|---|"]

    def pair(d, nd):
        return " / ".join(_f(v, nd) for v in d.values()) or "n/a"

    for name, m in members.items():
        s = m["summary"]
        merges = ", ".join(f"{k} {v}" for k, v in sorted(s["merges"].items()))
        out.append(f"| {name} | {pair(s['messages'], 2)} | {pair(s['turns'], 1)} | {pair(s['submitted'], 2)} | "
                   f"{pair(s['tool_errors'], 2)} | {merges} | {s['score_errors']} |")
    return out


def training_log(run_dir: Path) -> list[str]:
    """The evaluations train.py logged, and the training reward's first and last values."""
    path = run_dir / "metrics.jsonl"
    recs = read_log(path) if path.exists() else []   # a damaged log: one message naming it, line and field
    evals = [r for r in recs if r.get("kind") == "eval"]
    train = [r["train_reward"] for r in recs if r.get("kind") == "train"]
    out = ["## Training log", ""]
    if train:
        out.append(f"{len(train)} training steps; training reward {_f(train[0])} (first step) -> "
                   f"{_f(train[-1])} (last step).")
        out += ["", "Training reward per step: " + " ".join(_f(r, 2) for r in train) + "."]
    if evals:
        skip = {"kind", "step", "split", "tasks", "panel_mean", "seen", "unseen", "eval_temperature", "eval_s",
                "seen_se", "unseen_se", "dialogues", "probe"}
        readings = [k for k in EVAL_READINGS if any(k in r for r in evals)]
        names = [k for k in evals[0] if k not in skip
                 and k.removeprefix("unseen_") not in EVAL_READINGS + EVAL_DIAGNOSTICS]
        groups = [k for k in ("seen", "unseen") if k in evals[0]]
        n = evals[0].get("tasks")
        which = f"the first {n} {evals[0].get('split', 'test')} tasks" if n else f"{evals[0].get('split', 'test')} tasks"
        temperature = evals[0].get("eval_temperature")
        how = ("policy and simulators greedy" if temperature == 0 else "greedy policy" if temperature is None
               else f"policy and simulators at temperature {temperature:g}")
        cols = names + [f"{k} mean" for k in groups] + ["panel mean"]
        out += ["", f"Evaluations during training ({how}, {which}, one episode per task). `--checkpoint best` "
                "(best.json) is the step with the best seen mean; the unseen members are never read by it.", "",
                "| step | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for r in evals:
            out.append(f"| {r['step']} | " + " | ".join(_f(r.get(n)) for n in names + groups) +
                       f" | {_f(r.get('panel_mean'))} |")
        if readings:
            out += ["", "The persuadee's readings at each evaluation: the means over the seen members' episodes, "
                    "and apart over the unseen members' (minscope/readout.py):", "",
                    "| step | members | " + " | ".join(readings) + " |", "|---|---|" + "---|" * len(readings)]
            for r in evals:
                for kind, prefix in (("seen", ""), ("unseen", "unseen_")):
                    if any(prefix + k in r for k in readings):
                        out.append(f"| {r['step']} | {kind} | " + " | ".join(_f(r.get(prefix + k)) for k in readings) + " |")
    probed = [r for r in evals if r.get("probe")]
    if probed:      # P4G with a trained persuadee: the probe set at the first and last evaluation
        out += ["", "The trained persuadee on the probe set (envs/p4g.py PROBE_MESSAGES; expected gift in "
                "dollars after `[DONATE $`, mean over the first test personas): a persuadee that refuses "
                "everything reads low on every row; one that stops paying for a copied amount, on the rows "
                "that write one.", ""]
        for r in (probed[0], probed[-1]) if len(probed) > 1 else probed:
            members = list(r["probe"])
            labels = list(r["probe"][members[0]])
            out += [f"Step {r['step']}:", "", "| message | " + " | ".join(members) + " |",
                    "|---|" + "---|" * len(members)]
            out += [f"| {k} | " + " | ".join(_f(r["probe"][m].get(k), 2) for m in members) + " |" for k in labels]
            out.append("")
    low = low_coverage([r for r in recs if r.get("kind") in ("train", "eval")])
    if low:        # P4G's read rewards: many answers unreadable (minscope/readout.py)
        out += ["", f"**Warning**: {low}."]
    out += pool_lines([r for r in recs if r.get("kind") == "train"], run_dir)
    alarms = [r for r in recs if r.get("kind") == "alarm"]
    out += ["", "Collapse monitor (minscope/monitor.py): " + ("; ".join(f"step {r['step']}: {r['detail']}" for r in alarms)
                                                           if alarms else "no alarm.")]
    out += timings([r for r in recs if r.get("kind") == "train"], evals)
    return out


def pool_lines(steps: list[dict], run_dir: Path) -> list[str]:
    """Population's pool: at how many training steps it was full (all K snapshots in play) and
    which snapshots played the groups. A log from before `pool_full` was logged is read from
    `pool_size` (logged after each step's snapshot: the pool a step plays is the previous
    step's, one snapshot at step 0)."""
    steps = [r for r in steps if "pool_size" in r]
    if not steps:
        return []
    size = setting(argparse.Namespace(**read_json(run_dir / "config.json")), "pool_size")
    full = [r["pool_full"] if "pool_full" in r else (prev["pool_size"] if prev else 1) == size
            for prev, r in zip([None] + steps[:-1], steps)]
    out = ["", f"Population pool (K = {size}): full while it played at {sum(full)} of {len(steps)} training steps "
           f"({100 * sum(full) / len(steps):.0f}%)" + (f", from step {steps[full.index(True)]['step']}" if any(full) else "")
           + "."]
    played = [s for r in steps for s in r.get("pool_played", [])]
    if played:
        out[-1] += (f" The step-0 snapshot (the untrained simulator, RL (Single)'s) played {played.count(0)} of "
                    f"{len(played)} groups; groups per snapshot: "
                    + ", ".join(f"step {k}: {played.count(k)}" for k in sorted(set(played))) + ".")
    return out


def timings(steps: list[dict], evals: list[dict]) -> list[str]:
    """Where a training step's time went (rollout, update), evaluation time, tokens and the
    share of exact token streams, as means over the logged steps (runs that logged them)."""
    steps = [r for r in steps if "rollout_s" in r]
    if not steps:
        return []

    def mean(key, recs):
        vals = [r[key] for r in recs if r.get(key) is not None]
        return _f(float(np.mean(vals)), 1) if vals else "n/a"

    out = ["", f"Time per training step (mean over {len(steps)} steps): rollout {mean('rollout_s', steps)} s, "
           f"update {mean('update_s', steps)} s, whole step {mean('seconds', steps)} s; evaluation "
           f"{mean('eval_s', evals)} s each."]
    if any("tokens_generated" in r for r in steps):
        out.append(f"Tokens per step: {mean('tokens_generated', steps)} generated, "
                   f"{mean('tokens_prefilled', steps)} prefilled (fed to the model before sampling).")
    fracs = [r["exact_stream_frac"] for r in steps if r.get("exact_stream_frac") is not None]
    if fracs:
        out.append(f"Exact token streams: {_f(min(fracs), 2)} of the episodes at the lowest step "
                   "(below 0.9 the run stops).")
    return out


def format_episode(ep, names) -> str:
    """One line per turn, "speaker: text"; a turn's own line breaks are indented."""
    label = {"agent": names[0], "partner": names[1], "env": "tool result"}
    lines = []
    for t in ep.turns:
        who = label[t.role] + (" (tool call)" if t.role == "agent" and t.meta.get("tool_calls") is not None else "")
        if t.role == "env" and t.to and t.to != "agent":      # a result addressed to the partner
            who = f"tool result to {names[1]}"
        lines.append(f"{who}: " + t.text.strip().replace("\n", "\n    "))
    return "\n".join(lines)


def transcripts(members: dict, names, n: int) -> list[str]:
    """Up to n episodes per member: highest, lowest and middle reward first."""
    out = ["## Transcripts", ""]
    for member, m in members.items():
        eps = sorted(m["episodes"], key=lambda e: -e.reward)
        order = [0, len(eps) - 1, len(eps) // 2] + list(range(len(eps)))
        picked = list(dict.fromkeys(i for i in order if 0 <= i < len(eps)))[:n]
        for i in picked:
            ep = eps[i]
            which = {0: "highest reward", len(eps) - 1: "lowest reward"}.get(i, "middle reward")
            task = getattr(ep.task, "id", "?")
            extra = f", donation ${ep.info['donation']:.2f}" if "donation" in ep.info else ""
            body = format_episode(ep, names)
            fence = code_fence(body)
            out += [f"### {member}: {which} (task {task}, reward {ep.reward:.3f}{extra})", "",
                    fence + "text", body, fence, ""]
    return out


def render_report(run_dir: Path, result: dict | None, transcripts_per_member: int = 3) -> str:
    run_dir = Path(run_dir)
    cfg = read_json(run_dir / "config.json")
    lines = [f"# {run_dir.name}: " + ("evaluation" if result is not None else "training log"), "",
             f"Environment `{cfg['env']}`" + (f" (domain {cfg['domain']})" if cfg["env"] == "tau2" else "") +
             f", method `{cfg['method']}`, policy `{cfg['policy']}`, " +
             (f"the environment's scripted {cfg['scripted_partner']}" if cfg.get("scripted_partner") else
              f"simulator `{cfg.get('simulator') or cfg['policy']}`") +
             f", trained for {cfg.get('steps')} steps.", ""]
    if result is None:
        lines += ["This report is the training log (written when the run ends, or by `eval.py --report-only`); "
                  "`python eval.py RUN_DIR` evaluates the saved policy on every test task and adds its tables."]
    else:
        lines += [f"Checkpoint `policy-step{result['step']}` ({result['checkpoint']}); "
                  f"{result['tasks']} {result['split']} tasks x {result['per_task']} episodes per panel "
                  "member; greedy policy, simulators sampled at temperature 0.7.", ""]
        if result["split"] != "test":
            lines += ["**Warning: the test split is empty, so these are TRAINING tasks, not held out.**", ""]
        members = result["members"]
        if cfg["env"] == "p4g":
            lines += p4g_sections(members)
        elif cfg["env"] == "tau2":
            lines += tau2_sections(members, cfg["domain"], result["per_task"])
        elif cfg["env"] == "cooperbench":
            lines += cooperbench_sections(members, result["per_task"])
        else:
            lines += ["| member | kind | mean reward | 95% CI |", "|---|---|---|---|"]
            lines += [f"| {k} | {m['kind']} | {_f(m['summary']['reward']['mean'])} | {_ci(m['summary']['reward'])} |"
                      for k, m in members.items()]
    lines += [""] + training_log(run_dir)
    if result is not None and transcripts_per_member:
        lines += [""] + transcripts(result["members"], result["names"], transcripts_per_member)
    return "\n".join(lines) + "\n"


def _value(rec: dict, key: str) -> float:
    """A logged number for a plot: NaN where the record has none (a gap in the line)."""
    return np.nan if rec.get(key) is None else rec[key]


def training_curves(run_dir: Path) -> str | None:
    """curves.png: the training reward per step (with the P4G readings when logged) and the
    panel means of the evaluations; None when the log has no training step."""
    path = run_dir / "metrics.jsonl"
    recs = read_log(path, warn=lambda msg: None) if path.exists() else []
    train, evals = [r for r in recs if r.get("kind") == "train"], [r for r in recs if r.get("kind") == "eval"]
    if not train:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for key in ("train_reward", *(k for k in READINGS if k in train[0] and k != "readout_decision")):
        left.plot([r["step"] for r in train], [_value(r, key) for r in train], marker=".", label=key)
    left.set(title="training episodes", xlabel="step")
    for key in [k for k in ("panel_mean", "seen", "unseen", *READINGS) if evals and k in evals[0]]:
        right.plot([r["step"] for r in evals], [_value(r, key) for r in evals], marker="o", label=key)
    right.set(title="evaluations (held-out tasks)", xlabel="step")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=90)
    plt.close(fig)
    return "curves.png"


def logged_dialogues(run_dir: Path) -> list:
    """report.html's dialogues: those train.py kept at the first and the last training step
    and evaluation that logged them (`runner.dialogue`)."""
    path = run_dir / "metrics.jsonl"
    recs = [r for r in (read_log(path, warn=lambda msg: None) if path.exists() else []) if r.get("dialogues")]
    out = []
    for kind, what in (("eval", "evaluation"), ("train", "training")):
        mine = [r for r in recs if r["kind"] == kind]
        for r in ([mine[0], mine[-1]] if len(mine) > 1 else mine):
            out.append((f"{what}, step {r['step']}",
                        [(f"with {d['with']}, task {d['task']}, reward {d['reward']:.3f}"
                          + (f" ({d['note']})" if d.get("note") else ""), d["text"])
                         for d in r["dialogues"]]))
    return out


def write_real_report(run_dir, evaluate: bool = True, transcripts_per_member: int = 3, **kw) -> Path:
    """Evaluate (unless `evaluate` is False) and write report.md (+ eval.json), the training
    curves and report.html; kw go to `evaluate_run`. Returns report.md's path."""
    run_dir = Path(run_dir)
    result = evaluate_run(run_dir, **kw) if evaluate else None
    if result is not None:
        summary = {k: v for k, v in result.items() if k not in ("members", "config", "names")}
        summary["members"] = {k: {"kind": m["kind"], **m["summary"]} for k, m in result["members"].items()}
        write_report_file(run_dir / "eval.json", json.dumps(summary, indent=2) + "\n")
    md = render_report(run_dir, result, transcripts_per_member)
    curves = training_curves(run_dir)
    if curves:
        md += f"\n![{curves}]({curves})\n"
    path = write_report_file(run_dir / "report.md", md)
    write_html(run_dir, f"minscope: {run_dir.name}", md, logged_dialogues(run_dir))
    return path
