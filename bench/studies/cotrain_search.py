"""Population Co-Training's configuration search in the toy, on seeds of its own.

    python bench/studies/cotrain_search.py [--seeds 100,101,102] [--variants "V;V;..."] [--out runs/search]

Each variant is an arm name as train.py's ablations spell it (METHOD[:TWEAK+TWEAK]), with
optional ToyConfig settings after "@" (e.g. "population@sim_beta=0,sim_weight_decay=0,sim_epochs=2":
the toy's earlier simulator optimiser). Variants sharing their settings train in one run folder
(OUT/<settings>), every variant on every seed; the default seeds (100-102) are apart from the
seeds the README and docs/RESULTS.md report (0-5), so that choosing a configuration here does not
tune the numbers reported there. Prints one table: the real-user reward at the last step (mean,
two-level bootstrap CI, per seed), the best-panel checkpoint's, the last pool's diversity (pairwise
TV, its noise floor, the excess), the exploit's value inside the pool, the pool's cue rate, and
the top sequence. Interrupted: run the same command again (every run folder resumes).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from minscope import experiment, report_results, report_tables  # noqa: E402
from minscope.files import read_jsonl  # noqa: E402

DEFAULT_VARIANTS = ("single", "population", "population@sim_beta=0,sim_weight_decay=0,sim_epochs=2",
                    "population:adversarial", "population:hardest", "population:adversarial+hardest",
                    "population:adversarial+anchor")


def parse_variant(text: str):
    arm, _, settings = text.partition("@")
    values = {}
    for item in filter(None, settings.split(",")):
        key, _, raw = item.partition("=")
        field = {f.name: f for f in dataclasses.fields(experiment.ToyConfig)}.get(key)
        if field is None:
            raise SystemExit(f"{text}: {key!r} is not a ToyConfig setting")
        default = getattr(experiment.ToyConfig(), key)
        values[key] = type(default)(float(raw)) if isinstance(default, (int, float)) else raw
    return arm, tuple(sorted(values.items()))


def row(method: str, r: dict) -> str:
    h = r["heldout"]["real_users"]
    lo, hi = h.get("final_seed_ci95") or (None, None)       # t over seeds (None with one seed)
    pool = (r.get("pool_diversity") or {}).get("final", {})
    seeds = " ".join(f"{x:.3f}"[1:] for x in h["final_per_seed"])
    return (f"| {method} | {report_tables.mean_ci(h['final_mean'], [lo, hi])} | {seeds} | {h['selected_mean']:.3f} | "
            f"{report_tables.fmt(pool.get('pairwise_tv'))} / {report_tables.fmt(pool.get('pairwise_floor'))} / "
            f"{report_tables.fmt(pool.get('pairwise_tv_excess'))} | {report_tables.fmt(pool.get('exploit_value'))} | "
            f"{report_tables.fmt(pool.get('cue_rate'))} | {r['top_sequence'].replace(' | ', ', ')} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="100,101,102")
    p.add_argument("--variants", default=";".join(DEFAULT_VARIANTS),
                   help="';'-separated (settings contain commas); default: " + "; ".join(DEFAULT_VARIANTS))
    p.add_argument("--out", default="runs/search")
    p.add_argument("--cache-dir", default=".cache/minscope")
    p.add_argument("--workers", type=int, default=0)
    a = p.parse_args(argv)
    seeds = tuple(int(s) for s in a.seeds.split(","))
    texts = [v.strip() for v in a.variants.split(";") if v.strip()]
    groups: dict = {}
    for text in texts:
        arm, settings = parse_variant(text)
        groups.setdefault(settings, []).append((arm, text))
    rows = []
    for settings, arms in groups.items():
        tag = "default" if not settings else "_".join(f"{k}={v:g}" if not isinstance(v, str) else f"{k}={v}"
                                                       for k, v in settings)
        plain = tuple(arm for arm, _ in arms if ":" not in arm)
        tweaked = tuple(arm for arm, _ in arms if ":" in arm)
        cfg = experiment.ToyConfig(name=tag, methods=plain, seeds=seeds, ablations=tweaked, ablation_seeds=seeds,
                                   workers=a.workers, **dict(settings))
        run_dir = Path(a.out) / tag
        print(f"== {tag}: {', '.join(t for _, t in arms)} x seeds {a.seeds} -> {run_dir}", flush=True)
        experiment.run(cfg, run_dir=run_dir, cache_dir=a.cache_dir, resume=run_dir.exists())
        results = report_results.summarize(read_jsonl(run_dir / "metrics.jsonl"), experiment.reference_values(cfg.gamma, cfg.world))
        rows += [row(text, results["methods"][arm]) for arm, text in arms]
    print("\n| variant | real users, final (95% t over seeds) | per seed | at best panel ckpt | pool TV / floor / excess "
          "| exploit inside | cue rate | top final sequence |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
