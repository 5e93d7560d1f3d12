"""Plot P4G runs trained with `--p4g-reward expected`: per training step, the reward (the
training readout) beside the readings the policy never trained on (the held-out readout and
the parsed reward), one panel per reading, one line per run.

    python bench/studies/plot_readings.py runs/p4g-expected-s0 runs/p4g-expected-s1 --out docs/img/p4g_expected.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

READINGS = (("readout_decision", "training readout (the reward)"),
            ("readout_asked", "held-out readout (other words)"),
            ("reward_parsed", "parsed reward (stated amount / $2)"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="run folders written by train.py --env p4g --p4g-reward expected")
    p.add_argument("--out", default="readings.png", help="the PNG to write (default readings.png)")
    args = p.parse_args(argv)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(READINGS), figsize=(4 * len(READINGS), 3.2), sharey=True)
    for run in map(Path, args.runs):
        log = run / "metrics.jsonl"
        if not log.is_file():
            sys.exit(f"{run}: no metrics.jsonl there")
        steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        train = [r for r in steps if r.get("kind") == "train"]
        if not any("readout_decision" in r for r in train):
            sys.exit(f"{run}: no readouts logged (was it trained with --p4g-reward expected?)")
        for ax, (key, _) in zip(axes, READINGS):
            ax.plot([r["step"] for r in train], [r.get(key, float("nan")) for r in train], marker=".", label=run.name)
    for ax, (_, title) in zip(axes, READINGS):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("step mean, fraction of $2")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
