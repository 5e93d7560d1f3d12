"""Training with real Hugging Face models on a real environment (P4G, tau2-bench, ...).

The same `methods.train_step` as the toy experiment; what differs is where the models and
tasks come from. Policy and simulator may share one base model (then the frozen simulator
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
           best.json            the evaluated step with the best panel mean
           state.pt             everything needed to continue (adapters, optimizers, RNGs,
                                the population pool)

Panel entries (`--panel a,unseen:b`) are model directories / hub names, or PEFT adapter
directories (e.g. a co-trained `simulator-step64/`), which are loaded onto the simulator's
base model. `build_models` is shared with `real_report` (eval.py), which rebuilds the same
models from a run's config.json.

Served simulators: `--simulator openai:MODEL@http://HOST:PORT/v1` (and the same spec as a
panel entry) is a model behind an OpenAI-compatible endpoint (`minscope.served`); nothing
is loaded for it here, and metrics.jsonl counts its requests, tokens and latency
(`served_*`). Under `torchrun --nproc_per_node N` the ranks share each step's groups and
rank 0 alone evaluates and writes the run folder (`minscope.distributed`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import distributed
from .envs.base import read_personas
from .evaluate import eval_seed, evaluate_panel, isolated_rng
from .files import RunLock, load_state as load_state_file, read_json, read_jsonl, save_atomic, truncate_log, write_text_atomic
from .methods import METHODS, build_method, train_step
from .models import (adapter_state, add_adapters, enable_checkpointing, load_adapter, load_adapter_state,
                     load_model, pick_device, save_adapter)
from .monitor import CollapseMonitor, MonitorConfig, log_with_alarms
from .rollout import LMSpeaker, StreamError, rollout_batch
from .served import ServedSpeaker, is_spec, parse_spec, served_speakers, take_usage
from .simulators import Frozen
from .trainer import UpdateConfig

REAL_METHODS = tuple(m for m in METHODS if m != "oracle")   # oracle needs scripted real users
TRAINS_SIMULATOR = ("cotrain", "population")   # methods with a trainable "simulator" adapter
DEFAULT_STEPS = 250
SAMPLING_TEMPERATURE = 0.7                     # policy and simulators during training (--temperature)
# Settings that real runs once fixed in the code: a config.json written before they were
# flags (train.py --seed, --temperature, ...) ran with these values, so a resume or an
# evaluation of such a run reads them from here (`setting`).
FIXED_BEFORE = dict(seed=0, temperature=SAMPLING_TEMPERATURE, kl=0.005, lora_r=8, lora_alpha=16, pool_size=5,
                    pool_every=4, vs_k=5, sim_reward=None, device="auto", monitor=None)
TIMING_KEYS = ("seconds", "rollout_s", "update_s", "eval_s")   # wall times in metrics.jsonl
CPU_ROLLOUT_BATCH = 32                         # episodes generated at once on a CPU


def setting(args, key: str):
    """A run setting of train.py's `args` (or a saved config.json): its value, or for a run
    saved before it was a flag, the value runs had then (FIXED_BEFORE)."""
    value = getattr(args, key, None)
    return FIXED_BEFORE[key] if value is None else value


def step_seed(seed: int, step: int) -> int:
    """The random stream of training step `step` of a run with seed `seed` (the tasks drawn,
    the rollout's sampling): the step itself for seed 0."""
    return 1_000_003 * seed + step


# --------------------------------------------------------------------------- environment
def make_env(args):
    if args.env == "p4g":
        from .envs.p4g import P4GEnv, words_for_tokens
        from .envs.p4g_data import DataError

        if not args.data:
            raise SystemExit("--env p4g needs --data PATH (the Persuasion for Good CSV release "
                             "or a ConvoKit corpus folder)")
        try:
            return P4GEnv(args.data, max_turns=getattr(args, "max_turns", None) or 10,
                          max_words=words_for_tokens(getattr(args, "max_new_tokens", None)),
                          reward=getattr(args, "p4g_reward", None) or "parsed")
        except (FileNotFoundError, DataError) as e:   # missing data (and where to get it), or damaged
            raise SystemExit(f"error: {e}") from None
    if args.env == "tau2":
        from .envs.tau2 import Tau2Env

        try:
            return Tau2Env(args.domain, max_turns=getattr(args, "max_turns", None) or 30)
        except (ImportError, ValueError) as e:   # tau2 not installed, or an unknown domain
            raise SystemExit(f"error: {e}") from None
    if args.env == "cooperbench":
        from .envs.cooperbench import CooperBenchEnv
        from .envs.cooperbench_eval import EvalError

        if not args.data or not getattr(args, "repos", None):
            raise SystemExit("--env cooperbench needs --data PATH (the dataset/ folder of a CooperBench checkout) "
                             "and --repos DIR (the tasks' base repositories: git clones or `git archive` tarballs)")
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if getattr(args, "tasks", None) else None
        try:
            return CooperBenchEnv(args.data, args.repos, tasks=tasks, subset=getattr(args, "subset", None),
                                  test_subset=getattr(args, "test_subset", None),
                                  max_turns=getattr(args, "coder_turns", None) or 50, bash=bool(getattr(args, "bash", False)),
                                  unsafe_no_sandbox=bool(getattr(args, "unsafe_no_sandbox", False)))
        except (FileNotFoundError, EvalError) as e:   # missing data, or a task that needs Docker
            raise SystemExit(f"error: {e}") from None
    if args.env == "wordgame":
        from .envs.wordgame import WordGame

        return WordGame()
    if args.env == "numbers":
        from .envs.numbers import Numbers

        return Numbers()
    raise SystemExit(f"unknown environment {args.env!r}")


def eval_tasks(env) -> tuple[list, str]:
    """The held-out tasks, and which split they are. A tiny corpus can leave the test split
    empty (P4G splits personas by a hash of the user id); then the training tasks are
    used, with a warning, so that the run still reports something."""
    tasks = env.tasks("test")
    if tasks:
        return tasks, "test"
    why = getattr(env, "no_test_reason", "the corpus is too small to split")
    print(f"warning: {env.name} has no test tasks ({why}); "
          "evaluating on the TRAINING tasks instead, so evaluation numbers are not held out",
          file=sys.stderr)
    return env.tasks("train"), "train"


# --------------------------------------------------------------------------- models
def resolve_path(name: str | None) -> str | None:
    """An existing local path made absolute (so a run can be evaluated from anywhere);
    anything else (a hub name) unchanged."""
    if not name:
        return name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def adapter_folder(path: str) -> Path | None:
    """The folder holding a PEFT adapter (adapter_config.json) at `path` or in its only
    subfolder (save_adapter writes `DIR/<adapter name>/`); None for a model directory."""
    p = Path(path).expanduser()
    if (p / "adapter_config.json").is_file():
        return p
    subs = list(p.glob("*/adapter_config.json")) if p.is_dir() else []
    return subs[0].parent if len(subs) == 1 else None


def parse_panel(spec: str) -> list[tuple[str, str]]:
    """"a,unseen:b,seen:c" -> [("a", "seen"), ("b", "unseen"), ("c", "seen")]."""
    out = []
    for entry in filter(None, (e.strip() for e in (spec or "").split(","))):
        kind = "seen"
        for prefix in ("unseen:", "seen:"):
            if entry.startswith(prefix):
                kind, entry = prefix[:-1], entry[len(prefix):]
        out.append((resolve_path(entry), kind))
    return out


def _attach_adapter(model, name: str, folder: Path):
    """Load a PEFT adapter from `folder` into slot `name`, wrapping a plain model first."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        load_adapter(model, name, folder)
        return model
    return PeftModel.from_pretrained(model, str(folder), adapter_name=name)


def served_name(spec: str) -> str:
    """A panel label for a served member: its model name (the spec itself if unreadable)."""
    try:
        return parse_spec(spec)[0].replace("/", "_")
    except ValueError:
        return spec


@dataclass
class Models:
    """Everything a real run or its evaluation samples from."""
    policy_model: object          # PeftModel with adapter "policy" (+ "simulator" when shared)
    tokenizer: object
    sim_model: object             # the simulator's base (the same object when shared)
    sim_tokenizer: object
    policy: LMSpeaker             # the policy at the training temperature
    frozen: list                  # the frozen training simulator(s)
    panel: dict                   # name -> (speaker, "seen" | "unseen")


def build_models(args, train_simulator: bool = False, panel_spec: str | None = None,
                 partner=None) -> Models:
    """Load the policy, the simulator and the panel named by train.py's `args`.

    train_simulator: add a trainable "simulator" adapter on the simulator's base
    (Co-Training). panel_spec overrides `args.panel`. The frozen training simulator is
    the simulator's base with adapters disabled; it is also the panel's first member.
    partner: the environment's scripted partner (`Environment.scripted_partner`): it is the
    training partner and the whole panel, and no simulator model is loaded.
    """
    bits = dict(load_in_4bit=args.load_in_4bit, device=pick_device(setting(args, "device")))
    temperature = setting(args, "temperature")
    if partner is not None:
        policy_model, tok = load_model(resolve_path(args.policy), **bits)
        policy_model = add_adapters(policy_model, ["policy"])
        policy = LMSpeaker(policy_model, tok, "agent", adapter="policy", temperature=temperature,
                           max_new_tokens=args.max_new_tokens, name="policy")
        return Models(policy_model, tok, None, None, policy, [partner], {partner.name: (partner, "seen")})
    served_sim = is_spec(args.simulator)      # openai:MODEL@URL: nothing to load for it here
    if served_sim and train_simulator:
        raise SystemExit(f"--simulator {args.simulator}: a served simulator cannot be trained; Co-Training "
                         "needs its weights here (give a model name or path)")
    policy_path = resolve_path(args.policy)
    sim_path = None if served_sim else resolve_path(args.simulator)
    policy_model, tok = load_model(policy_path, **bits)
    shared = not sim_path or sim_path == policy_path
    sim_model, sim_tok = (policy_model, tok) if shared else load_model(sim_path, **bits)
    sim_path = sim_path or policy_path

    # Decide every adapter before creating any speaker: wrapping a model in peft changes
    # which object has to be called (the raw base would then run the active adapter).
    lora = dict(r=setting(args, "lora_r"), alpha=setting(args, "lora_alpha"))
    policy_model = add_adapters(policy_model, ["policy"] + (["simulator"] if shared and train_simulator else []), **lora)
    if shared:
        sim_model = policy_model
    elif train_simulator:
        sim_model = add_adapters(sim_model, ["simulator"], **lora)
    specs = parse_panel(args.panel if panel_spec is None else panel_spec)
    slots = {}                                 # panel index -> adapter slot on the simulator
    for i, (path, _) in enumerate(specs):
        folder = None if is_spec(path) else adapter_folder(path)
        if folder is not None:                 # a PEFT adapter: onto the simulator's base
            slots[i] = f"panel{i}"
            sim_model = _attach_adapter(sim_model, slots[i], folder)
    if shared:
        policy_model = sim_model

    def frozen_speaker(name, model, mtok, adapter=None):
        return Frozen(model, mtok, adapter=adapter, temperature=temperature,
                      max_new_tokens=args.max_new_tokens, name=name)

    def served_speaker(name, spec):
        try:
            return ServedSpeaker.from_spec(spec, temperature=temperature,
                                           max_new_tokens=args.max_new_tokens, name=name)
        except ValueError as e:                # eval.py --panel reaches here unchecked
            raise SystemExit(f"error: {e}") from None

    frozen = (served_speaker("train-simulator", args.simulator) if served_sim else
              frozen_speaker("train-simulator", sim_model, sim_tok))
    panel = {"train-simulator": (frozen, "seen")}
    for i, (path, kind) in enumerate(specs):
        name = base = served_name(path) if is_spec(path) else (Path(path).name or path)
        while name in panel:                   # names must be unique (they label episodes)
            name = f"{base}-{len(panel)}"
        if is_spec(path):                      # an OpenAI-compatible endpoint
            member = served_speaker(name, path)
        elif i in slots:
            member = frozen_speaker(name, sim_model, sim_tok, slots[i])
        elif path == sim_path:                 # the same base again: reuse it, adapters off
            member = frozen_speaker(name, sim_model, sim_tok)
        elif path == policy_path:
            member = frozen_speaker(name, policy_model, tok)
        else:
            member = frozen_speaker(name, *load_model(path, **bits))
        panel[name] = (member, kind)
    policy = LMSpeaker(policy_model, tok, "agent", adapter="policy", temperature=temperature,
                       max_new_tokens=args.max_new_tokens, name="policy")
    return Models(policy_model, tok, sim_model, sim_tok, policy, [frozen], panel)


# --------------------------------------------------------------------------- run state
def restore_args(args) -> argparse.Namespace:
    """On --resume the run's saved config.json is authoritative (a later --steps may
    extend it); the command line only has to name the environment and the run."""
    run_dir = Path(args.resume)
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise SystemExit(f"--resume {run_dir}: no config.json there; pass a run directory "
                         "written by train.py")
    saved = read_json(config_path)
    if "models" in saved:
        raise SystemExit(f"{run_dir} is a toy run: resume it with `python train.py --resume {run_dir}`")
    if args.env not in ("toy", saved.get("env")):    # "toy" is train.py's default: not given
        raise SystemExit(f"{run_dir} is a --env {saved.get('env')} run; resume it with "
                         f"`python train.py --env {saved.get('env')} --resume {run_dir}`")
    merged = {**vars(args), **{k: v for k, v in FIXED_BEFORE.items() if v is not None},
              **saved, "resume": str(run_dir)}   # a run saved before a setting was a flag: its value then
    if args.steps is not None:
        merged["steps"] = args.steps
    if getattr(args, "device", None) is not None:    # where it runs now: the results do not depend on it
        merged["device"] = args.device
    return argparse.Namespace(**merged)


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


def panel_means(res: dict) -> dict:
    """Flat eval record: each member's mean, the seen/unseen group means, and their overall
    mean (`panel_mean`, used to pick the best checkpoint)."""
    rec = {k: v["mean"] for k, v in res.items()}
    rec.update({f"{k}_se": v["se"] for k, v in res.items() if v.get("kind") == "group"})   # the monitor reads them
    members = [v["mean"] for v in res.values() if v.get("kind") in ("seen", "unseen")]
    rec["panel_mean"] = sum(members) / len(members)
    return rec


def persona_bank(args, env) -> list[str] | None:
    """The personas of `--method persona`: --personas FILE, else the environment's own bank."""
    if args.method != "persona":
        return None
    if env.tasks_are_personas:
        raise SystemExit(f"--method persona does not apply to {env.name}: each of its tasks is a user "
                         "persona already (the paper marks Persona-Guided N/A on P4G)")
    if args.personas:
        path = Path(args.personas)
        if not path.is_file():
            raise SystemExit(f"--personas {path}: no such file (one persona per paragraph)")
        personas = read_personas(path)
    else:
        personas = env.persona_bank("train") if hasattr(env, "persona_bank") else []
    if not personas:
        raise SystemExit(f"--method persona needs personas: {env.name} has no bank of its own; "
                         "pass --personas FILE (one persona per paragraph)")
    return personas


# --------------------------------------------------------------------------- training
def check_args(args, env):
    """Every check that needs no model, so a mistake fails in seconds; makes paths absolute
    (config.json must work from anywhere). Returns the personas of --method persona."""
    if not args.policy:
        raise SystemExit(f"--env {args.env} needs --policy MODEL (a Hugging Face name or local path)")
    if args.method not in REAL_METHODS:
        raise SystemExit(f"--method {args.method!r} is not available for real environments; choose one "
                         f"of {', '.join(REAL_METHODS)}")
    if args.method == "selfplay" and not getattr(env, "symmetric", False):
        print(f"note: {env.name} is not symmetric; with --method selfplay the policy also plays the "
              f"{env.partner_name} and learns from those turns with the opponent's reward, 1 - r",
              file=sys.stderr)
    if args.method == "population-selfplay" and not getattr(env, "symmetric", False):
        print(f"note: {env.name} is not symmetric; with --method population-selfplay snapshots of the "
              f"policy play the {env.partner_name} (the policy learns from its own turns only)",
              file=sys.stderr)
    if env.scripted_partner() is not None:
        args.scripted_partner = env.partner_name        # config.json says who played the partner
        if args.method != "single":
            raise SystemExit(f"--env {env.name} plays its own scripted {env.partner_name}: only --method "
                             f"single applies (the other methods change the simulator), not {args.method}")
        for key in ("simulator", "panel"):
            if getattr(args, key, None):
                raise SystemExit(f"--env {env.name} plays its own scripted {env.partner_name}; "
                                 f"--{key} does not apply")
    personas = persona_bank(args, env)
    check_served(args)
    if getattr(args, "p4g_reward", None) == "expected":
        served = [spec for spec in [args.simulator, *(p for p, _ in parse_panel(args.panel))] if is_spec(spec)]
        if served:
            raise SystemExit(f"--p4g-reward expected reads the persuadee's next-token probabilities, which a served "
                             f"simulator does not give: {', '.join(served)}")
    check_panel(args)
    if args.method in TRAINS_SIMULATOR and getattr(args, "sim_reward", None) is None:
        args.sim_reward = env.default_simulator_reward          # recorded in config.json
    args.policy, args.simulator, args.data = resolve_path(args.policy), resolve_path(args.simulator), resolve_path(args.data)
    args.personas = resolve_path(args.personas)
    for key in ("repos", "subset", "test_subset"):          # cooperbench's paths
        if getattr(args, key, None):
            setattr(args, key, resolve_path(getattr(args, key)))
    args.steps = args.steps if args.steps is not None else DEFAULT_STEPS
    return personas


def check_served(args):
    """Served simulators (openai:MODEL@URL in --simulator / --panel) are read before any
    model loads; a trained simulator cannot be a served one."""
    for spec in [args.simulator, *(p for p, _ in parse_panel(args.panel))]:
        if is_spec(spec):
            try:
                parse_spec(spec)
            except ValueError as e:
                raise SystemExit(f"error: {e}") from None
    if is_spec(args.simulator) and args.method in TRAINS_SIMULATOR:
        raise SystemExit(f"--method {args.method} trains the simulator, so --simulator must be a model it can "
                         f"load, not the endpoint {args.simulator}")


def check_panel(args):
    """--method ensemble needs two training simulators or more; without an unseen panel
    member the collapse monitor's divergence alarm has nothing held out to read (one line)."""
    specs = parse_panel(args.panel)
    if args.method == "ensemble" and not any(kind == "seen" for _, kind in specs):
        raise SystemExit("--method ensemble trains against the training simulator and every seen --panel member, "
                         "and --panel names none, so it would train like --method single: give one or more, e.g. "
                         "--simulator A --panel B,C (members without 'unseen:' are seen; unseen:D stays held out)")
    if not any(kind == "unseen" for _, kind in specs):
        print("note: no unseen --panel member, so the collapse monitor's divergence alarm is off; turn it on "
              "with --panel unseen:MODEL (a simulator the policy never trains against)", file=sys.stderr)


def check_memory_args(args):
    """--rollout-batch and --eval-temperature, checked before any model loads."""
    if getattr(args, "rollout_batch", None) is not None and args.rollout_batch < 1:
        raise SystemExit(f"--rollout-batch {args.rollout_batch}: give at least 1 episode")
    temperature = getattr(args, "eval_temperature", None)
    if temperature is not None and not 0 <= temperature < float("inf"):
        raise SystemExit(f"--eval-temperature {temperature}: give 0 (greedy) or a positive number")


def build_real_method(args, env, personas):
    """Load the models (policy, simulator, panel) and assemble the method."""
    seed = setting(args, "seed")
    torch.manual_seed(seed)
    random.seed(seed)
    models = build_models(args, train_simulator=args.method in TRAINS_SIMULATOR, partner=env.scripted_partner())
    frozen = models.frozen
    if args.method == "ensemble":           # the seen panel members are the training ensemble
        frozen = [p for p, kind in models.panel.values() if kind == "seen"]
    # skip_zero_signal: a step whose groups all have equal rewards runs no update (DESIGN_NOTES)
    # prefix_sharing: each group's shared prompt is encoded once in the update (minscope/prefix.py)
    sharing = not getattr(args, "no_prefix_sharing", False)
    ucfg = dict(epochs=1, micro_batch=args.micro_batch, temperature=setting(args, "temperature"),
                beta=setting(args, "kl"), skip_zero_signal=True, prefix_sharing=sharing)
    method = build_method(args.method, models.policy, frozen, UpdateConfig(lr=args.lr, **ucfg),
                          UpdateConfig(lr=args.sim_lr, **ucfg),
                          sim_model=models.sim_model if args.method in TRAINS_SIMULATOR else None,
                          sim_tokenizer=models.sim_tokenizer,
                          sim_reward=getattr(args, "sim_reward", None) or env.default_simulator_reward,
                          personas=personas, pool_draw=getattr(args, "pool_draw", None) or "uniform",
                          vs_k=setting(args, "vs_k"), pool_size=setting(args, "pool_size"),
                          pool_every=setting(args, "pool_every"), seed=seed)
    if not getattr(args, "no_grad_checkpointing", False):   # the trained bases recompute activations
        for model in _trained_models(models, method):
            enable_checkpointing(model.get_base_model())
    set_thinking(method, models, getattr(args, "thinking", False))
    for speaker in speakers_of(method, models):     # ... and once in the rollout (rollout.share_prefixes)
        speaker.share_prefix = sharing
    return models, method


def _trained_models(models, method) -> list:
    """The models whose adapters are trained (each once, even when they share a base)."""
    out = {id(models.policy_model): models.policy_model}
    if method.trains_simulator:
        out.setdefault(id(method.partner.model), method.partner.model)
    return list(out.values())


def speakers_of(method, models) -> list:
    """Every LM speaker of a run: the policy, the training partner(s) and the panel, also
    those inside a wrapper (Verbalized's `speaker`, an Ensemble's `members`)."""
    found, todo = [], [models.policy, method.policy, method.partner, *models.frozen,
                       *(s for s, _ in models.panel.values())]
    while todo:
        s = todo.pop()
        if s is None or any(s is f for f in found):
            continue
        found.append(s)
        todo += [getattr(s, "speaker", None), *getattr(s, "members", [])]
    return [s for s in found if isinstance(s, LMSpeaker)]


def set_thinking(method, models, on: bool) -> None:
    """Let every party think (`--thinking`) or not (the default: enable_thinking=False for
    templates that support it, e.g. Qwen3). The other party never sees the reasoning."""
    for speaker in speakers_of(method, models):
        speaker.thinking = on


def models_thinking(models, on: bool) -> None:
    """`set_thinking` for an evaluation (no method): the policy and the panel."""
    for speaker in [models.policy, *(s for s, _ in models.panel.values())]:
        if isinstance(speaker, LMSpeaker):
            speaker.thinking = on


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache per token of one stream: 2 (K, V) x layers x KV heads x head dim x
    the dtype's size."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    size = 2 if dtype in (torch.bfloat16, torch.float16, torch.uint8) else 4   # 4-bit bases compute in bf16
    return 2 * cfg.num_hidden_layers * heads * head_dim * size


def default_rollout_batch(args, env, models) -> int:
    """How many episodes to generate at once when --rollout-batch is not given.

    CPU: CPU_ROLLOUT_BATCH. CUDA: what fits in half of the GPU memory free after loading
    the models, at the KV cache of an episode's last turn: both parties' streams of up to
    `max_turns * max_new_tokens + 1024` tokens (1024 for the system prompts and the other
    side's turns' headers). At the Qwen3-1.7B shape (112 KiB per token) and P4G (10 turns of
    128 tokens) that is 2 x 2,304 x 112 KiB = 0.5 GB per episode, so 16 free GB give 32
    episodes at once. The rest of the free memory is left for the prefill's activations and
    the logits; these figures are estimates, not measurements."""
    if next(models.policy_model.parameters()).device.type != "cuda":
        return CPU_ROLLOUT_BATCH
    free, _ = torch.cuda.mem_get_info()
    tokens = getattr(env, "max_turns", 10) * args.max_new_tokens + 1024
    per_episode = 2 * tokens * kv_bytes_per_token(models.policy_model)
    return max(1, int(0.5 * free // per_episode))


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


def eval_panel(panel: dict, temperature: float) -> dict:
    """The panel with every LM simulator sampling at `temperature` (copies; 0 = greedy)."""
    out = {}
    for name, (speaker, kind) in panel.items():
        if isinstance(speaker, (LMSpeaker, ServedSpeaker)):
            speaker = copy.copy(speaker)
            speaker.temperature = temperature
        out[name] = (speaker, kind)
    return out


def evaluate_and_save(env, models, method, tasks, split, step, run_dir, best,
                      temperature: float = 0.0, seed: int = 0) -> tuple[dict, dict]:
    """Evaluate the policy on `tasks` against the panel (one episode each, policy and
    simulators at `temperature`: 0, greedy, as the paper evaluates; on random streams of its
    own), save the adapters of this step; returns (eval record, best so far)."""
    t0 = time.perf_counter()
    with isolated_rng(eval_seed(seed, step)):   # evaluating does not change training's randomness
        res = evaluate_panel(env, models.policy, eval_panel(models.panel, temperature), tasks,
                             episodes_per_task=1, policy_temperature=temperature)
    rec = {"kind": "eval", "step": step, "split": split, "tasks": len(tasks), **panel_means(res),
           "eval_temperature": temperature, "eval_s": time.perf_counter() - t0}
    if hasattr(env, "readings"):     # P4G's --p4g-reward expected: every reading, over the whole panel
        rec.update(env.readings([ep for v in res.values() for ep in v.get("episodes", [])]))
    save_adapter(models.policy_model, "policy", run_dir / f"policy-step{step}")
    if method.trains_simulator:
        save_adapter(method.partner.model, "simulator", run_dir / f"simulator-step{step}")
    if not best or rec["panel_mean"] > best["panel_mean"]:
        best = {"step": step, "panel_mean": rec["panel_mean"]}
        write_text_atomic(run_dir / "best.json", json.dumps(best) + "\n")
    return rec, best


def reward_curve(records: list[dict]) -> list[str]:
    """The run's learning curve in two lines: the training reward of every step, and the
    panel mean of every evaluation."""
    train = [f"{r['train_reward']:.2f}" for r in records if r.get("kind") == "train"]
    evals = [f"{r['step']}: {r['panel_mean']:.3f}" for r in records if r.get("kind") == "eval"]
    return [f"training reward per step: {' '.join(train) or '-'}",
            f"evaluation (panel mean) at step: {', '.join(evals) or '-'}"]


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
    if not args.resume and (run_dir / "state.pt").exists():
        raise SystemExit(f"{run_dir} already holds a run: continue it with --resume {run_dir}, "
                         "or pick another --name")
    if main:                                   # under torchrun rank 0 alone writes the run folder
        run_dir.mkdir(parents=True, exist_ok=True)
        RunLock(run_dir).acquire()             # one process (job) per run folder; released at exit
    if args.resume and (run_dir / "state.pt").exists():
        load_state_file(run_dir / "state.pt")  # a damaged state stops here, before any model loads
    if args.resume and (run_dir / "metrics.jsonl").exists():
        read_jsonl(run_dir / "metrics.jsonl", warn=lambda msg: None)   # so does a damaged log
    if main:
        write_text_atomic(run_dir / "config.json", json.dumps({**vars(args), "resume": None}, indent=2))
    models, method = build_real_method(args, env, personas)
    distributed.decorrelate(method.partner)    # ranks > 0: their own draws (a resume restores them)
    chunk = getattr(args, "rollout_batch", None) or default_rollout_batch(args, env, models)
    eval_temperature = getattr(args, "eval_temperature", None) or 0.0
    say = print if main else (lambda *a, **k: None)
    say(f"rollouts: at most {chunk} episodes at once; gradient checkpointing "
        f"{'off' if getattr(args, 'no_grad_checkpointing', False) else 'on'}; shared prompts encoded once per "
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
        monitor.replay(read_jsonl(log_path, warn=lambda msg: None))

    def write(rec):
        log.write(json.dumps(rec) + "\n")
        log.flush()
    with (log_path.open("a") if main else open(os.devnull, "w")) as log:
        bar = tqdm(range(start, args.steps + 1), desc=f"{args.env}/{args.method}", initial=start,
                   total=args.steps + 1, disable=not main)
        for step in bar:
            if main and (step % args.eval_every == 0 or step == args.steps):
                with rollout_batch(chunk):
                    rec, best = evaluate_and_save(env, models, method, test_tasks[: args.groups], split, step,
                                                  run_dir, best, eval_temperature, setting(args, "seed"))
                log_with_alarms(monitor, rec, write, tqdm.write)
            if step == args.steps:
                break
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
            log_with_alarms(monitor, metrics, write, tqdm.write)
            bar.set_postfix(reward=f"{metrics['train_reward']:.3f}")
            save_state(state_path, step, models, method, best)
    if main:
        say("\n".join(reward_curve(read_jsonl(log_path, warn=lambda msg: None))))
    say(f"done: {run_dir}")
    distributed.cleanup()
    return run_dir
