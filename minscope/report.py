"""Turn a run's metrics.jsonl into results.json, PNG plots and report.md.

The headline interval of an arm's held-out reward is a t-interval over seeds (each seed's
value one unit, n - 1 degrees of freedom; `minscope.seedstats`): what varies between runs is
the seed, and ~1,000 episodes make each seed's value precise. Arms are compared by paired
differences over the seeds both were trained on (each method against RL (Single) and against
the untrained Base), with their t-intervals. A second interval, from a two-level bootstrap
(resample seeds, then episodes within each), is kept beside it and labelled as such: with
three seeds it is close to the seeds' min..max, far narrower than the t-interval.

    python -m minscope.report --seed-table RUN_DIR [RUN_DIR ...]

prints the per-arm table (final and best-panel checkpoints side by side) and the paired
comparisons of the finished arms of one or more run folders (while a run is going too).

One file, though long: every section reads the same `summarize` output, and the tables,
intervals and plots of one run are checked together (`report_html.py` turns the result into
the self-contained page).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from .files import read_json
from .runfolder import read_log
from .monitor import first_alarms
from .report_html import code_fence, write_html, write_report_file
from .seedstats import paired, t_interval

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
        seed_ids = [seed for seed, d in seeds.items() if d["eval"]]
        final_by_seed = {seed: d["eval"][-1]["real_users"] for seed, d in seeds.items() if d["eval"]}
        selected_by_seed = {seed: max(d["eval"], key=lambda x: x["panel"])["real_users"]
                            for seed, d in seeds.items() if d["eval"]}

        def mean_of(key, recs):
            vals = [r[key] for r in recs if r.get(key) is not None]
            return float(np.mean(vals)) if vals else None

        def first_last(key, k=3):
            def avg(recs):
                vals = [r[key] for r in recs if r.get(key) is not None]
                return float(np.mean(vals)) if vals else None
            firsts = [v for v in (avg(t[:k]) for t in trains) if v is not None]
            lasts = [v for v in (avg(t[-k:]) for t in trains) if v is not None]
            return {"first": float(np.mean(firsts)) if firsts else None,
                    "last": float(np.mean(lasts)) if lasts else None}

        def interval(by_seed):
            ci = t_interval(list(by_seed.values()))
            return [ci["lo"], ci["hi"]]

        res = {
            "label": label(method),
            "seeds": len(evals),
            "heldout": {
                "real_users": {
                    "final_mean": mean_of("real_users", final),
                    "final_seed_ci95": interval(final_by_seed),      # t over seeds: the headline
                    "final_ci95": two_level_bootstrap([r.get("real_users_rewards", [r["real_users"]]) for r in final]),
                    "final_per_seed": [r["real_users"] for r in final],
                    "seeds": seed_ids,
                    "best_mean": float(np.mean([max(x["real_users"] for x in e) for e in evals])),
                    "selected_mean": float(np.mean([max(e, key=lambda x: x["panel"])["real_users"] for e in evals])),
                    "selected_seed_ci95": interval(selected_by_seed),
                    "selected_per_seed": [selected_by_seed[s] for s in seed_ids],
                },
                "unseen": {"final_mean": mean_of("unseen", final)},
                "seen": {"final_mean": mean_of("seen", final)},
                "panel": {"final_mean": mean_of("panel", final)},
            },
            "train_reward": first_last("train_reward"),
            "entropy": first_last("policy_entropy"),
            "act_entropy": first_last("act_entropy"),
            "final_act_entropy": mean_of("act_entropy", final),
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
        if any("sim_clip_frac" in r for t in trains for r in t):
            res["sim_update"] = sim_update_summary(trains)
        if all("compute_total" in e[-1] for e in evals):
            res["compute"] = compute_summary([e[-1]["compute_total"] for e in evals])
        results["methods"][method] = res
    results["paired"] = paired_summary(data)
    single = results["methods"].get("single", {}).get("compute", {}).get("flops")
    for r in results["methods"].values():
        if "compute" in r:
            r["compute"]["vs_single"] = r["compute"]["flops"] / single if single else None
    return results


def seed_values(seeds: dict, rule: str) -> dict:
    """seed -> the arm's real-user reward on that seed: at its last evaluation ("final") or
    at the evaluation with the best panel mean ("selected", the paper's checkpoint rule)."""
    out = {}
    for seed, d in seeds.items():
        if d["eval"]:
            rec = d["eval"][-1] if rule == "final" else max(d["eval"], key=lambda x: x["panel"])
            out[seed] = rec["real_users"]
    return out


def paired_summary(data: dict) -> dict:
    """Each arm against RL (Single) and against Base: mean paired difference over the seeds
    both have, with its t-interval, at the final and at the best-panel checkpoint. Base is
    never trained, so its value is the same at both checkpoints. Ablation arms are left out."""
    out = {}
    for ref in ("single", "base"):
        if ref not in data:
            continue
        for method, seeds in data.items():
            if method == ref or (ref == "single" and method == "base") or ":" in method:
                continue        # (ablations ':' have their own section, unpaired)
            for rule in ("final", "selected"):
                d = paired(seed_values(seeds, rule), seed_values(data[ref], rule))
                if d["n"]:
                    out[f"{method}|{ref}|{rule}"] = {"method": method, "against": ref, "checkpoint": rule, **d}
    return out


def sim_update_summary(trains: list[list[dict]]) -> dict:
    """The trained simulator's update: its clip fraction (first and last 3 steps, mean over
    seeds) and, for Population Co-Training, the first pass's clip fraction and mean |log
    importance ratio| by the age of the snapshot that played, counted in updates of the live
    adapter since that snapshot (0: the same weights), pooled over steps and seeds,
    token-weighted. The log's age is the step minus the snapshot's label, and a snapshot
    labelled k > 0 is taken after update k (methods.ratio_by_age)."""
    def avg(recs):
        vals = [r["sim_clip_frac"] for r in recs if r.get("sim_clip_frac") is not None]
        return float(np.mean(vals)) if vals else None
    out = {"clip_frac_first": avg([r for t in trains for r in t[:3]]),
           "clip_frac_last": avg([r for t in trains for r in t[-3:]]),
           "clip_frac_mean": avg([r for t in trains for r in t])}
    ages: dict[int, list] = {}
    for t in trains:
        for r in t:
            for age, v in (r.get("sim_ratio_by_age") or {}).items():
                updates = int(age) if int(age) == r["step"] else int(age) - 1   # label 0: before update 0
                acc = ages.setdefault(updates, [0, 0.0, 0.0])
                acc[0] += v["tokens"]
                acc[1] += v["clip_frac"] * v["tokens"]
                acc[2] += v["abs_log_ratio"] * v["tokens"]
    if ages:
        out["by_age"] = {str(a): {"tokens": n, "clip_frac": c / n if n else None, "abs_log_ratio": lr / n if n else None}
                         for a, (n, c, lr) in sorted(ages.items())}
    return out


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
            vals = np.array([[np.nan if r.get(key) is None else r[key] for r in s[:n]] for s in series], dtype=float)
            if n == 1:      # evaluated once (Base, the untrained policy): a level to compare with
                ax.axhline(vals.mean(), linestyle="--", label=label(method), color=colors[method])
                continue
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


def seed_table_md(results) -> list[str]:
    """The per-arm table and the paired comparisons, for RESULTS.md."""
    main = [r for m, r in results["methods"].items() if ":" not in m]
    return TABLE_HEADER + [table_row(r) for r in main] + [""] + paired_md(results) + sim_update_md(results)


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
