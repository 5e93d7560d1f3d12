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

Evaluations run on random streams of their own, seeded by (seed, step) (`isolated_rng`): how
often or how long an arm is evaluated does not change its training, and re-evaluating a saved
checkpoint with `eval_record` reproduces the number the run logged.
"""

from __future__ import annotations

import copy
import json
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .envs.toy import RealUsers, ToyEnv, World
from .diversity import member_profile, pool_diversity
from .evaluate import collapse_meter, eval_seed, evaluate_panel, isolated_rng
from .files import RunLock, load_state, read_jsonl, save_atomic, truncate_log, write_text_atomic
from .methods import Method, build_method, train_step
from .models import adapter_state, add_adapters, load_adapter_state
from .monitor import CollapseMonitor, MonitorConfig, log_with_alarms
from .rollout import LMSpeaker
from .sft import encode_chat, pad_batch
from .simulators import Frozen, Population
from .toy_models import ToyModelConfig, ToyModels, aligned_fidelity, fidelity, fidelity_problems, worker_init
from .trainer import UpdateConfig

TOY_METHODS = ("base", "single", "vs", "ensemble", "cotrain", "population", "oracle")
# what may follow the colon of an ablation arm, joined by "+" (see Toy.method)
TOY_VARIANTS = ("adversarial", "cooperative", "curriculum", "anchor", "group", "batch", "g<gamma>")


def is_toy_variant(tweak: str) -> bool:
    """One tweak of an ablation arm: a name of TOY_VARIANTS, or g<gamma> (e.g. g2: the trained
    simulator starts from the aligned model of gamma 2)."""
    return tweak in TOY_VARIANTS[:-1] or bool(re.fullmatch(r"g\d+(\.\d+)?", tweak))


@dataclass
class ToyConfig:
    """Settings of the toy experiment (defaults: the headline run, ~51 CPU-minutes with the
    tiny models cached: docs/RESULTS.md, "Runtime")."""
    name: str = "toy"
    methods: tuple = TOY_METHODS          # "base" = the untrained policy, evaluated only
    seeds: tuple = (0, 1, 2)
    # Co-Training variants (see Toy.method), run for `ablation_seeds` only
    ablations: tuple = ("cotrain:adversarial", "cotrain:anchor", "population:anchor")
    ablation_seeds: tuple = (0,)
    steps: int = 50                       # policy updates per arm
    groups: int = 8                       # rollout groups per step (tasks = personas, cycled)
    group_size: int = 8                   # G trajectories per group
    gamma: float = 8.0                    # sharpening of the "aligned" simulators
    policy_lr: float = 2e-3
    sim_lr: float = 1e-3
    lora_r: int = 16
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.04                    # KL to the untrained policy: keeps utterances well-formed
    epochs: int = 2
    sim_reward: str = "curriculum"
    # The trained simulator's optimiser (Co-Training, Population Co-Training). The defaults
    # are the toy's measured settings, not the paper's: the paper trains every model with a
    # KL of 0.005 to its start, weight decay 0.1 and, reading its on-policy REINFORCE, one
    # pass per batch (sim_beta=0.005, sim_weight_decay=0.1, sim_epochs=1). The sweep in
    # ../shared/docs/COTRAIN_SWEEP.md found they do not change the outcome here; the
    # defaults stay until the toy runs are re-measured.
    sim_beta: float = 0.0                 # KL to the simulator's start (paper 0.005)
    sim_weight_decay: float = 0.0         # AdamW weight decay (paper 0.1)
    sim_epochs: int = 2                   # passes per batch (paper: 1)
    # What Co-Training and Population Co-Training start from: "aligned" = the aligned simulator
    # model (toy_models: SFT'd on sharpened users, models.aligned_gamma), sampled at the
    # rollout temperature like the paper's; "sharpened" = a copy of sim-a sampled at 1/gamma
    # (the earlier design: a near-greedy sampler that RL barely moves)
    sim_start: str = "aligned"
    sim_baseline: str = "auto"            # group-wise, batch-wide for curriculum (methods.resolve_sim_baseline)
    pool_size: int = 5
    pool_every: int = 4                   # a snapshot (and a pool-diversity measurement) every k steps
    diversity_samples: int = 32           # replies per persona and history in pool_diversity
    vs_k: int = 5
    eval_every: int = 10
    eval_episodes: int = 8                # per persona per panel member (real users: x4)
    final_episodes: int = 256             # per persona, real users, last step: the headline number
                                          # (1,024 episodes: standard error ~0.013; ~5 s per arm)
    # The paper evaluates at temperature 0. A 64-wide policy's greedy decode can splice two
    # acts into one invalid utterance (it did, for 2 of 6 runs at the last step, while its
    # samples were valid), so the toy evaluates the policy it trains: sampling at temperature 1.
    eval_temperature: float = 1.0
    meter_every: int = 30                 # collapse meter cadence (0 = off)
    temperature: float = 1.0              # policy sampling temperature in training
    policy_max_new_tokens: int = 6        # an act is one token + end of turn; room to garble
    workers: int = 2                      # arms trained in parallel, one CPU thread each
    models: ToyModelConfig = field(default_factory=ToyModelConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)   # the live collapse monitor

    def arms(self) -> list[tuple[str, int]]:
        """(method, seed) of every arm: the methods x seeds, then the ablations."""
        return ([(m, s) for m in self.methods for s in self.seeds]
                + [(m, s) for m in self.ablations for s in self.ablation_seeds])

    @classmethod
    def quick(cls, **kw):
        """--quick: a couple of minutes; the same code path, smaller everything."""
        base = dict(name="toy-quick", methods=("base", "single", "vs", "oracle"), seeds=(0,), steps=12, ablations=(),
                    groups=4, eval_every=6, eval_episodes=4, final_episodes=64, meter_every=0,
                    models=ToyModelConfig(transcripts=1000, vs_examples=400, sim_a_steps=200, vs_steps=220,
                                          sim_steps=150, policy_steps=100, aligned_steps=150, batch=32))
        base.update(kw)
        return cls(**base)


def load_config(path) -> ToyConfig:
    """The ToyConfig saved in a run's config.json, or one message naming the file."""
    from .files import RunFileError, read_json

    saved = read_json(path)
    try:
        models = ToyModelConfig(**saved.pop("models"))
        monitor = MonitorConfig(**saved.pop("monitor", {}))
        return ToyConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()},
                         models=models, monitor=monitor)
    except (KeyError, TypeError) as e:
        raise RunFileError(f"{path} is not the config.json of a toy run ({e})") from None


def reference_values(gamma: float) -> dict:
    """Exact values on the real users that every report shows (see minscope.envs.toy)."""
    from .envs.toy import sharpened

    world = World()
    seq = world.exploit(gamma)            # the cheap exploit of collapsed simulators
    exploit = lambda history: seq[len(history) // 2]   # noqa: E731
    return {"random": world.random_value(), "best_fixed": world.best_fixed()[0],
            "best_adaptive": world.best_adaptive()[0], "exploit": list(seq),
            "exploit_real": world.exact_value(exploit),
            "exploit_sharpened": world.exact_value(exploit, reply_dist=sharpened(world.reply_dist, gamma))}


def arm_name(method: str, seed: int) -> str:
    return f"{method}-s{seed}"


# --------------------------------------------------------------------------- set-up
class AnchorBatches:
    """`m.anchor` of an anchored arm: each call, a random SFT batch of real-user transcripts.
    Its `rng` is part of the arm's saved state, so a resumed run draws the same batches."""

    def __init__(self, encoded, batch: int, pad_id: int, rng: random.Random):
        self.encoded, self.batch, self.pad_id, self.rng = encoded, batch, pad_id, rng

    def __call__(self):
        return pad_batch(self.rng.sample(self.encoded, self.batch), self.pad_id)


class Toy:
    """Everything shared by the arms of one run: models, environment, evaluation panel."""

    def __init__(self, cfg: ToyConfig, cache_dir, log=print, progress=True):
        self.cfg, self.log = cfg, log
        self.models = ToyModels(cache_dir, cfg.models, progress=progress, log=log)
        self.tokenizer = self.models.tokenizer
        self.env, self.world = ToyEnv(), World()      # (the real users' world, sim-a's too)
        self.base_model, self.sims = self.models.all()
        t = 1.0 / cfg.gamma
        self.frozen = {name: Frozen(model, self.tokenizer, temperature=t, max_new_tokens=12, name=name)
                       for name, (model, kind, world) in self.sims.items()}
        self.vs_simulator = self.frozen.pop("sim-a-vs")

    def sim_a_profile(self) -> dict:
        """sim-a as the frozen arms meet it (temperature 1/gamma), profiled for pool_diversity
        once per process, on a stream of its own."""
        if not hasattr(self, "_sim_a_profile"):
            with isolated_rng(4242):
                self._sim_a_profile = member_profile(self.frozen["sim-a"], self.world, self.cfg.gamma,
                                                     self.cfg.diversity_samples)
        return self._sim_a_profile

    def panel(self, seed: int):
        # the evaluation's real users draw from a stream apart from the oracle arm's training
        # users (RealUsers(seed)); `seed` differs per evaluation (see _eval_record)
        p = {"real_users": (RealUsers(seed=10_000 + seed), "real")}
        for name, (_, kind, _) in self.sims.items():
            if kind in ("seen", "unseen"):
                p[name] = (self.frozen[name], kind)
        return p

    def policy(self):
        # tiny models learn far faster when the LoRA also adapts the LM head
        model = add_adapters(copy.deepcopy(self.base_model), ["policy"], r=self.cfg.lora_r,
                             alpha=2 * self.cfg.lora_r, target_modules="all-linear+head")
        return LMSpeaker(model, self.models.policy_tokenizer, "agent", adapter="policy",
                         temperature=self.cfg.temperature, max_new_tokens=self.cfg.policy_max_new_tokens,
                         name="policy")

    def anchor_batches(self, seed: int, batch: int = 32):
        """Real-user transcripts (persuadee side) for the realism anchor, as SFT batches
        (freshly sampled: a stream of their own, apart from the simulators' SFT data)."""
        rng = np.random.default_rng(seed + 777)
        convs = self.env.sft_conversations(World().sample_transcripts(2000, rng), role="partner")
        encoded = [encode_chat(self.tokenizer, c) for c in convs]
        return AnchorBatches(encoded, batch, self.tokenizer.pad_token_id, random.Random(seed))

    def method(self, name: str, seed: int) -> Method:
        """Build an arm. Variants after a colon tweak the simulator objective, e.g.
        "cotrain:adversarial", "population:anchor", "cotrain:adversarial+batch" (batch baseline)."""
        c = self.cfg
        name, _, variant = name.partition(":")
        tweaks = set(filter(None, variant.split("+")))
        sim_reward = next((t for t in tweaks if t in ("adversarial", "cooperative", "curriculum")), c.sim_reward)
        sim_baseline = next((t for t in tweaks if t in ("group", "batch")), c.sim_baseline)
        gamma = next((float(t[1:]) for t in tweaks if re.fullmatch(r"g\d+(\.\d+)?", t)), c.models.aligned_gamma)
        pcfg = UpdateConfig(lr=c.policy_lr, eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta,
                            epochs=c.epochs, temperature=c.temperature, weight_decay=0.0)
        scfg = UpdateConfig(lr=c.sim_lr, eps_low=c.eps_low, eps_high=c.eps_high, epochs=c.sim_epochs,
                            temperature=c.temperature if c.sim_start == "aligned" else 1.0 / c.gamma,
                            weight_decay=c.sim_weight_decay, beta=c.sim_beta)
        seen = [n for n, (_, kind, _) in self.sims.items() if kind == "seen"]
        frozen = [self.frozen[seen[0]]] if name != "ensemble" else [self.frozen[n] for n in seen]
        if name == "vs":
            frozen = [self.vs_simulator]
        sim_model, sim_temperature = None, None
        if name in ("cotrain", "population"):
            if c.sim_start == "aligned":    # the aligned model, sampled at the rollout temperature
                start, sim_temperature = self.models.aligned(gamma)[0], c.temperature
            elif c.sim_start == "sharpened":
                start = self.sims[seen[0]][0]   # sim-a, sampled at 1/gamma like the frozen arms
            else:
                raise ValueError(f"sim_start {c.sim_start!r}: use 'aligned' or 'sharpened'")
            sim_model = add_adapters(copy.deepcopy(start), ["simulator"], r=c.lora_r,
                                     alpha=2 * c.lora_r, target_modules="all-linear+head")
        m = build_method(
            "single" if name == "base" else name, self.policy(), frozen, pcfg, scfg,
            sim_model=sim_model, sim_tokenizer=self.tokenizer, sim_reward=sim_reward,
            vs_k=c.vs_k, pool_size=c.pool_size, pool_every=c.pool_every,
            oracle=RealUsers(seed=seed), seed=seed, sim_baseline=sim_baseline, sim_temperature=sim_temperature)
        if "anchor" in tweaks and m.trains_simulator:
            m.anchor = self.anchor_batches(seed)
        return m


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
    rec["transcripts"] = [e.transcript(("persuader", "user")) for e in res["real_users"]["episodes"][::n_real][:2]]
    acts = [tuple(e.info.get("acts", ())) for e in res["real_users"]["episodes"]]
    rec["top_sequence"] = " | ".join(max(set(acts), key=acts.count)) if acts else ""
    return rec


def run_arm(toy: Toy, method: str, seed: int, run_dir: Path, write, stop_after: int | None = None,
            progress: bool = True, alarm_line=print):
    """Train (or, for "base", only evaluate) one arm; resumes from its saved state."""
    c = toy.cfg
    arms = run_dir / "arms"
    arms.mkdir(exist_ok=True)
    state_path, best_path = arms / f"{arm_name(method, seed)}.pt", arms / f"{arm_name(method, seed)}.best.pt"
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    m = toy.method(method, seed)
    start, best, profiles = 0, {"panel": -1.0}, {}
    monitor = CollapseMonitor(c.monitor)
    if state_path.exists():
        state = load_state(state_path)
        load_arm_state(m, state)
        start, best, profiles = state["step"] + 1, state.get("best", best), state.get("profiles", {})
        if state.get("finished"):
            return
        if hasattr(write, "path"):              # the monitor's state is a function of the log
            monitor.replay(read_jsonl(write.path, warn=lambda msg: None))

    def emit(rec):        # log, then the alarms it raises (one console line per arm: its first)
        log_with_alarms(monitor, rec, write, alarm_line and (lambda line: alarm_line(f"  {arm_name(method, seed)}: {line}")),
                        method=method, seed=seed)
    steps = 0 if method == "base" else c.steps
    tasks = toy.env.tasks()
    bar = tqdm(range(start, steps + 1), desc=arm_name(method, seed), leave=False, initial=start,
               total=steps + 1, disable=not progress)
    for step in bar:
        if step % c.eval_every == 0 or step == steps:
            rec = eval_record(toy, m, method, seed, step, final=step == steps)
            if c.meter_every and (step % c.meter_every == 0 or step == steps):
                partner = m.partner if method != "base" else toy.frozen["sim-a"]
                # (+1: a stream apart from this evaluation's; it is the next step's evaluation
                # seed, which only matters with eval_every = 1)
                with isolated_rng(eval_seed(seed, step) + 1, partner):
                    rec["meter"] = collapse_meter(toy.env, m.policy, partner, tasks, n_ref=2, n_resample=4, n_mode=6)
            emit(rec)
            if rec["panel"] > best["panel"]:
                best = {"panel": rec["panel"], "step": step, "real_users": rec["real_users"]}
                save_atomic({"step": step, "policy": adapter_state(m.policy.model, "policy")}, best_path)
            bar.set_postfix(real=f"{rec['real_users']:.2f}", panel=f"{rec['panel']:.2f}")
        if step == steps:
            break
        batch = [tasks[(step * c.groups + g) % len(tasks)] for g in range(c.groups)]
        t0 = time.time()
        metrics = train_step(m, toy.env, batch, c.group_size, step)
        episodes = metrics.pop("_episodes")
        metrics.update(kind="train", method=method, seed=seed, seconds=time.time() - t0,
                       invalid_acts=float(np.mean([e.info.get("n_invalid", 0) for e in episodes])))
        emit(metrics)
        if m.trains_simulator and step % c.pool_every == 0:
            with isolated_rng(eval_seed(seed, step) + 2, m.partner):
                write({"kind": "pool", "method": method, "seed": seed, "step": step,
                       **measure_pool(toy, m, step, profiles)})
        save_atomic(arm_state(m, step, {"best": best, "profiles": profiles}), state_path)
        if stop_after is not None and step + 1 >= stop_after:
            raise KeyboardInterrupt   # used by tests to simulate an interruption
    save_atomic({**arm_state(m, steps, {"best": best, "profiles": profiles}), "finished": True}, state_path)


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
            profiles[name] = member_profile(speaker, toy.world, c.gamma, c.diversity_samples)
    return pool_diversity({n: profiles[n] for n in members}, toy.sim_a_profile(), toy.world, c.gamma)


class MetricsLog:
    """One arm's append-only JSONL. `trim(k)` drops what comes after the saved step k."""

    def __init__(self, path: Path):
        self.path = path

    def trim(self, from_step: int):
        # the state of step k is saved after its train record: everything later is redone
        truncate_log(self.path, from_step)

    def __call__(self, record: dict):
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


_WORKER_TOY = {}


def _worker_init():
    """A worker of the arms' pool: as `worker_init`, and deaf to Ctrl-C. The terminal sends
    SIGINT to every process of the group; the parent alone decides, and stops the workers
    (each arm's state is saved after every step, atomically, so a killed worker loses at
    most the step in progress)."""
    import signal

    worker_init()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _arm_worker(job):
    """Run one arm in a worker process. The Toy set-up (the frozen tiny models) is loaded
    once per process and shared by its arms: every arm copies what it trains."""
    cfg, cache_dir, run_dir, method, seed, stop_after = job
    torch.set_num_threads(1)
    key = (json.dumps(asdict(cfg), sort_keys=True, default=list), cache_dir)   # each job pickles a new cfg
    if key not in _WORKER_TOY:
        _WORKER_TOY.clear()
        _WORKER_TOY[key] = Toy(cfg, cache_dir, log=lambda *a: None, progress=False)
    return _run_logged(_WORKER_TOY[key], method, seed, Path(run_dir), stop_after, progress=False)


def run_pool(fn, jobs: list, workers: int, on_result, initializer=_worker_init) -> None:
    """fn(job) for every job in `workers` spawned processes; on_result(result) as each
    finishes. Ctrl-C (or a failed job) stops every worker at once, queued jobs included,
    and is raised here; the workers themselves ignore Ctrl-C (see `_worker_init`)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=initializer) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        try:
            for fut in as_completed(futures):
                on_result(fut.result())
        except BaseException:
            _stop_workers(pool)
            raise


def _stop_workers(pool) -> None:
    """Cancel the queued arms and end the running ones now (after Ctrl-C or a failed arm).
    Each arm saved its state after its last finished step, atomically: ending a worker
    mid-step loses that step only. (Python 3.14 has pool.terminate_workers(); before it,
    the pool's processes are reached directly.)"""
    if hasattr(pool, "terminate_workers"):
        pool.terminate_workers()
        return
    running = list((getattr(pool, "_processes", None) or {}).values())   # shutdown forgets them
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in running:
        proc.terminate()


def _run_logged(toy, method, seed, run_dir: Path, stop_after=None, progress=True):
    arms = run_dir / "arms"
    arms.mkdir(exist_ok=True)
    log = MetricsLog(arms / f"{arm_name(method, seed)}.jsonl")
    state_path = arms / f"{arm_name(method, seed)}.pt"
    log.trim(load_state(state_path)["step"] if state_path.exists() else -1)
    run_arm(toy, method, seed, run_dir, log, stop_after, progress)
    last = [r for r in read_jsonl(log.path) if r["kind"] == "eval"][-1]
    return method, seed, last["real_users"]


def check_saved_arms(run_dir: Path, cfg: ToyConfig) -> None:
    """Before a resumed run starts any worker: every arm's saved state must load and every
    log must read (a half-written last line, left by a kill, is dropped with a note by the
    arm itself); otherwise one message naming the damaged file (files.RunFileError)."""
    for method, seed in cfg.arms():
        arm = run_dir / "arms" / arm_name(method, seed)
        for path in (arm.with_suffix(".pt"), arm.parent / f"{arm.name}.best.pt"):
            if path.exists():
                load_state(path)
        log = arm.parent / f"{arm.name}.jsonl"
        if log.exists():
            read_jsonl(log, warn=lambda msg: None)   # the note comes when the arm trims it


def merge_metrics(run_dir: Path, cfg: ToyConfig) -> Path:
    """Concatenate the arms' logs into metrics.jsonl (in `cfg.arms()` order)."""
    out = run_dir / "metrics.jsonl"
    with out.open("w") as f:
        for method, seed in cfg.arms():
            p = run_dir / "arms" / f"{arm_name(method, seed)}.jsonl"
            if p.exists():
                f.write(p.read_text())
    return out


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


def _run(cfg: ToyConfig, run_dir: Path, cache_dir, resume: bool, log, progress, stop_after) -> Path:
    if resume:
        check_saved_arms(run_dir, cfg)
    write_text_atomic(run_dir / "config.json", json.dumps(asdict(cfg), indent=2, default=list))
    models = ToyModels(cache_dir, cfg.models, progress=progress, log=log)
    models.build()
    fid_path = run_dir / "fidelity.json"
    if not fid_path.exists():   # lesson: check the simulator where the exploit lives, before RL
        sim, _, world = models.simulator("sim-a")
        vs_sim = Frozen(models.simulator("sim-a-vs")[0], models.tokenizer, max_new_tokens=12)
        fid = fidelity(Frozen(sim, models.tokenizer, max_new_tokens=12), world, cfg.gamma, vs_simulator=vs_sim)
        write_text_atomic(fid_path, json.dumps(fid))
        log(f"sim-a fidelity: exploit value inside the gamma={cfg.gamma:g} simulator {fid['exploit_lm']:.3f} "
            f"(exact {fid['exploit_exact']:.3f}); mean TV to the real users at key histories {fid['tv']:.3f} "
            f"(sampling noise alone: {fid['tv_floor']:.3f}); "
            f"TV of sim-a-vs's verbalized distribution {fid['vs_tv']:.3f}")
        if cfg.sim_start == "aligned" and any(m.partition(":")[0] in ("cotrain", "population") for m, _ in cfg.arms()):
            model, world = models.aligned()
            fid["aligned"] = aligned_fidelity(Frozen(model, models.tokenizer, max_new_tokens=12), world,
                                              cfg.models.aligned_gamma)
            write_text_atomic(fid_path, json.dumps(fid))
            a = fid["aligned"]
            log(f"aligned simulator model (Co-Training's start), sampled at temperature 1: exploit value "
                f"{a['exploit_lm']:.3f} (exact, gamma={a['gamma']:g}-sharpened users: {a['exploit_exact']:.3f}); "
                f"mean TV to the sharpened users {a['tv']:.3f} (sampling noise alone: {a['tv_floor']:.3f})")
        for problem in fidelity_problems(fid):
            log(f"warning: the fidelity check fails: {problem}; the arms below will run, but their "
                "numbers say little about simulator collapse (expected with --quick's small models)")
    # the slowest arms first, so that the workers finish at about the same time
    cost = {"vs": 0, "population": 1, "cotrain": 2}
    jobs = sorted(cfg.arms(), key=lambda arm: cost.get(arm[0].partition(":")[0], 3))
    if cfg.workers <= 1:
        toy = Toy(cfg, cache_dir, log=log, progress=progress)
        for method, seed in jobs:
            _, _, score = _run_logged(toy, method, seed, run_dir, stop_after, progress)
            log(f"  {arm_name(method, seed):18s} real-user reward {score:.3f}")
    else:
        log(f"training {len(jobs)} arms in {cfg.workers} processes ...")
        bar = tqdm(total=len(jobs), desc="arms", disable=not progress)

        def done(result):
            method, seed, score = result
            bar.update()
            bar.write(f"  {arm_name(method, seed):18s} real-user reward {score:.3f}")
        run_pool(_arm_worker, [(cfg, str(cache_dir), str(run_dir), m, s, stop_after) for m, s in jobs],
                 cfg.workers, done)
        bar.close()
    merge_metrics(run_dir, cfg)
    return run_dir
