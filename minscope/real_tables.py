"""The markdown tables of a real run's report.md: per environment, what each panel member
scored (P4G: reward, donations, dialogue, the persuadee's readings; tau2: success and pass^k;
CooperBench: success, features, merges), and the training log train.py wrote (evaluations
during training, the probe set, Population's pool, the collapse monitor, where the time went).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .files import read_json
from .real_args import setting
from .real_eval import DONATION_BINS, READINGS
from .readout import low_coverage
from .runfolder import read_log

# what an evaluation during training logs of the READINGS (P4GEnv.readings); the unseen members' as "unseen_" + key
EVAL_READINGS = ("readout_decision", "readout_asked", "reward_parsed", "reward_sampled", "decision_read",
                 "readout_coverage", "readout_asked_coverage", "refusal_share", "refusal_share_sampled")
# logged beside them, not tabled: the amounts given a readable answer (diagnostics, readout.py)
EVAL_DIAGNOSTICS = ("readout_decision_conditional", "readout_asked_conditional")


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
