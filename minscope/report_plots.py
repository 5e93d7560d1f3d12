"""The toy report's PNG plots, drawn from a run's records: the training and held-out
curves (curves.png), the collapse meter, held-out reward against training compute, and the
pool's diversity over training. One colour per method on every panel.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from .report_results import collect, label


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
