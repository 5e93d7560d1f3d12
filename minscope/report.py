"""Turn a run's metrics.jsonl into results.json, PNG plots and report.md.

Confidence intervals for a method's final held-out reward come from a two-level bootstrap:
resample seeds, then episodes within each resampled seed. That way both the training
randomness (seeds) and the evaluation noise (episodes) are in the interval.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from .files import read_jsonl
from .monitor import first_alarms

LABELS = {"base": "Base (untrained)", "single": "RL (Single)", "vs": "Verbalized Sampling",
          "ensemble": "Ensemble (K=3)", "persona": "Persona-Guided", "cotrain": "Co-Training",
          "population": "Population Co-Training", "oracle": "Oracle (trained on real users)"}


def label(method: str) -> str:
    base, _, variant = method.partition(":")
    return LABELS.get(base, base) + (f" [{variant}]" if variant else "")


def two_level_bootstrap(per_seed: list[list[float]], n_boot: int = 2000, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(v, dtype=float) for v in per_seed if len(v)]
    if not arrays:
        return [float("nan"), float("nan")]
    means = []
    for _ in range(n_boot):
        picks = rng.integers(len(arrays), size=len(arrays))
        means.append(np.mean([arrays[i][rng.integers(arrays[i].size, size=arrays[i].size)].mean() for i in picks]))
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def collect(records):
    """method -> seed -> {"train": [...], "eval": [...]} sorted by step."""
    out = defaultdict(lambda: defaultdict(lambda: {"train": [], "eval": [], "pool": [], "alarm": []}))
    for r in records:
        out[r["method"]][r["seed"]].setdefault(r["kind"], []).append(r)
    for seeds in out.values():
        for d in seeds.values():
            for recs in d.values():
                recs.sort(key=lambda r: r["step"])
    return out


def summarize(records, reference: dict) -> dict:
    data = collect(records)
    results = {"reference": reference, "methods": {}}
    for method, seeds in data.items():
        evals = [d["eval"] for d in seeds.values() if d["eval"]]
        trains = [d["train"] for d in seeds.values() if d["train"]]
        if not evals:
            continue
        final = [e[-1] for e in evals]

        def mean_of(key, recs):
            vals = [r[key] for r in recs if r.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        def first_last(key, k=3):
            if not trains:
                return {"first": None, "last": None}
            return {"first": float(np.mean([np.mean([r[key] for r in t[:k]]) for t in trains])),
                    "last": float(np.mean([np.mean([r[key] for r in t[-k:]]) for t in trains]))}

        res = {
            "label": label(method),
            "seeds": len(evals),
            "heldout": {
                "real_users": {
                    "final_mean": mean_of("real_users", final),
                    "final_ci95": two_level_bootstrap([r.get("real_users_rewards", [r["real_users"]]) for r in final]),
                    "final_per_seed": [r["real_users"] for r in final],
                    "best_mean": float(np.mean([max(x["real_users"] for x in e) for e in evals])),
                    "selected_mean": float(np.mean([max(e, key=lambda x: x["panel"])["real_users"] for e in evals])),
                },
                "unseen": {"final_mean": mean_of("unseen", final)},
                "seen": {"final_mean": mean_of("seen", final)},
                "panel": {"final_mean": mean_of("panel", final)},
            },
            "train_reward": first_last("train_reward"),
            "entropy": first_last("policy_entropy"),
            "zero_variance": first_last("zero_var_frac"),
            "top_sequence": final[0].get("top_sequence", ""),
        }
        meters = [r["meter"] for e in evals for r in e[-1:] if "meter" in r]
        if meters:
            res["collapse_meter"] = {k: float(np.mean([m[k] for m in meters])) for k in meters[0]}
        res["alarms"] = {str(seed): first_alarms(d["alarm"]) for seed, d in seeds.items() if d["eval"]}
        res["flagged_seeds"] = sum(bool(a) for a in res["alarms"].values())
        pools = {seed: d["pool"] for seed, d in seeds.items() if d["pool"]}
        if pools:
            res["pool_diversity"] = pool_summary(pools)
        if all("compute_total" in e[-1] for e in evals):
            res["compute"] = compute_summary([e[-1]["compute_total"] for e in evals])
        results["methods"][method] = res
    single = results["methods"].get("single", {}).get("compute", {}).get("flops")
    for r in results["methods"].values():
        if "compute" in r:
            r["compute"]["vs_single"] = r["compute"]["flops"] / single if single else None
    return results


def compute_summary(totals: list[dict]) -> dict:
    """An arm's training compute (minscope/compute.py), mean over seeds: FLOPs (rollout and
    update), tokens generated (decoded; prefilled) and trained, per side."""
    mean = lambda key: float(np.mean([t.get(key, 0) for t in totals]))     # noqa: E731
    out = {"flops": mean("flops"), "flops_per_seed": [t.get("flops", 0) for t in totals],
           "rollout_flops": mean("rollout_flops"), "update_flops": mean("update_flops")}
    for side in ("policy", "sim"):
        for kind in ("decoded", "prefilled", "trained", "backprop"):
            out[f"{side}_{kind}"] = mean(f"{side}_{kind}")
    return out


POOL_KEYS = ("pairwise_tv", "pairwise_floor", "pairwise_tv_excess", "tv_sim_a", "tv_real", "exploit_value",
             "cue_rate", "real_cue_rate")


def pool_summary(pools: dict) -> dict:
    """`pool_diversity` of one method: per seed the trajectory over snapshots, and the mean
    over seeds of the last measurement (pairwise TV is None for a one-member "pool")."""
    def mean(vals):
        vals = [v for v in vals if v is not None]
        return float(np.mean(vals)) if vals else None
    last = [recs[-1] for recs in pools.values()]
    return {"final": {k: mean([r.get(k) for r in last]) for k in POOL_KEYS},
            "sim_a_exploit_value": last[0].get("sim_a_exploit_value"),
            "per_seed": {str(seed): [{"step": r["step"], **{k: r.get(k) for k in POOL_KEYS}} for r in recs]
                         for seed, recs in pools.items()}}


def plots(records, out_dir: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {m: seeds for m, seeds in collect(records).items() if ":" not in m}   # ablations: tables only
    panels = [("eval", "real_users", "held-out reward (real users)"),
              ("train", "train_reward", "train reward (vs its simulator)"),
              ("train", "policy_entropy", "policy entropy (nats/token)"),
              ("train", "zero_var_frac", "zero-variance groups")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = {m: f"C{i}" for i, m in enumerate(data)}      # one colour per method, every panel
    for ax, (kind, key, title) in zip(axes.flat, panels):
        for method, seeds in data.items():
            series = [d[kind] for d in seeds.values() if d[kind]]
            if not series or key not in series[0][0]:
                continue
            n = min(len(s) for s in series)
            steps = [r["step"] for r in series[0][:n]]
            vals = np.array([[r[key] for r in s[:n]] for s in series])
            if kind == "train" and n > 5:   # light smoothing of noisy per-step values (edge-padded)
                vals = np.array([np.convolve(np.pad(v, 1, mode="edge"), np.ones(3) / 3, mode="valid") for v in vals])
            ax.plot(steps, vals.mean(0), label=label(method), color=colors[method])
            if len(vals) > 1:
                ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.15, color=colors[method])
            if key == "train_reward":   # the collapse monitor's first alarm of each seed
                for d in seeds.values():
                    if d["alarm"] and d["train"]:
                        s0 = d["alarm"][0]["step"]
                        y = min(d["train"], key=lambda r: abs(r["step"] - s0))["train_reward"]
                        ax.plot([s0], [y], marker="v", markersize=9, color=colors[method], markeredgecolor="k")
        ax.set_title(title)
        ax.set_xlabel("policy step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("minscope toy experiment (band = min..max over seeds; ▼ = the collapse monitor's first alarm)")
    fig.tight_layout()
    names = ["curves.png"]
    fig.savefig(out_dir / names[0], dpi=110)
    plt.close(fig)

    meter = [(m, r["step"], r["meter"]) for m, seeds in data.items() for d in seeds.values()
             for r in d["eval"] if "meter" in r]
    if meter:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for method in data:
            pts = sorted(((s, v) for m, s, v in meter if m == method), key=lambda p: p[0])
            if not pts:
                continue
            by_step = defaultdict(list)
            for s, v in pts:
                by_step[s].append(v)
            xs = sorted(by_step)
            axes[0].plot(xs, [np.mean([v["sim_side_var"] for v in by_step[x]]) for x in xs], "o-",
                         label=label(method), color=f"C{list(data).index(method)}")
            axes[1].plot(xs, [np.mean([v["mode_prob"] for v in by_step[x]]) for x in xs], "o-",
                         label=label(method), color=f"C{list(data).index(method)}")
        axes[0].set_title("simulator-side reward variance E_agent[Var_sim R]")
        axes[1].set_title("simulator mode probability at visited histories")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "collapse_meter.png", dpi=110)
        plt.close(fig)
        names.append("collapse_meter.png")
    if compute_plot(data, out_dir, colors):
        names.append("compute.png")
    pools = {m: seeds for m, seeds in collect(records).items() if any(d["pool"] for d in seeds.values())}
    if pools:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        for i, (method, seeds) in enumerate(pools.items()):
            for j, d in enumerate(v for v in seeds.values() if v["pool"]):
                steps = [r["step"] for r in d["pool"]]
                for ax, key in zip(axes, ("pairwise_tv", "tv_sim_a", "exploit_value")):
                    ys = [r.get(key) for r in d["pool"]]
                    if any(y is not None for y in ys):
                        ax.plot(steps, [np.nan if y is None else y for y in ys], ".-", color=f"C{i}", alpha=0.8,
                                label=label(method) if j == 0 else None)
        ref = next(iter(next(iter(pools.values())).values()))["pool"][0].get("sim_a_exploit_value")
        if ref is not None:
            axes[2].axhline(ref, color="k", ls="--", lw=1, label="inside sim-a (1/gamma)")
        axes[0].set_title("pool: mean pairwise TV between members")
        axes[1].set_title("members' mean TV to sim-a (1/gamma)")
        axes[2].set_title("exploit's value inside the members")
        for ax in axes:
            ax.set_xlabel("policy step")
        axes[2].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "pool_diversity.png", dpi=110)
        plt.close(fig)
        names.append("pool_diversity.png")
    return names


def compute_plot(data: dict, out_dir: Path, colors: dict) -> bool:
    """compute.png: real-user reward against cumulative training compute, mean over seeds at
    each evaluation (the untrained policy: a dotted line). False when the log has no compute."""
    import matplotlib.pyplot as plt

    curves = {}
    for method, seeds in data.items():
        series = [d["eval"] for d in seeds.values() if d["eval"]]
        if not series or not all("compute_total" in r for s in series for r in s):
            continue
        n = min(len(s) for s in series)
        curves[method] = ([np.mean([s[i]["compute_total"]["flops"] for s in series]) for i in range(n)],
                          [np.mean([s[i]["real_users"] for s in series]) for i in range(n)])
    top = max((max(x) for x, _ in curves.values()), default=0)
    if not top:
        return False
    scale, prefix = next((v, p) for v, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1, "")) if top >= v)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, (x, y) in curves.items():
        if max(x) > 0:
            ax.plot(np.array(x) / scale, y, "o-", label=label(method), color=colors[method])
        else:                                    # evaluated only (base): no training compute
            ax.axhline(y[-1], ls=":", color=colors[method], label=label(method))
    ax.set_xlabel(f"cumulative training compute ({prefix}FLOP: rollouts + updates, minscope/compute.py)")
    ax.set_ylabel("real-user reward (mean over seeds)")
    ax.set_title("held-out reward against training compute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "compute.png", dpi=110)
    plt.close(fig)
    return True


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


def write_report(run_dir, reference: dict, extra_md: str = "") -> dict:
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / "metrics.jsonl")   # a damaged log: one message naming it
    results = summarize(records, reference)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    images = plots(records, run_dir)
    ref = results["reference"]
    lines = [f"# minscope toy experiment: `{run_dir.name}`", "",
             f"Exact reference values on the real users: random policy **{ref['random']:.3f}**, "
             f"best fixed sequence **{ref['best_fixed']:.3f}**, best adaptive policy **{ref['best_adaptive']:.3f}**; "
             f"the exploit ({', '.join(ref.get('exploit', ['?']))}) scores {ref.get('exploit_real', float('nan')):.3f} on real users "
             f"and {ref.get('exploit_sharpened', float('nan')):.3f} inside the gamma-sharpened users.", "",
             "| method | real users, final (95% CI) | per seed | real users, best | at best panel ckpt | unseen sims, final | "
             "train reward first → last | entropy first → last | zero-var first → last | most common final sequence |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    header = lines[-2:]

    def row(r):
        h = r["heldout"]["real_users"]
        ci = h["final_ci95"]
        seeds = " ".join(fmt(x)[1:] if x is not None and 0 <= x < 1 else fmt(x) for x in h.get("final_per_seed", []))
        return (f"| {r['label']} | {fmt(h['final_mean'])} ({fmt(ci[0], 2)}–{fmt(ci[1], 2)}) | {seeds} | {fmt(h['best_mean'])} | "
                f"{fmt(h['selected_mean'])} | {fmt(r['heldout']['unseen']['final_mean'])} | "
                f"{fmt(r['train_reward']['first'], 2)} → {fmt(r['train_reward']['last'], 2)} | "
                f"{fmt(r['entropy']['first'], 2)} → {fmt(r['entropy']['last'], 2)} | "
                f"{fmt(r['zero_variance']['first'], 2)} → {fmt(r['zero_variance']['last'], 2)} | {r['top_sequence'].replace(' | ', ', ')} |")

    main = {m: r for m, r in results["methods"].items() if ":" not in m}
    ablations = {m: r for m, r in results["methods"].items() if ":" in m}
    lines += [row(r) for r in main.values()]
    finals = [r for r in records if r.get("kind") == "eval" and "real_users_rewards" in r]
    n_final = len(max(finals, key=lambda r: r["step"])["real_users_rewards"]) if finals else 0
    lines += ["", f"Final = last evaluation ({n_final} real-user episodes per seed, the policy sampling at its "
              "training temperature), averaged over seeds; CI from a two-level "
              "bootstrap (seeds, then episodes). Best = each seed's best evaluation, averaged. "
              "'At best panel ckpt' = the real-user score of the checkpoint with the best mean over the six "
              "simulators (what the paper keeps).", ""]
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
    lines += compute_md(results) + monitor_md(results) + pool_md(results)
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
        from .toy_models import fidelity_problems   # (torch only when there is a toy run to report)

        problems = fidelity_problems(f)
        if problems:
            lines += ["**The fidelity check fails** (" + "; ".join(problems) + "): these simulators are too far "
                      "from their world for the results above to say much about simulator collapse.", ""]
    if extra_md:
        lines += [extra_md, ""]
    lines += ["## Transcripts (final policy vs real users)", ""]
    data = collect(records)
    for method, seeds in data.items():
        first = next(iter(seeds.values()))
        if first["eval"]:
            lines.append(f"**{label(method)}**")
            lines += ["```"] + first["eval"][-1].get("transcripts", [])[:2] + ["```"]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    return results
