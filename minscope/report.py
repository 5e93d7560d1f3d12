"""Turn a toy run's metrics.jsonl into results.json, PNG plots, report.md and report.html.

`write_report` puts the pieces together: the summary over seeds (`report_results.py`, saved
as results.json), the plots (`report_plots.py`), the tables (`report_tables.py`), the fidelity
check and the transcripts, and the self-contained page (`report_html.py`).

    python -m minscope.report --seed-table RUN_DIR [RUN_DIR ...]

prints the per-arm table (final and best-panel checkpoints side by side) and the paired
comparisons of the finished arms of one or more run folders (while a run is going too).
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import read_json
from .runfolder import read_log
from .report_html import code_fence, write_html, write_report_file
from .report_plots import plots
from .report_results import collect, label, summarize
from .report_tables import (TABLE_HEADER, compute_md, fmt, monitor_md, paired_md, pool_md, seed_table_md,
                            sim_update_md, table_row)


def write_report(run_dir, reference: dict, extra_md: str = "") -> dict:
    run_dir = Path(run_dir)
    records = read_log(run_dir / "metrics.jsonl")   # a damaged log: one message naming it, line and field
    results = summarize(records, reference)
    write_report_file(run_dir / "results.json", json.dumps(results, indent=2))
    images = plots(records, run_dir)
    ref = results["reference"]
    lines = [f"# minscope toy experiment: `{run_dir.name}`", "",
             f"Exact reference values on the real users: random policy **{ref['random']:.3f}**, "
             f"best fixed sequence **{ref['best_fixed']:.3f}**, best adaptive policy **{ref['best_adaptive']:.3f}**; "
             f"the exploit ({', '.join(ref.get('exploit', ['?']))}) scores {ref.get('exploit_real', float('nan')):.3f} on real users "
             f"and {ref.get('exploit_sharpened', float('nan')):.3f} inside the gamma-sharpened users.", "",
             *TABLE_HEADER]
    header = TABLE_HEADER
    row = table_row

    main = {m: r for m, r in results["methods"].items() if ":" not in m}
    ablations = {m: r for m, r in results["methods"].items() if ":" in m}
    lines += [row(r) for r in main.values()]
    finals = [r for r in records if r.get("kind") == "eval" and "real_users_rewards" in r]
    n_final = len(max(finals, key=lambda r: r["step"])["real_users_rewards"]) if finals else 0
    lines += ["", f"Final = last evaluation ({n_final} real-user episodes per seed, the policy sampling at its "
              "training temperature), averaged over seeds, with a 95% t-interval over the seeds' values "
              "(n − 1 degrees of freedom: the seed is the unit); 'episode bootstrap' = a two-level bootstrap "
              "(seeds, then episodes), close to the seeds' min–max with few seeds. 'At best panel ckpt' = the "
              "real-user score of the checkpoint with the best mean over the six simulators (what the paper "
              "keeps), same interval. Best = each seed's best evaluation, averaged (an oracle choice). Token "
              "entropy: the policy's mean entropy per generated token; act entropy: the entropy (nats) of the "
              "dialogue acts the policy played in a training step, the 7 acts and 'garbled' as 8 categories.", ""]
    lines += paired_md(results)
    if ablations:
        seeds = sorted({r["seed"] for r in records if ":" in r["method"]})
        lines += ["## Co-Training ablation", "",
                  f"Variants of the simulator objective (seeds {', '.join(map(str, seeds))}; same settings otherwise): "
                  "`adversarial` / `cooperative` / `curriculum` = the simulator's reward; `anchor` = realism anchor "
                  "(behaviour cloning on real-user transcripts, weight 0.5); `group` / `batch` = the baseline of the "
                  "simulator's advantages (default: group-wise, batch-wide for the curriculum reward). Compare with "
                  "the Co-Training rows above.", ""]
        lines += header + [row(r) for r in ablations.values()] + [""]
    meters = {m: r["collapse_meter"] for m, r in results["methods"].items() if "collapse_meter" in r}
    if meters:
        lines += ["## Collapse meter (last evaluation)", "",
                  "| method | simulator-side var | agent-side var | simulator mode prob |", "|---|---|---|---|"]
        lines += [f"| {label(m)} | {fmt(v['sim_side_var'])} | {fmt(v['agent_side_var'])} | {fmt(v['mode_prob'], 2)} |"
                  for m, v in meters.items()]
        lines.append("")
    lines += compute_md(results) + monitor_md(results) + pool_md(results) + sim_update_md(results)
    lines += [f"![{n}]({n})" for n in images] + [""]
    fid_path = run_dir / "fidelity.json"
    if fid_path.exists():
        f = json.loads(fid_path.read_text())
        lines += ["## Simulator fidelity (checked before any RL)", "",
                  f"Inside sim-a sharpened by gamma, the exploit ({', '.join(f.get('exploit', ['?']))}) is worth **{f['exploit_lm']:.3f}** "
                  f"(exact value for the sharpened real users: {f['exploit_exact']:.3f}). Mean total variation "
                  f"between sim-a and the real users at the histories the exploit and the probe pass through: "
                  f"**{f['tv']:.3f}**" + (f" (a perfect simulator, sampled as often, scores {f['tv_floor']:.3f})"
                                          if "tv_floor" in f else "") + ". The distribution sim-a-vs *states* when asked for one (Verbalized Sampling, "
                  f"decoded at temperature 1/gamma) is at TV **{f.get('vs_tv', float('nan')):.3f}** from the real users' "
                  f"(the assumption the paper's Proposition 3.7 needs: VS recovers the reference distribution).", ""]
        if "aligned" in f:
            a = f["aligned"]
            lines += [f"The aligned simulator *model* that Co-Training and Population Co-Training start from (SFT'd on "
                      f"gamma={a['gamma']:g}-sharpened users, sampled at temperature 1): the exploit is worth "
                      f"**{a['exploit_lm']:.3f}** inside it (exact: {a['exploit_exact']:.3f}); mean TV to the sharpened "
                      f"users at the same histories **{a['tv']:.3f}** (sampling noise alone: {a['tv_floor']:.3f}).", ""]
        from .toy_fidelity import fidelity_problems   # (torch only when there is a toy run to report)

        problems = fidelity_problems(f)
        if problems:
            lines += ["**The fidelity check fails** (" + "; ".join(problems) + "): these simulators are too far "
                      "from their world for the results above to say much about simulator collapse.", ""]
    if extra_md:
        lines += [extra_md, ""]
    lines += ["## Transcripts (final policy, first seed)", ""]
    for method, seeds in collect(records).items():
        first = next(iter(seeds.values()))
        if first["eval"]:
            last = first["eval"][-1]
            lines.append(f"**{label(method)}**")
            body = "\n".join(f"[{d['with']}, {d['persona']}, reward {d['reward']:.2f}]\n{d['text']}"
                             for d in eval_dialogues(last))
            fence = code_fence(body)           # a transcript cannot close it
            lines += [fence, body, fence]
    write_report_file(run_dir / "report.md", "\n".join(lines) + "\n")
    write_html(run_dir, f"minscope toy experiment: {run_dir.name}", "\n".join(lines), toy_dialogues(records))
    return results


def eval_dialogues(rec: dict) -> list[dict]:
    """An evaluation record's sampled dialogues (`experiment.dialogue`); a run logged before
    they were kept has real-user transcripts only."""
    if "dialogues" in rec:
        return rec["dialogues"]
    return [{"with": "real_users", "persona": "?", "reward": float("nan"), "text": t} for t in rec.get("transcripts", [])]


def toy_dialogues(records) -> list:
    """report.html's dialogues: per arm (its first seed), the first and the last evaluation's,
    with the real users and with the training simulator side by side."""
    out = []
    for method, seeds in collect(records).items():
        seed, first = next(iter(seeds.items()))
        evals = first["eval"]
        for rec in ([evals[0], evals[-1]] if len(evals) > 1 else evals):
            items = [(f"with {'the real users' if d['with'] == 'real_users' else 'its training simulator ' + d['with']}"
                      f", {d['persona']}, reward {d['reward']:.2f}", d["text"]) for d in eval_dialogues(rec)]
            out.append((f"{label(method)}, seed {seed}, step {rec['step']}", items))
    return out


def finished_records(run_dirs) -> tuple[list[dict], list[str]]:
    """The records of every finished arm of the toy runs in `run_dirs` (a run may still be
    going: an arm counts once its log holds the evaluation of its last step), and a note per
    arm not finished yet. An arm (method, seed) found in two folders is refused."""
    from .runfolder import arm_name, run_arms

    records, notes, seen = [], [], {}
    for run_dir in map(Path, run_dirs):
        steps = read_json(run_dir / "config.json")["steps"]
        for method, seed in run_arms(run_dir):
            if (method, seed) in seen:
                raise SystemExit(f"{arm_name(method, seed)} is in both {seen[method, seed]} and {run_dir}")
            seen[method, seed] = run_dir
            log = run_dir / "arms" / f"{arm_name(method, seed)}.jsonl"
            recs = read_log(log, warn=lambda msg: None) if log.exists() else []
            last = 0 if method == "base" else steps
            if any(r["kind"] == "eval" and r["step"] == last for r in recs):
                records += recs
            else:
                notes.append(f"{run_dir.name}/{arm_name(method, seed)}: not finished")
    return records, notes

def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Tables of one or more toy runs' finished arms, with intervals over seeds.")
    p.add_argument("--seed-table", nargs="+", metavar="RUN_DIR", required=True,
                   help="toy run folders (the same settings, different seeds), finished or still running")
    p.add_argument("--json", metavar="PATH", help="also write the summary (results.json's layout) to PATH")
    args = p.parse_args(argv)
    from .experiment import reference_values

    configs = [read_json(Path(d) / "config.json") for d in args.seed_table]
    worlds = {(c["gamma"], c["models"].get("world_name", "suppression")) for c in configs}
    if len(worlds) != 1:
        raise SystemExit(f"the runs differ in gamma or world ({sorted(worlds)}): their seeds cannot be pooled")
    records, notes = finished_records(args.seed_table)
    results = summarize(records, reference_values(*worlds.pop()))
    seeds = sorted({r["seed"] for r in records})
    print(f"Runs: {', '.join(args.seed_table)}; seeds with a finished arm: {', '.join(map(str, seeds))}\n")
    print("\n".join(seed_table_md(results)))
    for n in notes:
        print(f"(note: {n})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
