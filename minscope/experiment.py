"""The toy experiment: every method x seed, trained and evaluated on the panel, resumable.

    runs/<name>/config.json        the settings (printed at start)
    runs/<name>/fidelity.json      the training simulator checked where the exploit lives
    runs/<name>/arms/<arm>.jsonl   each arm's live log: one line per training step and evaluation
    runs/<name>/arms/<arm>.pt      the latest state of each arm (adapters, optimizers, RNGs)
    runs/<name>/arms/<arm>.best.pt the adapter with the best panel score so far
    runs/<name>/metrics.jsonl      every arm's log in one file, written when all arms are done
    runs/<name>/results.json, report.md, *.png     written by minscope.report

Every arm saves its full state after every step (tiny models: a few hundred KB; files are
replaced atomically, `minscope/files.py`), so an interrupted run loses at most the step in
progress, and `--resume` continues where it stopped. All randomness (torch, numpy, python) is restored too, so on CPU a resumed run ends
with the same numbers as an uninterrupted one.

The run folder's layout and readers are `minscope/runfolder.py`; the settings and the shared
set-up (models, environment, panel, arms) `minscope/toy_setup.py`; the worker processes
`minscope/armpool.py`.

Evaluations run on random streams of their own, seeded by (seed, step) (`isolated_rng`): how
often or how long an arm is evaluated does not change its training, and re-evaluating a saved
checkpoint with `eval_record` reproduces the number the run logged.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from . import compute, runfolder
from .armpool import default_workers, run_pool
from .diversity import member_profile, pool_diversity
from .envs.toy_words import act_entropy
from .evaluate import collapse_meter, eval_seed, evaluate_panel, isolated_rng
from .files import RunLock, load_state, save_atomic, write_text_atomic
from .loop import Log, run_loop
from .methods import Method, train_step
from .adapters import adapter_state, load_adapter_state
from .precision import rounded
from .monitor import CollapseMonitor
from .runfolder import MetricsLog, arm_name, check_saved_arms
from .sft import AnchorBatches
from .simulators import Frozen, Population
from .toy_fidelity import aligned_fidelity, fidelity, fidelity_problems
from .toy_models import ToyModels

# the set-up, part of this module's API: settings, models, environment, panel, arms
from .toy_setup import (  # noqa: F401
    TOY_METHODS,
    TOY_VARIANTS,
    Toy,
    ToyConfig,
    is_toy_variant,
    load_config,
    reference_values,
)


# --------------------------------------------------------------------------- state
def arm_state(m: Method, step: int, extra: dict) -> dict:
    state = {"step": step, "policy": adapter_state(m.policy.model, "policy"),
             "policy_opt": m.policy_opt.state_dict(), "torch_rng": torch.get_rng_state(),
             "py_rng": random.getstate(), "np_rng": np.random.get_state(), **extra}
    if m.trains_simulator:
        state["simulator"] = adapter_state(m.partner.model, "simulator")
        state["sim_opt"] = m.sim_opt.state_dict()
    if isinstance(m.partner, Population):
        state["population"] = m.partner.state()
    if hasattr(m.partner, "rng"):
        state["partner_rng"] = copy.deepcopy(m.partner.rng)
    if isinstance(m.anchor, AnchorBatches):
        state["anchor_rng"] = m.anchor.rng.getstate()
    return state


def load_arm_state(m: Method, state: dict):
    load_adapter_state(m.policy.model, "policy", state["policy"])
    m.policy_opt.load_state_dict(state["policy_opt"])
    if m.trains_simulator:
        load_adapter_state(m.partner.model, "simulator", state["simulator"])
        m.sim_opt.load_state_dict(state["sim_opt"])
    if isinstance(m.partner, Population):
        m.partner.load_state(state["population"])
    if "partner_rng" in state:
        m.partner.rng = state["partner_rng"]
    if "anchor_rng" in state:
        m.anchor.rng.setstate(state["anchor_rng"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    np.random.set_state(state["np_rng"])


# --------------------------------------------------------------------------- one arm
def eval_record(toy: Toy, m: Method, method: str, seed: int, step: int, final: bool = False) -> dict:
    """One evaluation of the policy on the panel (on its own random streams, see `isolated_rng`)."""
    with isolated_rng(eval_seed(seed, step)):
        return _eval_record(toy, m, method, seed, step, final)


def _eval_record(toy: Toy, m: Method, method: str, seed: int, step: int, final: bool) -> dict:
    c = toy.cfg
    rec = {"kind": "eval", "method": method, "seed": seed, "step": step}
    panel = toy.panel(seed * 1000 + step)        # a fresh real-user stream per evaluation
    t = c.eval_temperature
    n_real = max(c.final_episodes, c.eval_episodes * 4) if final else c.eval_episodes * 4
    res = evaluate_panel(toy.env, m.policy, {"real_users": panel.pop("real_users")}, toy.env.tasks(),
                         n_real, policy_temperature=t)
    res.update(evaluate_panel(toy.env, m.policy, panel, toy.env.tasks(), c.eval_episodes, policy_temperature=t))
    for name, r in res.items():
        rec[name] = r["mean"]
        if "ci95" in r:
            rec[name + "_ci95"] = r["ci95"]
    rec["panel"] = float(np.mean([r["mean"] for r in res.values() if r.get("kind") in ("seen", "unseen")]))
    rec["real_users_rewards"] = [e.reward for e in res["real_users"]["episodes"]]
    # two sampled dialogues with the real users, and two with the training simulator (sim-a):
    # what the report puts side by side (a collapsed policy pleases one and not the other)
    rec["dialogues"] = [dialogue(e, who) for who in ("real_users", "sim-a") if who in res
                        for e in res[who]["episodes"][::n_real if who == "real_users" else c.eval_episodes][:2]]
    acts = [tuple(e.info.get("acts", ())) for e in res["real_users"]["episodes"]]
    rec["act_entropy"] = act_entropy(acts)      # measurement only: reads the episodes
    rec["top_sequence"] = " | ".join(max(sorted(set(acts)), key=acts.count)) if acts else ""
    return rec


def dialogue(ep, who: str) -> dict:
    """One sampled dialogue of an evaluation, as the report shows it."""
    return {"with": who, "persona": ep.task.name, "reward": ep.reward, "text": ep.transcript(("persuader", "user"))}


def run_arm(toy: Toy, method: str, seed: int, run_dir: Path, write, stop_after: int | None = None,
            progress: bool = True, alarm_line=print):
    """Train (or, for "base", only evaluate) one arm through `loop.run_loop`; resumes from its
    saved state. What is the toy's own: the panel evaluation with the real users
    (`eval_record`) and the collapse meter, the training compute counted, and the pool
    measurements of a trained simulator after a step."""
    c = toy.cfg
    arms = run_dir / "arms"
    arms.mkdir(exist_ok=True)
    state_path, best_path = arms / f"{arm_name(method, seed)}.pt", arms / f"{arm_name(method, seed)}.best.pt"
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    m = toy.method(method, seed)
    start, best, profiles = 0, {}, {}
    spent = compute.totals()                  # the training compute so far
    monitor = CollapseMonitor(c.monitor)
    if state_path.exists():
        state = load_state(state_path)
        load_arm_state(m, state)
        start, best, profiles = state["step"] + 1, state.get("best", best), state.get("profiles", {})
        spent = compute.totals(state.get("compute"))
        if state.get("finished"):
            return
        if hasattr(write, "path"):              # the monitor's state is a function of the log
            monitor.replay(runfolder.read_log(write.path, warn=lambda msg: None))
    steps = 0 if method == "base" else c.steps
    tasks = toy.env.tasks()

    def log(rec):        # 6 significant digits: the same on every CPU (minscope/precision.py)
        write(rounded(rec))

    def evaluate(step):
        rec = eval_record(toy, m, method, seed, step, final=step == steps)
        if c.meter_every and (step % c.meter_every == 0 or step == steps):
            partner = m.partner if method != "base" else toy.frozen["sim-a"]
            # (+1: a stream apart from this evaluation's; it is the next step's evaluation
            # seed, which only matters with eval_every = 1)
            with isolated_rng(eval_seed(seed, step) + 1, partner):
                rec["meter"] = collapse_meter(toy.env, m.policy, partner, tasks, n_ref=2, n_resample=4, n_mode=6)
        rec["compute_total"] = spent          # the training compute behind this policy
        return rec

    def keep_best(step, rec):
        save_atomic({"step": step, "policy": adapter_state(m.policy.model, "policy")}, best_path)
        return {"panel": rec["panel"], "step": step, "real_users": rec["real_users"]}

    def train(step):
        nonlocal spent
        batch = [tasks[(step * c.groups + g) % len(tasks)] for g in range(c.groups)]
        t0 = time.time()
        metrics = train_step(m, toy.env, batch, c.group_size, step)
        episodes = metrics.pop("_episodes")
        spent = compute.add(spent, metrics["compute"])
        metrics.update(kind="train", method=method, seed=seed, seconds=time.time() - t0,
                       invalid_acts=float(np.mean([e.info.get("n_invalid", 0) for e in episodes])),
                       act_entropy=act_entropy([e.info.get("acts", ()) for e in episodes]),
                       compute_total=spent)
        return metrics

    def after_step(step):
        if m.trains_simulator and (step % (c.pool_measure_every or c.pool_every) == 0 or step == steps - 1):
            with isolated_rng(eval_seed(seed, step) + 2, m.partner):
                log({"kind": "pool", "method": method, "seed": seed, "step": step,
                       **measure_pool(toy, m, step, profiles)})

    def save(step, best):
        save_atomic(arm_state(m, step, {"best": best, "profiles": profiles, "compute": spent}), state_path)

    # one console line per arm: its first alarm
    announce = alarm_line and (lambda line: alarm_line(f"  {arm_name(method, seed)}: {line}"))
    monitored = Log(log, monitor, announce, dict(method=method, seed=seed))
    best = run_loop(steps, c.eval_every, train, evaluate, lambda rec: monitored(rounded(rec)),
                    save, keep_best, score="panel", start=start, best=best, after_step=after_step,
                    desc=arm_name(method, seed), progress=progress, stop_after=stop_after)
    save_atomic({**arm_state(m, steps, {"best": best, "profiles": profiles, "compute": spent}), "finished": True},
                state_path)


def measure_pool(toy: Toy, m: Method, step: int, profiles: dict) -> dict:
    """Pool diversity (minscope.diversity) of an arm's trained simulator(s) at `step`: the
    Population's snapshots, or Co-Training's one live simulator. Each snapshot is profiled
    once (`profiles`: snapshot step -> profile, kept in the arm's state)."""
    c, partner = toy.cfg, m.partner
    if isinstance(partner, Population):
        members = {f"s{snap}": Frozen(partner.model, partner.tokenizer, adapter=slot, temperature=partner.temperature,
                                      max_new_tokens=partner.max_new_tokens)
                   for slot, (snap, _) in zip(partner.slots, partner.pool)}
    else:
        members = {f"s{step}": Frozen(partner.model, partner.tokenizer, adapter=partner.trainable_adapter,
                                      temperature=partner.temperature, max_new_tokens=partner.max_new_tokens)}
    for name, speaker in members.items():
        if name not in profiles:
            profiles[name] = member_profile(speaker, toy.world, c.gamma, c.diversity_samples, c.diversity_episodes)
    return pool_diversity({n: profiles[n] for n in members}, toy.sim_a_profile(), toy.world, c.gamma)


_WORKER_TOY = {}


def _arm_worker(job):
    """Run one arm in a worker process. The Toy set-up (the frozen tiny models) is loaded
    once per process and shared by its arms: every arm copies what it trains."""
    cfg, cache_dir, run_dir, method, seed, stop_after = job
    key = (json.dumps(asdict(cfg), sort_keys=True, default=list), cache_dir)   # each job pickles a new cfg
    if key not in _WORKER_TOY:
        _WORKER_TOY.clear()
        _WORKER_TOY[key] = Toy(cfg, cache_dir, log=lambda *a: None, progress=False)
    return _run_logged(_WORKER_TOY[key], method, seed, Path(run_dir), stop_after, progress=False)


def _run_logged(toy, method, seed, run_dir: Path, stop_after=None, progress=True):
    arms = run_dir / "arms"
    arms.mkdir(exist_ok=True)
    log = MetricsLog(arms / f"{arm_name(method, seed)}.jsonl")
    state_path = arms / f"{arm_name(method, seed)}.pt"
    log.trim(load_state(state_path)["step"] if state_path.exists() else -1)
    run_arm(toy, method, seed, run_dir, log, stop_after, progress)
    last = [r for r in runfolder.read_log(log.path) if r["kind"] == "eval"][-1]
    return method, seed, last["real_users"]


# CPU-seconds of one default arm of each kind: bench/profile_toy.py's projection (ensemble as
# single) x 0.9, the ratio of a whole cold run's measured wall time on 2 free cores to the
# projection (2026-12-01: 15 min 57 s for 24 arms). They order the jobs, make the first
# estimate, and turn finished arms into the ETA (by their ratios)
ARM_SECONDS = {"base": 5, "single": 49, "ensemble": 49, "oracle": 41, "vs": 104, "cotrain": 136, "population": 124}


def arm_cost(method: str) -> float:
    return ARM_SECONDS.get(method.partition(":")[0], 60)


class ETA:
    """The progress line after each finished arm: arms done / total, time left. The time
    left is the unfinished arms' share of the work (`arm_cost`) at the pace of the finished
    ones; before the first arm ends, the a-priori figure of `ARM_SECONDS` on `workers` cores."""

    def __init__(self, jobs, workers: int):
        self.left = [m for m, _ in jobs]
        self.total, self.workers, self.start, self.cost_done = len(jobs), workers, time.time(), 0.0

    def first(self) -> str:
        busy = sum(map(arm_cost, self.left)) / self.workers
        return f"about {_minutes(max(busy, max(map(arm_cost, self.left), default=0)))} on free cores"

    def done(self, method: str) -> str:
        self.left.remove(method)
        self.cost_done += arm_cost(method)
        elapsed = time.time() - self.start
        left = elapsed * sum(map(arm_cost, self.left)) / self.cost_done
        tail = f", about {_minutes(left)} left" if self.left else ""
        return f"[{self.total - len(self.left)}/{self.total} arms, {_minutes(elapsed)} elapsed{tail}]"


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s" if seconds >= 60 else f"{int(seconds)} s"


def merge_metrics(run_dir: Path, cfg: ToyConfig) -> Path:
    """Concatenate the arms' logs into metrics.jsonl (in `cfg.arms()` order)."""
    return runfolder.merge_metrics(run_dir, cfg.arms())


def run(cfg: ToyConfig, runs_dir="runs", cache_dir=".cache/minscope", resume: bool = False,
        log=print, progress=True, stop_after: int | None = None, run_dir=None) -> Path:
    """Run every arm of the toy experiment; returns the run directory: `run_dir` when given
    (a resumed run continues in its own folder, wherever it was moved or copied), else
    RUNS_DIR/NAME. One process at a time trains in a run folder (files.RunLock)."""
    run_dir = Path(run_dir) if run_dir is not None else Path(runs_dir) / cfg.name
    if run_dir.exists() and not resume and any(run_dir.iterdir()):
        raise SystemExit(f"{run_dir} already exists: pass --resume {run_dir} to continue it, "
                         f"or --name NEW to start another run")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir).acquire()
    try:
        return _run(cfg, run_dir, cache_dir, resume, log, progress, stop_after)
    finally:
        lock.release()


def cached_fidelity(models: ToyModels, gamma: float, with_aligned: bool) -> dict:
    """`toy_fidelity.fidelity` of sim-a (and sim-a-vs), plus the aligned model's when asked: a
    fixed function of the cached models (its own seed), so it is kept beside them and computed
    once per model set, not once per run."""
    path = models.dir / f"fidelity-gamma{gamma:g}.json"
    fid = json.loads(path.read_text()) if path.exists() else None
    if fid is None:
        sim, _, world = models.simulator("sim-a")
        vs_sim = Frozen(models.simulator("sim-a-vs")[0], models.tokenizer, max_new_tokens=12)
        fid = fidelity(Frozen(sim, models.tokenizer, max_new_tokens=12), world, gamma, vs_simulator=vs_sim)
        write_text_atomic(path, json.dumps(fid))
    if with_aligned:
        apath = models.dir / "fidelity-aligned.json"
        if not apath.exists():
            model, world = models.aligned()
            write_text_atomic(apath, json.dumps(aligned_fidelity(Frozen(model, models.tokenizer, max_new_tokens=12),
                                                                 world, models.cfg.aligned_gamma)))
        fid["aligned"] = json.loads(apath.read_text())
    return fid


def _run(cfg: ToyConfig, run_dir: Path, cache_dir, resume: bool, log, progress, stop_after) -> Path:
    if resume:
        if (run_dir / "config.json").exists():
            runfolder.check_format(runfolder.read_json(run_dir / "config.json"), run_dir, "resume")
        check_saved_arms(run_dir, cfg.arms())
    write_text_atomic(run_dir / "config.json", json.dumps({**asdict(cfg), **runfolder.format_fields()}, indent=2,
                                                          default=list))
    models = ToyModels(cache_dir, cfg.models, progress=progress, log=log)
    models.build()
    fid_path = run_dir / "fidelity.json"
    if not fid_path.exists():   # lesson: check the simulator where the exploit lives, before RL
        with_aligned = cfg.sim_start == "aligned" and any(m.partition(":")[0] in ("cotrain", "population")
                                                          for m, _ in cfg.arms())
        fid = cached_fidelity(models, cfg.gamma, with_aligned)
        write_text_atomic(fid_path, json.dumps(fid))
        log(f"sim-a fidelity: exploit value inside the gamma={cfg.gamma:g} simulator {fid['exploit_lm']:.3f} "
            f"(exact {fid['exploit_exact']:.3f}); mean TV to the real users at key histories {fid['tv']:.3f} "
            f"(sampling noise alone: {fid['tv_floor']:.3f}); "
            f"TV of sim-a-vs's verbalized distribution {fid['vs_tv']:.3f}")
        if with_aligned:
            a = fid["aligned"]
            log(f"aligned simulator model (Co-Training's start), sampled at temperature 1: exploit value "
                f"{a['exploit_lm']:.3f} (exact, gamma={a['gamma']:g}-sharpened users: {a['exploit_exact']:.3f}); "
                f"mean TV to the sharpened users {a['tv']:.3f} (sampling noise alone: {a['tv_floor']:.3f})")
        for problem in fidelity_problems(fid):
            log(f"warning: the fidelity check fails: {problem}; the arms below will run, but their "
                "numbers say little about simulator collapse (expected with --quick's small models)")
    # the slowest arms first, so that the workers finish at about the same time
    jobs = sorted(cfg.arms(), key=lambda arm: -arm_cost(arm[0]))
    workers = cfg.workers or default_workers(len(jobs))
    eta = ETA(jobs, workers)
    if workers <= 1:     # in this process, on one CPU thread like a worker (armpool.worker_init)
        toy = Toy(cfg, cache_dir, log=log, progress=progress)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for method, seed in jobs:
                _, _, score = _run_logged(toy, method, seed, run_dir, stop_after, progress)
                log(f"  {arm_name(method, seed):18s} real-user reward {score:.3f}   {eta.done(method)}")
        finally:
            torch.set_num_threads(threads)
    else:
        log(f"training {len(jobs)} arms in {workers} processes (1 CPU thread each; {eta.first()}) ...")

        def done(result):
            method, seed, score = result
            log(f"  {arm_name(method, seed):18s} real-user reward {score:.3f}   {eta.done(method)}")
        run_pool(_arm_worker, [(cfg, str(cache_dir), str(run_dir), m, s, stop_after) for m, s in jobs],
                 workers, done)
    merge_metrics(run_dir, cfg)
    return run_dir
