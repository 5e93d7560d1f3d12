"""Where the toy experiment's time goes: one arm of each kind, and the tiny-model build.

    python bench/profile_toy.py --cache-dir .cache/minscope            # arms (models cached)
    python bench/profile_toy.py --build --cache-dir /tmp/profile-cache  # the model build (SFT)

One CPU thread. Each arm runs a few steps with every measurement switched on more often
than the default run does (evaluations, the collapse meter, pool diversity), so each kind
of work is timed a few times; the per-call seconds are then multiplied by how often the
DEFAULT run (`ToyConfig()`) does each of them, which gives the default arm's projected
seconds and the share of each phase in it. Shares are what to read on a loaded machine;
the absolute seconds come with the load average they were measured under.

Time is attributed to the innermost phase running (exclusive times):

    train/rollout   the training step's rollout: policy / simulator, prefill / decode
                    (the LM forwards); the sampling ops around them (softmax, multinomial,
                    KV-cache moves); the rest (chat templates, tokenizer, env, scoring)
    train/update    the GRPO updates (policy, trained simulator, realism anchor)
    eval            panel evaluation (the final one separately: 256 episodes per persona)
    meter           the collapse meter
    pool            pool-diversity measurement (Co-Training arms)
    save            the arm's state written after every step
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from minscope import experiment, methods, rollout, sampling, sft  # noqa: E402
from minscope.models import quiet  # noqa: E402


class Profiler:
    """Exclusive CPU time per phase path ("eval/policy/decode"), and calls per phase. CPU time
    of this (one-thread) process, not wall time: on a loaded machine it is what the work
    costs, and the wall time is that divided by the share of a core the process got."""

    def __init__(self):
        self.stack, self.time, self.calls = [], defaultdict(float), defaultdict(int)
        self.t = time.process_time()

    def _flush(self):
        now = time.process_time()
        self.time["/".join(self.stack) or "other"] += now - self.t
        self.t = now

    @contextlib.contextmanager
    def phase(self, name):
        self._flush()
        self.stack.append(name)
        self.calls["/".join(self.stack)] += 1
        try:
            yield
        finally:
            self._flush()
            self.stack.pop()

    def wrap(self, owner, attr, name):
        fn = getattr(owner, attr)
        prof = self

        def wrapped(*a, **kw):
            label = name(*a, **kw) if callable(name) else name
            with prof.phase(label):
                return fn(*a, **kw)
        setattr(owner, attr, wrapped)
        return fn


def instrument(prof: Profiler):
    """Patch the functions whose time is measured (names as experiment/methods import them)."""
    prof.wrap(experiment, "eval_record", lambda *a, final=False, **kw: "eval_final" if final else "eval")
    prof.wrap(experiment, "collapse_meter", "meter")
    prof.wrap(experiment, "measure_pool", "pool")
    prof.wrap(experiment, "save_atomic", "save")
    prof.wrap(experiment, "train_step", "train")
    prof.wrap(methods, "rollout", "rollout")
    prof.wrap(methods, "grpo_update", "update")
    prof.wrap(methods, "anchor_step", "update")
    prof.wrap(rollout.LMSpeaker, "_sample",
              lambda self, *a, **kw: "policy" if self.role == "agent" else "simulator")
    prof.wrap(sampling._Forward, "__call__",
              lambda self, input_ids, *a, **kw: "prefill" if input_ids.shape[1] > 1 else "decode")
    prof.wrap(sft, "encode_chat", "sft_data")


def default_counts(kind: str, **cadence) -> dict:
    """How often the default run (with `cadence` overrides) does each thing in one arm of `kind`."""
    c = replace(experiment.ToyConfig(), **cadence)
    if kind == "base":
        return {"eval_final": 1, "meter": 1 if c.meter_every else 0}
    evals = [s for s in range(c.steps + 1) if s % c.eval_every == 0 or s == c.steps]
    meters = [s for s in evals if c.meter_every and (s % c.meter_every == 0 or s == c.steps)]
    out = {"train": c.steps, "save": c.steps, "eval": len(evals) - 1, "eval_final": 1, "meter": len(meters)}
    if kind.partition(":")[0] in ("cotrain", "population"):
        out["pool"] = len(range(0, c.steps, getattr(c, "pool_measure_every", 0) or c.pool_every))   # (older code: none)
    return out


def profile_arm(toy, method: str, steps: int, run_dir: Path) -> dict:
    prof = Profiler()
    saved = {k: getattr(experiment, k) for k in ("eval_record", "collapse_meter", "measure_pool",
                                                 "save_atomic", "train_step")}
    saved_m = {k: getattr(methods, k) for k in ("rollout", "grpo_update", "anchor_step")}
    saved_r = (rollout.LMSpeaker._sample, sampling._Forward.__call__)
    instrument(prof)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        log = experiment.MetricsLog(run_dir / f"{method}.jsonl")
        experiment.run_arm(toy, method, 0, run_dir, log, progress=False, alarm_line=None)
    finally:
        for k, v in saved.items():
            setattr(experiment, k, v)
        for k, v in saved_m.items():
            setattr(methods, k, v)
        rollout.LMSpeaker._sample, sampling._Forward.__call__ = saved_r
    prof._flush()
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "time": dict(prof.time),
            "calls": dict(prof.calls)}


def top_of(path: str) -> str:
    return path.split("/")[0]


def project(res: dict, kind: str, **cadence) -> tuple[dict, float]:
    """Per-phase seconds of one default arm: measured seconds per call x default calls."""
    counts = default_counts(kind, **cadence)
    out = defaultdict(float)
    for path, sec in res["time"].items():
        top = top_of(path)
        if top not in counts or not res["calls"].get(top):
            continue
        per_call = sec / res["calls"][top]
        out[path] += per_call * counts[top]
    return dict(out), sum(out.values())


GROUPS = [  # (row label, predicate on the phase path)
    ("train rollout: policy decode", lambda p: p.startswith("train/rollout/policy/decode")),
    ("train rollout: policy prefill", lambda p: p.startswith("train/rollout/policy/prefill")),
    ("train rollout: simulator decode", lambda p: p.startswith("train/rollout/simulator/decode")),
    ("train rollout: simulator prefill", lambda p: p.startswith("train/rollout/simulator/prefill")),
    ("train rollout: sampling ops, KV-cache moves", lambda p: p in ("train/rollout/policy", "train/rollout/simulator")),
    ("train rollout: templates, tokenizer, env", lambda p: p == "train/rollout"),
    ("train update (GRPO, anchor)", lambda p: p.startswith("train/update")),
    ("train other", lambda p: p == "train"),
    ("evaluation (every 10 steps)", lambda p: top_of(p) == "eval"),
    ("evaluation, final (256/persona)", lambda p: top_of(p) == "eval_final"),
    ("collapse meter", lambda p: top_of(p) == "meter"),
    ("pool diversity", lambda p: top_of(p) == "pool"),
    ("state save", lambda p: top_of(p) == "save"),
]


def lm_split(times: dict) -> str:
    dec = sum(v for p, v in times.items() if p.endswith("/decode"))
    pre = sum(v for p, v in times.items() if p.endswith("/prefill"))
    tot = sum(times.values())
    return f"LM forwards: decode {dec / tot:.0%}, prefill {pre / tot:.0%} of the arm"


def run_arms(args):
    from minscope.armpool import worker_init

    worker_init()
    kinds = args.arms.split(",")
    cfg = replace(experiment.ToyConfig(), steps=args.steps, eval_every=max(1, args.steps // 2),
                  meter_every=args.steps, pool_every=max(1, args.steps // 2), workers=1)
    toy = experiment.Toy(cfg, args.cache_dir, log=lambda *a: None, progress=False)
    table, totals, results = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            run_dir = Path(tmp) / kind.replace(":", "_")
            run_dir.mkdir()
            res = results[kind] = profile_arm(toy, kind, args.steps, run_dir)
            proj, total = project(res, kind)
            table[kind], totals[kind] = proj, total
            per_step = sum(v for p, v in res["time"].items() if top_of(p) == "train") / max(1, res["calls"].get("train", 1))
            print(f"{kind:12s} {args.steps} steps: {res['wall']:6.1f} s wall, {res['cpu']:6.1f} s CPU; train step "
                  f"{per_step:.3f} CPU-s; "
                  f"projected default arm {total:6.1f} CPU-s; {lm_split(proj)}", flush=True)
            if args.raw:
                print(json.dumps(res, indent=1))
    print(f"\nload average {os.getloadavg()[0]:.2f} (1 min); torch threads {torch.get_num_threads()}")
    print("\nshare of each phase in one default arm (ToyConfig(): 50 steps, eval every 10, meter every 30, "
          "pool every 4), from per-call seconds measured here\n")
    print("| phase | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for label, pred in GROUPS:
        cells = []
        for kind in kinds:
            sec = sum(v for p, v in table[kind].items() if pred(p))
            cells.append(f"{sec / totals[kind]:.0%}" if totals[kind] else "-")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| **projected default arm, CPU-s** | " + " | ".join(f"{totals[k]:.0f}" for k in kinds) + " |")
    print_totals("default cadence", totals)
    cadence = dict(kv.split("=") for kv in args.cadence.split(",")) if args.cadence else {}
    cadence = {k: int(v) for k, v in cadence.items()}
    if cadence:
        other = {kind: project(results[kind], kind, **cadence)[1] for kind in kinds}
        print_totals(f"cadence {cadence}", other)
    if args.json:
        Path(args.json).write_text(json.dumps({"per_arm_s": totals, "phases": table, "raw": results,
                                               "load": os.getloadavg()[0]}, indent=1))


def print_totals(label: str, totals: dict) -> None:
    """Every default arm's CPU-seconds from the measured kinds (base ~ the final evaluation of
    an untrained policy; ensemble ~ single), and the wall time that predicts on n cores."""
    arms = experiment.ToyConfig().arms()
    est = dict(totals)
    est.setdefault("ensemble", est.get("single", 0.0))
    per = [est.get(m.partition(":")[0], 0.0) for m, _ in arms]
    total = sum(per)
    line = ", ".join(f"{k} {v:.0f}" for k, v in est.items())
    print(f"\n{label}: per arm {line} CPU-s; all {len(arms)} arms {total:.0f} CPU-s = {total / 60:.1f} CPU-min")
    for cores in (2, 8):
        print(f"  on {cores} free cores, {cores} workers: {makespan(per, cores) / 60:.1f} min of arms "
              f"(the arms' pool: slowest first, each to the next free worker)")


def makespan(costs: list[float], workers: int) -> float:
    """When the last arm ends, when arms go slowest first to whichever worker is free first."""
    free = [0.0] * workers
    for c in sorted(costs, reverse=True):
        i = free.index(min(free))
        free[i] += c
    return max(free)


def run_build(args):
    """SFT of one simulator: per-step seconds, and what the whole default build costs."""
    from minscope.armpool import worker_init
    from minscope.toy_models import ToyModelConfig, ToyModels

    worker_init()
    prof = Profiler()
    instrument(prof)
    c = replace(ToyModelConfig(), workers=1)
    models = ToyModels(args.cache_dir, c, progress=False, log=lambda *a: None)
    counted = {"sim_a_steps": args.build_steps}
    cfg = replace(c, **counted)
    models.cfg = cfg
    t0 = time.process_time()
    orig_sft = sft.sft
    steps_time = {}

    def timed_sft(*a, **kw):
        t = time.process_time()
        with prof.phase("sft"):
            out = orig_sft(*a, **kw)
        steps_time["sft"] = time.process_time() - t
        return out
    import minscope.toy_models as tm
    tm.sft = timed_sft
    with prof.phase("train_model"):
        models.train("sim-a")
    tm.sft = orig_sft
    prof._flush()
    wall = time.process_time() - t0
    total_steps = c.sim_a_steps + c.vs_steps + c.policy_steps + c.aligned_steps + 5 * c.sim_steps
    data = prof.time.get("train_model/sft/sft_data", 0.0)
    per_step = (steps_time["sft"] - data) / args.build_steps
    print(f"sim-a, {args.build_steps} SFT steps: {wall:.1f} CPU-s in all; SFT {steps_time['sft']:.1f} CPU-s "
          f"(data encoding {data:.1f} CPU-s, then {per_step * 1000:.1f} ms per step of batch {c.batch})")
    print(f"default build: {total_steps} SFT steps over 9 models -> about {(total_steps * per_step + 9 * data) / 60:.1f} "
          f"CPU-minutes (steps + data encoding per model); load average {os.getloadavg()[0]:.2f}")


def main():
    quiet()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=os.environ.get("MINSCOPE_CACHE", ".cache/minscope"))
    p.add_argument("--arms", default="base,single,vs,cotrain,population,oracle")
    p.add_argument("--steps", type=int, default=4, help="training steps per profiled arm")
    p.add_argument("--build", action="store_true", help="profile the tiny-model build instead (one simulator)")
    p.add_argument("--build-steps", type=int, default=100)
    p.add_argument("--json", help="also write the projected per-phase seconds here")
    p.add_argument("--cadence", help="also project with these ToyConfig cadences, e.g. "
                   "eval_every=25,meter_every=50,pool_measure_every=8")
    p.add_argument("--raw", action="store_true", help="print every phase path's measured seconds")
    args = p.parse_args()
    print("command: " + shlex.join(["python", "bench/profile_toy.py", *sys.argv[1:]]), flush=True)
    torch.set_num_threads(1)
    run_build(args) if args.build else run_arms(args)


if __name__ == "__main__":
    main()
