"""Write a real-model run's report (P4G, tau2-bench, CooperBench): report.md, curves.png and
report.html, from the run's training log and, when it was evaluated (`python eval.py RUN_DIR`,
`real_eval.evaluate_run`), the panel's episodes. `render_report` puts report.md together from
the tables (`real_tables.py`) and the transcripts; `write_real_report` writes every file.

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
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .files import read_json
from .real_eval import READINGS, evaluate_run
from .real_tables import _ci, _f, cooperbench_sections, p4g_sections, tau2_sections, training_log
from .report_html import code_fence, write_html, write_report_file
from .runfolder import read_log


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
