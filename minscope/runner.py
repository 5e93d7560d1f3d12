"""Training with real Hugging Face models on a real environment (P4G, tau2-bench, ...).

The same loop (`loop.run_loop`) and `methods.train_step` as the toy experiment; what differs
is where the models and tasks come from: the settings are checked in `real_args`, the models
built in `real_models`, and this file holds the run folder's state files, the evaluation and
the callbacks the loop calls. Policy and simulator may share one base model (then the frozen simulator
is that base with adapters disabled, and the trainable simulator is a second adapter on
it). Every `--eval-every` steps the policy is evaluated against the panel on the first
`--groups` test tasks, one episode each, policy and simulators at `--eval-temperature` (0,
greedy, by default; on random streams of its own, so evaluating does not change training;
`eval.py` evaluates every test task afterwards) and the adapters are saved in PEFT format;
the full training state is saved every step so `--resume` continues an interrupted run.

Memory. The trained bases use gradient checkpointing (`--no-grad-checkpointing` turns it
off), updates run in micro-batches of `--micro-batch` sequences, and rollouts play at most
`--rollout-batch` episodes at once (default: `default_rollout_batch`), since every live
episode holds its KV cache until it ends. Each party's token stream is extended turn by
turn with only the new messages' template text (`minscope.chat`); `exact_stream_frac` in
metrics.jsonl is the share of episodes whose trained streams stayed exact, and a step below
0.9 stops the run. metrics.jsonl also times each step's phases (`rollout_s`, `update_s`,
and `eval_s` on evaluation records) and counts the tokens fed and sampled.

    run_dir/config.json         train.py's arguments (model and data paths made absolute)
           metrics.jsonl        one line per training step ("kind": "train") and per
                                evaluation ("kind": "eval": panel means)
           policy-step{N}/      the policy adapter at each evaluation (PEFT format)
           simulator-step{N}/   the trained simulator adapter (cotrain, population)
           best.json            the evaluated step with the best seen-panel mean
           state.pt             everything needed to continue (adapters, optimizers, RNGs,
                                the population pool)

Panel entries (`--panel a,unseen:b`) are model directories / hub names, or PEFT adapter
directories (e.g. a co-trained `simulator-step64/`), which are loaded onto the simulator's
base model. `real_models.build_models` is shared with `real_eval` (eval.py), which rebuilds
the same models from a run's config.json.

Served simulators: `--simulator openai:MODEL@http://HOST:PORT/v1` (and the same spec as a
panel entry) is a model behind an OpenAI-compatible endpoint (`minscope.served`); nothing
is loaded for it here, and metrics.jsonl counts its requests, tokens and latency
(`served_*`). Under `torchrun --nproc_per_node N` the ranks share each step's groups and
rank 0 alone evaluates and writes the run folder (`minscope.distributed`).

One file, though long: a real run's start, resume, evaluation and saving share one run folder's
state, and splitting them would pass that state between files.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import distributed
from .batch import StreamError
from .envs.base import task_label
from .evaluate import eval_seed, evaluate_panel, isolated_rng
from .files import RunFileError, RunLock, read_jsonl, save_atomic, truncate_log, write_text_atomic
from .files import load_state as load_state_file
from .loop import Log, run_loop
from .methods import train_step
from .hardware import cpu_build_note, startup_line
from .logprobs import backend_for
from .adapters import adapter_state, load_adapter_state, save_adapter
from .models import model_device
from .monitor import CollapseMonitor, MonitorConfig
from .real_args import (
    check_args,
    check_memory_args,
    eval_tasks,
    make_env,
    restore_args,
    setting,
)
from .real_models import Models, build_real_method, default_rollout_batch, eval_panel
from .real_report import format_episode, write_real_report
from .readout import low_coverage
from .rollout import rollout_batch
from .runfolder import check_resume_steps, format_fields, read_log
from .served import served_speakers, take_usage

TIMING_KEYS = ("seconds", "rollout_s", "update_s", "eval_s")   # wall times in metrics.jsonl


def step_seed(seed: int, step: int) -> int:
    """The random stream of training step `step` of a run with seed `seed` (the tasks drawn,
    the rollout's sampling): the step itself for seed 0."""
    return 1_000_003 * seed + step


def rank_streams(method) -> dict:
    """This process's random streams (torch, python, the partner's draws)."""
    rng = getattr(method.partner, "rng", None)
    return {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
            "partner_rng": rng.getstate() if rng is not None else None}


def save_state(path: Path, step: int, models: Models, method, best: dict):
    """Write state.pt (under torchrun: rank 0, with every rank's random streams)."""
    ranks = distributed.gather(rank_streams(method))       # every rank takes part
    if not distributed.is_main():
        return
    st = {"step": step, "policy": adapter_state(models.policy_model, "policy"),
          "policy_opt": method.policy_opt.state_dict(), "torch_rng": torch.get_rng_state(),
          "py_rng": random.getstate(), "best": best}
    if torch.cuda.is_available():
        st["cuda_rng"] = torch.cuda.get_rng_state_all()
    if method.trains_simulator:
        st.update(simulator=adapter_state(method.partner.model, "simulator"), sim_opt=method.sim_opt.state_dict())
    partner = method.partner
    if hasattr(partner, "load_state"):           # a population: its pool of snapshots
        st["partner"] = partner.state()
    elif hasattr(partner, "rng"):                # VS draws, persona draws
        st["partner_rng"] = partner.rng.getstate()
    if method.anchor is not None:                # --sim-anchor: which real transcripts come next
        st["anchor_rng"] = method.anchor.rng.getstate()
    if len(ranks) > 1:
        st.update(world_size=len(ranks), ranks=ranks)
    save_atomic(st, path)                        # never leave a half-written state behind


def load_state(path: Path, models: Models, method) -> tuple[int, dict]:
    """Restore a run's state in place; returns (first step to run, best-so-far)."""
    st = load_state_file(path, needs=("step", "policy", "policy_opt", "torch_rng", "py_rng"))
    load_adapter_state(models.policy_model, "policy", st["policy"])
    method.policy_opt.load_state_dict(st["policy_opt"])
    if method.trains_simulator:
        load_adapter_state(method.partner.model, "simulator", st["simulator"])
        method.sim_opt.load_state_dict(st["sim_opt"])
    if "partner" in st:
        method.partner.load_state(st["partner"])
    elif "partner_rng" in st:
        method.partner.rng.setstate(st["partner_rng"])
    if "anchor_rng" in st and method.anchor is not None:
        method.anchor.rng.setstate(st["anchor_rng"])
    torch.set_rng_state(st["torch_rng"])
    if "cuda_rng" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda_rng"])
    random.setstate(st["py_rng"])
    saved, world = st.get("world_size", 1), distributed.world_size()
    if saved != world:
        how = f"torchrun --nproc_per_node {saved} train.py ..." if saved > 1 else "python train.py ... (one process)"
        raise SystemExit(f"{path} was saved by {saved} process(es), this job has {world}: each process continues "
                         f"its own random streams, so resume it the same way: {how}")
    if world > 1:                                # this rank's own streams
        own = st["ranks"][distributed.rank()]
        torch.set_rng_state(own["torch_rng"])
        random.setstate(own["py_rng"])
        if own["partner_rng"] is not None:
            method.partner.rng.setstate(own["partner_rng"])
    return st["step"] + 1, st.get("best", {})


# The checkpoint rule's score (best.json): the mean over the SEEN panel members (the training
# simulator is always one). The unseen members are held out: no checkpoint is chosen on them.
CHECKPOINT_SCORE = "seen"


def panel_means(res: dict) -> dict:
    """Flat eval record: each member's mean, the seen/unseen group means (`seen`: the
    checkpoint rule's score, CHECKPOINT_SCORE), and the mean over every member (`panel_mean`)."""
    rec = {k: v["mean"] for k, v in res.items()}
    rec.update({f"{k}_se": v["se"] for k, v in res.items() if v.get("kind") == "group"})   # the monitor reads them
    members = [v["mean"] for v in res.values() if v.get("kind") in ("seen", "unseen")]
    rec["panel_mean"] = sum(members) / len(members)
    return rec


def stream_stats(method, episodes) -> dict:
    """exact_stream_frac (share of episodes whose trained parties' streams are all exact)
    and the tokens the rollout fed ("prefilled") and sampled ("generated"), summed over
    parties, where the speakers counted them."""
    keys = ["agent"] + (["partner"] if method.trains_simulator or method.name == "selfplay" else [])
    exact = [all(k in ep.info.get("streams", {}) and ep.info["streams"][k].exact for k in keys)
             for ep in episodes]
    out = {"exact_stream_frac": sum(exact) / max(1, len(exact))}
    counts = [c for ep in episodes for c in ep.info.get("tokens", {}).values()]
    if counts:
        out["tokens_prefilled"] = sum(c.get("prefilled", 0) for c in counts)
        out["tokens_generated"] = sum(c.get("generated", 0) for c in counts)
    return out


def probe_persuadees(env, partner) -> dict:
    """P4G's probe set (envs/p4g.py `probe`) read by the trained persuadee and, for a population,
    by each snapshot in its pool (named by the step it was taken at)."""
    from .envs.p4g import probe
    from .rollout import LMSpeaker

    def speaker(adapter):
        return LMSpeaker(partner.model, partner.tokenizer, "partner", adapter, partner.temperature,
                         partner.max_new_tokens, name=adapter)

    members = {"live": speaker(partner.trainable_adapter)}
    for slot, (snap, _) in zip(getattr(partner, "slots", []), getattr(partner, "pool", [])):
        members[f"pool, step {snap}"] = speaker(slot)
    return probe(env, members)


def evaluate_and_save(env, models, method, tasks, split, step, run_dir,
                      temperature: float = 0.0, seed: int = 0) -> dict:
    """Evaluate the policy on `tasks` against the panel (one episode each, policy and
    simulators at `temperature`: 0, greedy, as the paper evaluates; on random streams of its
    own), save the adapters of this step; returns the eval record."""
    t0 = time.perf_counter()
    with isolated_rng(eval_seed(seed, step)):   # evaluating does not change training's randomness
        res = evaluate_panel(env, models.policy, eval_panel(models.panel, temperature), tasks,
                             episodes_per_task=1, policy_temperature=temperature)
    rec = {"kind": "eval", "step": step, "split": split, "tasks": len(tasks), **panel_means(res),
           "eval_temperature": temperature, "eval_s": time.perf_counter() - t0}
    if hasattr(env, "readings"):     # P4G's --p4g-reward expected: every reading, over the seen members; the
        for kind, prefix in (("seen", ""), ("unseen", "unseen_")):     # unseen members' apart, "unseen_..."
            eps = [ep for v in res.values() if v.get("kind") == kind for ep in v.get("episodes", [])]
            rec.update({prefix + k: x for k, x in env.readings(eps).items()})
        if method.trains_simulator and getattr(env, "decision", None):     # the trained persuadee(s), probed
            rec["probe"] = probe_persuadees(env, method.partner)
    # one dialogue per panel member, for the report (report.html: the first and last evaluation)
    rec["dialogues"] = [dialogue(env, v["episodes"][0], name) for name, v in res.items() if v.get("episodes")]
    save_adapter(models.policy_model, "policy", run_dir / f"policy-step{step}")
    if method.trains_simulator:
        save_adapter(method.partner.model, "simulator", run_dir / f"simulator-step{step}")
    return rec


def dialogue(env, ep, who: str) -> dict:
    """One sampled dialogue, as the report shows it."""
    out = {"with": who, "task": task_label(ep.task), "reward": ep.reward,
           "text": format_episode(ep, (env.agent_name, env.partner_name))}
    note = getattr(env, "reward_note", lambda ep: None)(ep)
    if note:
        out["note"] = note
    return out


def reward_curve(records: list[dict]) -> list[str]:
    """The run's learning curve in two lines: the training reward of every step, and the
    panel mean of every evaluation."""
    train = [f"{r['train_reward']:.2f}" for r in records if r.get("kind") == "train"]
    evals = [f"{r['step']}: {r['panel_mean']:.3f}" for r in records if r.get("kind") == "eval"]
    return [f"training reward per step: {' '.join(train) or '-'}",
            f"evaluation (panel mean) at step: {', '.join(evals) or '-'}"]


# what a first attempt leaves when it fails before its first step is saved (step 0's
# evaluation of the untrained policy included): the same command redoes all of it
ATTEMPT_FILES = {"config.json", "metrics.jsonl", "best.json", "policy-step0", "simulator-step0", "lock", "lock.guard"}


def failed_attempt(run_dir: Path, args) -> bool:
    """Whether `run_dir` holds only what a first attempt with these same settings left when it
    failed before its first step was saved (a failed model load leaves only its lock; an OOM at
    step 0 its config.json and step 0's evaluation): then the same command starts the run again."""
    names = {p.name for p in run_dir.iterdir() if not (p.name.startswith("lock.") and p.name.endswith(".tmp"))}
    if not names - {"lock", "lock.guard"}:
        return True
    if not names <= ATTEMPT_FILES or "config.json" not in names:
        return False
    log = run_dir / "metrics.jsonl"
    try:
        saved = json.loads((run_dir / "config.json").read_text())
        records = read_jsonl(log, warn=lambda msg: None) if log.exists() else []
    except (OSError, ValueError, RunFileError):
        return False
    if any(r.get("kind") != "eval" or r.get("step") != 0 for r in records):
        return False
    return saved == json.loads(json.dumps({**vars(args), "resume": None, **format_fields()}))


def run_real(args):
    """Train a real-model run; under `torchrun --nproc_per_node N` every rank plays its
    share of each step's groups and rank 0 alone evaluates and writes (minscope.distributed)."""
    rank, world = distributed.setup()
    main = rank == 0
    if args.resume:
        args = restore_args(args)
    env = make_env(args)                    # before loading any model: fail fast on data
    personas = check_args(args, env)
    check_memory_args(args)
    train_tasks = env.tasks("train")
    if not train_tasks:
        raise SystemExit(f"{env.name} has no training tasks: is the data complete?")
    test_tasks, split = eval_tasks(env)
    if world > 1 and args.groups % world:
        raise SystemExit(f"--groups {args.groups} cannot be split evenly over {world} processes; "
                         f"give a multiple of {world}")
    run_dir = Path(args.resume) if args.resume else Path(args.runs_dir) / (args.name or f"{args.env}-{args.method}")
    problem = None
    if not args.resume and (run_dir / "state.pt").exists():
        problem = (f"{run_dir} already holds a run: continue it with --resume {run_dir}, "
                   "or pick another --name")
    elif not args.resume and run_dir.is_dir() and any(run_dir.iterdir()) and not failed_attempt(run_dir, args):
        # a new run never writes into a used folder (a toy run keeps its state in arms/, and an
        # interrupted real run may not have saved state.pt yet)
        what = "a toy run" if (run_dir / "arms").exists() else "files of another run"
        problem = (f"{run_dir} already exists and holds {what}: pick another --name"
                   + ("" if what == "a toy run" else f", or continue it with --resume {run_dir}"))
    # under torchrun every rank looks at the folder before rank 0 writes into it (the collective
    # is the barrier: a slow rank must not find rank 0's own new files and refuse them)
    if not distributed.all_true(problem is None):
        raise SystemExit(problem or f"{run_dir}: another process refused this run folder")
    if main:                                   # under torchrun rank 0 alone writes the run folder
        run_dir.mkdir(parents=True, exist_ok=True)
        RunLock(run_dir).acquire()             # one process (job) per run folder; released at exit
    if args.resume and (run_dir / "state.pt").exists():
        # a damaged state stops here, before any model loads; so does a --steps it has passed
        check_resume_steps(run_dir, args.steps, load_state_file(run_dir / "state.pt")["step"])
    if args.resume and (run_dir / "metrics.jsonl").exists():
        read_log(run_dir / "metrics.jsonl", warn=lambda msg: None)     # so does a damaged log
    say = print if main else (lambda *a, **k: None)
    note = cpu_build_note(setting(args, "device"))
    if note:
        say(note)
    models, method = build_real_method(args, env, personas)
    if main:                 # written once the models load: a failed load (a typo in --policy, offline) leaves none
        write_text_atomic(run_dir / "config.json", json.dumps({**vars(args), "resume": None, **format_fields()},
                                                              indent=2))
    say(startup_line(models, backend_for(setting(args, "logprob_backend"), model_device(models.policy_model))))
    distributed.decorrelate(method.partner)    # ranks > 0: their own draws (a resume restores them)
    chunk = getattr(args, "rollout_batch", None) or default_rollout_batch(args, env, models)
    eval_temperature = getattr(args, "eval_temperature", None) or 0.0
    above = method.policy_cfg.checkpoint_above
    ckpt = ("off" if getattr(args, "no_grad_checkpointing", False) else
            "on" if not above else f"on for update units over {above / 2**20:.0f} MiB of activations")
    say(f"rollouts: at most {chunk} episodes at once; gradient checkpointing {ckpt}; shared prompts encoded once per "
        f"{'episode' if getattr(args, 'no_prefix_sharing', False) else 'group'}; micro-batches of "
        f"{args.micro_batch}; evaluation at temperature {eval_temperature:g}")
    say(f"{env.name}: {len(train_tasks)} training tasks, {len(test_tasks)} {split} tasks for evaluation; "
        f"method {args.method}; run dir {run_dir}" + (f"; {world} processes (torchrun)" if world > 1 else ""))

    state_path, log_path, start, best = run_dir / "state.pt", run_dir / "metrics.jsonl", 0, {}
    if state_path.exists():
        start, best = load_state(state_path, models, method)
        say(f"resuming at step {start}")
    if main:
        truncate_log(log_path, start - 1)      # steps after the saved state are redone
    served = served_speakers(method.partner, models.frozen, [s for s, _ in models.panel.values()])
    # the live collapse monitor: divergence reads the unseen members' mean (thresholds: config.json's
    # "monitor", which `python -m minscope.monitor RUN --set ... --write` sets)
    monitor = CollapseMonitor(cfg=MonitorConfig(**(setting(args, "monitor") or {})), panel_key="unseen",
                              real_key=None)
    if log_path.exists():
        logged = read_log(log_path, warn=lambda msg: None)
        monitor.replay(logged)
        if best and CHECKPOINT_SCORE not in best:    # a run saved before the seen-only rule: its best's score
            best.update({CHECKPOINT_SCORE: r[CHECKPOINT_SCORE] for r in logged
                         if r.get("kind") == "eval" and r.get("step") == best.get("step") and CHECKPOINT_SCORE in r})

    def evaluate(step):                        # rank 0 alone evaluates (and saves the adapters)
        if not main:
            return None
        with rollout_batch(chunk):
            rec = evaluate_and_save(env, models, method, test_tasks[: args.groups], split, step, run_dir,
                                    eval_temperature, setting(args, "seed"))
        if line := low_coverage([rec]):
            tqdm.write("warning: " + line)
        return rec

    warned = []                                # a training step's low readout coverage is said once

    def keep_best(step, rec):
        best = {"step": step, CHECKPOINT_SCORE: rec[CHECKPOINT_SCORE], "panel_mean": rec["panel_mean"]}
        write_text_atomic(run_dir / "best.json", json.dumps(best) + "\n")
        return best

    def train(step):
        take_usage(served)                     # served_* metrics count this step's rollout only
        t0 = time.time()
        # Tasks drawn from a per-step seed: a resumed run draws what it would have drawn.
        seed = step_seed(setting(args, "seed"), step)
        batch = random.Random(seed).sample(train_tasks, min(args.groups, len(train_tasks)))
        batch, first_group = distributed.shard(batch)     # the whole batch in one process
        try:
            with rollout_batch(chunk):   # each chunk of groups samples from a stream of (step, its first group)
                metrics = train_step(method, env, batch, args.group_size, step, first_group, seed=seed)
        except StreamError as e:
            reason = models.policy.chat.probe() or "it renders a new turn differently from the history"
            raise SystemExit(f"error: step {step}: {e}. The policy's chat template: {reason}. "
                             "Use a model whose template keeps each turn's text as it was sampled "
                             "(Qwen3, Llama 3.x, ChatML are supported)") from None
        episodes = metrics.pop("_episodes")
        seconds = time.time() - t0
        rollout_s = episodes[0].info.get("rollout_s", 0.0)
        metrics.update(kind="train", seconds=seconds, rollout_s=rollout_s, update_s=seconds - rollout_s,
                       **stream_stats(method, episodes), **take_usage(served))
        if hasattr(env, "step_metrics"):     # the environment's own means (CooperBench: per feature, per coder)
            metrics.update(env.step_metrics(episodes))
        metrics = distributed.merge_metrics(metrics)
        if main and not warned and (line := low_coverage([{"kind": "train", "step": step, **metrics}])):
            warned.append(step)                # once per run for training; every evaluation below it says so
            tqdm.write("warning: " + line)
        if step % args.eval_every == 0 or step == args.steps - 1:    # a sample of what training played
            ranked = sorted(episodes, key=lambda ep: ep.reward)
            metrics["dialogues"] = [dialogue(env, ep, ep.partner_name or "simulator") for ep in (ranked[-1], ranked[0])]
        return metrics

    def save(step, best):
        save_state(state_path, step, models, method, best)

    with (log_path.open("a") if main else open(os.devnull, "w")) as log:
        def write(rec):
            log.write(json.dumps(rec) + "\n")
            log.flush()
        run_loop(args.steps, args.eval_every, train, evaluate, Log(write, monitor, tqdm.write), save, keep_best,
                 score=CHECKPOINT_SCORE, start=start, best=best, desc=f"{args.env}/{args.method}", progress=main)
    if main:
        say("\n".join(reward_curve(read_log(log_path, warn=lambda msg: None))))
        say(f"report (training log, curves, dialogues): {write_real_report(run_dir, evaluate=False)} and "
            f"report.html; `python eval.py {run_dir}` evaluates the policy on every test task")
    say(f"done: {run_dir}")
    distributed.cleanup()
    return run_dir
