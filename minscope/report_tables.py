"""The toy report's markdown tables, each read from results.json's summary
(`report_results.summarize`): the per-arm results table, the paired differences, training
compute, the simulator's update, the collapse monitor and the pool's diversity.
"""

from __future__ import annotations

from .report_results import label


def si(x: float, unit: str = "") -> str:
    """12345678 -> '12.3 M' (x 1e3 steps, 3 significant digits)."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def compute_md(results) -> list[str]:
    """The training compute table: per arm, FLOPs, tokens, and the ratio to RL (Single)."""
    rows = {m: r["compute"] for m, r in results["methods"].items() if r.get("compute", {}).get("flops")}
    if not rows:
        return []
    lines = ["## Training compute (per arm; minscope/compute.py)", "",
             "Each arm's training steps: rollout tokens decoded and prefilled (fed to the model before "
             "sampling, KV-cached ids excluded) by the policy and the simulator, tokens trained (loss tokens, "
             "every epoch's pass and the realism anchor counted), and FLOPs estimated as 2N per token forward "
             "(rollouts, the KL reference pass) and 6N per token fed through each training pass (N: the model "
             "with its one LoRA adapter). Evaluations and measurements are not counted. Means over seeds; "
             "plotted against the real-user reward in compute.png.", "",
             "| method | FLOPs | × RL (Single) | rollout share | decoded, policy / simulator | "
             "prefilled, policy / simulator | trained, policy / simulator |", "|---|---|---|---|---|---|---|"]
    for m, c in rows.items():
        ratio = "–" if c.get("vs_single") is None else f"{c['vs_single']:.2f}"
        lines.append(f"| {label(m)} | {si(c['flops'], 'FLOP')} | {ratio} | {c['rollout_flops'] / c['flops']:.0%} | "
                     f"{si(c['policy_decoded'])} / {si(c['sim_decoded'])} | "
                     f"{si(c['policy_prefilled'])} / {si(c['sim_prefilled'])} | "
                     f"{si(c['policy_trained'])} / {si(c['sim_trained'])} |")
    return lines + [""]


def fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def mean_ci(mean, ci, nd=3) -> str:
    """'0.365 (0.335–0.395)', or the mean alone where there is no interval (one seed)."""
    if not ci or ci[0] is None:
        return fmt(mean, nd)
    return f"{fmt(mean, nd)} ({fmt(ci[0], nd)}–{fmt(ci[1], nd)})"


VERDICT = {"above": "above", "below": "below", "tie": "tie", None: "–"}


def paired_md(results) -> list[str]:
    """The paired comparisons: each arm minus RL (Single) and minus Base, over the seeds both
    were trained on, final and best-panel checkpoint side by side."""
    rows = results.get("paired", {})
    if not rows:
        return []
    lines = ["## Paired differences over seeds", "",
             "Each arm minus the reference arm on the same seed, averaged over the seeds both have, with the "
             "95% t-interval of that mean difference (n − 1 degrees of freedom); 'wins' = seeds on which the arm "
             "is ahead; verdict: above / below when the interval excludes 0, tie when it contains 0.", "",
             "| method | against | final: difference (95% t) | wins | verdict | best panel ckpt: difference (95% t) "
             "| wins | verdict |", "|---|---|---|---|---|---|---|---|"]
    for key, d in rows.items():
        if d["checkpoint"] != "final":
            continue
        sel = rows.get(key.rsplit("|", 1)[0] + "|selected", {})
        cells = []
        for x in (d, sel):
            cells += [mean_ci(x.get("mean"), [x.get("lo"), x.get("hi")]) if x else "–",
                      f"{x['wins']}/{x['n']}" if x else "–", VERDICT.get(x.get("verdict"), x.get("verdict")) if x else "–"]
        lines.append(f"| {label(d['method'])} | {label(d['against'])} | " + " | ".join(cells) + " |")
    return lines + [""]


def sim_update_md(results) -> list[str]:
    """The trained simulators' updates: clip fraction, and Population's by snapshot age."""
    rows = {m: r["sim_update"] for m, r in results["methods"].items() if "sim_update" in r}
    if not rows:
        return []
    lines = ["## The simulator's update (Co-Training, Population Co-Training)", "",
             "Fraction of the simulator's trained tokens whose importance ratio the update clips (the clipped "
             "surrogate passes no gradient through them), mean over steps and seeds.", "",
             "| method | clip fraction, first 3 steps | last 3 steps | all steps |", "|---|---|---|---|"]
    for m, u in rows.items():
        lines.append(f"| {label(m)} | {fmt(u['clip_frac_first'])} | {fmt(u['clip_frac_last'])} | {fmt(u['clip_frac_mean'])} |")
    for m, u in rows.items():
        if "by_age" not in u:
            continue
        lines += ["", f"{label(m)}: the live simulator learns from episodes its pool's snapshots played. By the age "
                  "of the snapshot that played (updates of the live adapter since it; 0: the same weights), the first pass's "
                  "clip fraction and mean |log importance ratio|, token-weighted over steps and seeds:", "",
                  "| snapshot age (updates) | trained tokens | clip fraction | mean abs log ratio |", "|---|---|---|---|"]
        lines += [f"| {a} | {v['tokens']} | {fmt(v['clip_frac'])} | {fmt(v['abs_log_ratio'])} |"
                  for a, v in u["by_age"].items()]
    return lines + [""]


def monitor_md(results) -> list[str]:
    """The collapse monitor's table: per arm (method, seed), the first step of each signal."""
    from .monitor import SIGNALS

    rows = [(m, seed, a) for m, r in results["methods"].items() for seed, a in r.get("alarms", {}).items()]
    if not rows:
        return []
    lines = ["## Collapse monitor (live, minscope.monitor)", "",
             "First step at which each signal fired (– = never). A seed is *flagged* when any signal fires.", "",
             "| arm | flagged | " + " | ".join(SIGNALS) + " |", "|---|---|" + "---|" * len(SIGNALS)]
    for m, seed, a in rows:
        lines.append(f"| {label(m)}, seed {seed} | {'yes' if a else 'no'} | "
                     + " | ".join(str(a[sig]) if sig in a else "–" for sig in SIGNALS) + " |")
    return lines + [""]


def pool_md(results) -> list[str]:
    rows = {m: r["pool_diversity"] for m, r in results["methods"].items() if "pool_diversity" in r}
    if not rows:
        return []
    ref = next(iter(rows.values())).get("sim_a_exploit_value")
    lines = ["## Pool diversity (last snapshot; minscope.diversity)", "",
             "At the histories the exploit passes through: the mean pairwise TV between pool members "
             "(Co-Training: one live simulator, so none), the TV two copies of one member read from sampling "
             "noise alone at the same sample size (the floor), and the excess above it; each member's mean TV "
             "to sim-a as the frozen arms meet it and to the real users; the exploit's value inside the members"
             + (f" (inside sim-a: {ref:.3f})" if ref is not None else "")
             + "; and how often a member names its own cue when probed (the information the sharpened users "
             "suppress). Means over seeds.", "",
             "| method | pairwise TV | its noise floor | excess | TV to sim-a | TV to real users | exploit value inside "
             "| own cue when probed |", "|---|---|---|---|---|---|---|---|"]
    real_cue = None
    for m, p in rows.items():
        f = p["final"]
        real_cue = f.get("real_cue_rate") if f.get("real_cue_rate") is not None else real_cue
        lines.append(f"| {label(m)} | {fmt(f['pairwise_tv'])} | {fmt(f.get('pairwise_floor'))} | "
                     f"{fmt(f.get('pairwise_tv_excess'))} | {fmt(f['tv_sim_a'])} | {fmt(f['tv_real'])} | "
                     f"{fmt(f['exploit_value'])} | {fmt(f.get('cue_rate'))} |")
    if real_cue is not None:
        lines += ["", f"The real users name their own cue when probed {real_cue:.3f} of the time."]
    return lines + [""]


TABLE_HEADER = ["| method | real users, final (95% t over seeds) | episode bootstrap | per seed "
                "| at best panel ckpt (95% t over seeds) | real users, best | unseen sims, final "
                "| train reward first → last | token entropy first → last | act entropy first → last "
                "| zero-var first → last | most common final sequence |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def _arrow(d, nd=2):
    d = d or {}
    return f"{fmt(d.get('first'), nd)} → {fmt(d.get('last'), nd)}"


def table_row(r) -> str:
    """One arm's row of the results table (TABLE_HEADER)."""
    h = r["heldout"]["real_users"]
    ci = h["final_ci95"]
    seeds = " ".join(fmt(x)[1:] if x is not None and 0 <= x < 1 else fmt(x) for x in h.get("final_per_seed", []))
    return (f"| {r['label']} | {mean_ci(h['final_mean'], h.get('final_seed_ci95'))} | "
            f"{fmt(ci[0], 2)}–{fmt(ci[1], 2)} | {seeds} | {mean_ci(h['selected_mean'], h.get('selected_seed_ci95'))} | "
            f"{fmt(h['best_mean'])} | {fmt(r['heldout']['unseen']['final_mean'])} | {_arrow(r['train_reward'])} | "
            f"{_arrow(r['entropy'])} | {_arrow(r.get('act_entropy'))} | "
            f"{_arrow(r['zero_variance'])} | {r['top_sequence'].replace(' | ', ', ')} |")


def seed_table_md(results) -> list[str]:
    """The per-arm table and the paired comparisons, for RESULTS.md."""
    main = [r for m, r in results["methods"].items() if ":" not in m]
    return TABLE_HEADER + [table_row(r) for r in main] + [""] + paired_md(results) + sim_update_md(results)
