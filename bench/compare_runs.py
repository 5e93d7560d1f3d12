"""Check that a change to the toy's code is pure speed: the same fixed-seed short run of
every arm kind, before and after, must log the same numbers (bit for bit).

    cd OLD_CHECKOUT && python /path/to/bench/compare_runs.py run /tmp/before --cache-dir C
    cd NEW_CHECKOUT && python bench/compare_runs.py run /tmp/after --cache-dir C
    python bench/compare_runs.py diff /tmp/before/check /tmp/after/check
    python bench/compare_runs.py diff /tmp/before/check /tmp/after/check --ignore compute,compute_total

`--ignore KEYS`: records' top-level fields left out of the comparison (fields that only the new
code logs, e.g. the compute counts: everything else must still be identical).

`run` imports minscope from the current directory (so the same script runs old code).
`diff` compares every arm's records (metrics.jsonl) field by field, wall-time fields aside,
and prints per arm kind: identical, or the first fields that differ and by how much.

It also shows that the toy's numbers do not depend on the CPU (minscope/precision.py): run
the same code twice, once with ATEN_CPU_CAPABILITY=default, and diff. (Code before the toy's
float64 arithmetic wanted the same PYTHONHASHSEED on both sides too: a few figures iterated
over Python sets of strings; they are sorted now.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from collections import defaultdict
from pathlib import Path

TIMING = {"seconds", "rollout_s"}
ARMS = ("base", "single", "vs", "ensemble", "cotrain", "population", "oracle")


def run(out: Path, cache_dir: str, workers: int, methods=ARMS, ablations=("cotrain:anchor",)):
    sys.path.insert(0, os.getcwd())
    import torch

    from minscope import experiment
    from minscope.models import quiet

    quiet()
    torch.set_num_threads(1)
    cfg = experiment.ToyConfig(name="check", methods=tuple(methods), seeds=(0,), steps=4, eval_every=2, meter_every=2,
                               pool_every=2, final_episodes=64, ablations=tuple(ablations), workers=workers)
    experiment.run(cfg, out, cache_dir, log=print, progress=False)


def flat(x, prefix=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from flat(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, x


def diff(a: Path, b: Path, ignore=()) -> int:
    def load(d):
        recs = defaultdict(list)
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            recs[f"{r['method']}-s{r['seed']}"].append(r)
        return recs
    ra, rb = load(a), load(b)
    bad = 0
    for arm in sorted(set(ra) | set(rb)):
        xa, xb = ra.get(arm, []), rb.get(arm, [])
        problems = [] if len(xa) == len(xb) else [f"{len(xa)} vs {len(xb)} records"]
        worst = 0.0
        for i, (p, q) in enumerate(zip(xa, xb)):
            keep = lambda k: k.split(".")[-1] not in TIMING and k.split(".")[0].split("[")[0] not in ignore  # noqa: E731
            fp = {k: v for k, v in flat(p) if keep(k)}
            fq = {k: v for k, v in flat(q) if keep(k)}
            for k in sorted(set(fp) | set(fq)):
                u, v = fp.get(k), fq.get(k)
                if u == v or (isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v)):
                    continue
                if isinstance(u, (int, float)) and isinstance(v, (int, float)):
                    worst = max(worst, abs(u - v))
                if len(problems) < 3:
                    problems.append(f"record {i} ({p.get('kind')} step {p.get('step')}) {k}: {u!r} vs {v!r}")
        n = sum(1 for r in xa for _ in flat(r))
        if problems:
            bad += 1
            print(f"{arm:22s} DIFFERS (largest numeric difference {worst:.3g}): " + "; ".join(problems))
        else:
            print(f"{arm:22s} identical ({len(xa)} records, {n} values)")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--cache-dir", default=os.environ.get("MINSCOPE_CACHE", ".cache/minscope"))
    r.add_argument("--workers", type=int, default=1)
    r.add_argument("--methods", default=",".join(ARMS))
    r.add_argument("--ablations", default="cotrain:anchor")
    d = sub.add_parser("diff")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--ignore", default="", help="comma-separated top-level record fields not compared")
    args = p.parse_args()
    print("command: " + shlex.join(["python", "bench/compare_runs.py", *sys.argv[1:]]), flush=True)
    if args.cmd == "run":
        run(args.out, args.cache_dir, args.workers, args.methods.split(","), [a for a in args.ablations.split(",") if a])
    else:
        sys.exit(1 if diff(args.a, args.b, set(filter(None, args.ignore.split(",")))) else 0)


if __name__ == "__main__":
    main()
