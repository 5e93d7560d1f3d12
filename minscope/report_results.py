"""A toy run's results.json: its metrics.jsonl summarised per arm (method), over seeds.

The headline interval of an arm's held-out reward is a t-interval over seeds (each seed's
value one unit, n - 1 degrees of freedom; `minscope.seedstats`): what varies between runs is
the seed, and ~1,000 episodes make each seed's value precise. Arms are compared by paired
differences over the seeds both were trained on (each method against RL (Single) and against
the untrained Base), with their t-intervals. A second interval, from a two-level bootstrap
(resample seeds, then episodes within each), is kept beside it and labelled as such: with
three seeds it is close to the seeds' min..max, far narrower than the t-interval.

Every table (`report_tables.py`) and plot (`report_plots.py`) of the report reads what
`summarize` returns, or the records `collect` sorts.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .monitor import first_alarms
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
