"""A real run's settings, checked before any model loads: train.py's arguments for real
environments (`check_args` and its helpers), the environment they name (`make_env`), the
held-out tasks (`eval_tasks`), and on `--resume` the run's saved settings (`restore_args`).
Every mistake that needs no model fails here, in seconds, with one line saying what to do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .envs.base import read_personas
from .files import read_json
from .methods import METHODS
from .runfolder import check_format
from .served import is_spec, parse_spec

REAL_METHODS = tuple(m for m in METHODS if m != "oracle")   # oracle needs scripted real users
TRAINS_SIMULATOR = ("cotrain", "population")   # methods with a trainable "simulator" adapter
DEFAULT_STEPS = 250
SAMPLING_TEMPERATURE = 0.7                     # policy and simulators during training (--temperature)
# Settings that real runs once fixed in the code: a config.json written before they were
# flags (train.py --seed, --temperature, ...) ran with these values, so a resume or an
# evaluation of such a run reads them from here (`setting`).
FIXED_BEFORE = dict(seed=0, temperature=SAMPLING_TEMPERATURE, kl=0.005, lora_r=8, lora_alpha=16, pool_size=5,
                    pool_every=4, vs_k=5, sim_reward=None, sim_anchor=0.0, device="auto", monitor=None,
                    dtype="auto", logprob_backend="auto", simulator_4bit=False)


def setting(args, key: str):
    """A run setting of train.py's `args` (or a saved config.json): its value, or for a run
    saved before it was a flag, the value runs had then (FIXED_BEFORE)."""
    value = getattr(args, key, None)
    return FIXED_BEFORE[key] if value is None else value


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
        from .envs.cooperbench_task import EvalError

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


def resolve_path(name: str | None) -> str | None:
    """An existing local path made absolute (so a run can be evaluated from anywhere);
    anything else (a hub name) unchanged."""
    if not name:
        return name
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


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


WHOLE_SETTINGS = ("steps", "groups", "group_size", "eval_every", "max_new_tokens", "micro_batch", "seed", "lora_r",
                  "lora_alpha", "pool_size", "pool_every", "vs_k", "max_turns", "coder_turns", "rollout_batch")
NUMBER_SETTINGS = ("lr", "sim_lr", "temperature", "kl", "eval_temperature")
TEXT_SETTINGS = ("env", "method", "policy", "simulator", "panel", "data", "domain")


def check_saved_settings(saved: dict, path) -> None:
    """A real run's config.json, parsed: each setting of the right kind (or null), else
    RunFileError naming the file and the setting."""
    from .files import RunFileError

    def bad(key, what):
        raise RunFileError(f"{path} is damaged: {key!r} is {saved[key]!r}, not {what}; fix it or start a new run")
    for key in WHOLE_SETTINGS:
        v = saved.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            bad(key, "a whole number")
    for key in NUMBER_SETTINGS:
        v = saved.get(key)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            bad(key, "a number")
    for key in TEXT_SETTINGS:
        if saved.get(key) is not None and not isinstance(saved[key], str):
            bad(key, "a text")


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
    check_format(saved, run_dir, "resume")
    check_saved_settings(saved, config_path)
    if args.env not in ("toy", saved.get("env")):    # "toy" is train.py's default: not given
        raise SystemExit(f"{run_dir} is a --env {saved.get('env')} run; resume it with "
                         f"`python train.py --env {saved.get('env')} --resume {run_dir}`")
    merged = {**vars(args), **{k: v for k, v in FIXED_BEFORE.items() if v is not None},
              **saved, "resume": str(run_dir)}   # a run saved before a setting was a flag: its value then
    if args.steps is not None:
        merged["steps"] = args.steps
    for key in ("device", "logprob_backend"):      # where and how it runs now: the results do not depend on it
        if getattr(args, key, None) is not None:
            merged[key] = getattr(args, key)
    return argparse.Namespace(**merged)


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
    if getattr(args, "p4g_reward", None) in ("expected", "sampled"):
        served = [spec for spec in [args.simulator, *(p for p, _ in parse_panel(args.panel))] if is_spec(spec)]
        if served:
            raise SystemExit(f"--p4g-reward {args.p4g_reward} reads the persuadee's next-token probabilities, which a served "
                             f"simulator does not give: {', '.join(served)}")
    check_panel(args, scripted=env.scripted_partner() is not None)
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


def check_panel(args, scripted: bool = False):
    """--method ensemble needs two training simulators or more; without an unseen panel
    member the collapse monitor's divergence alarm has nothing held out to read (one line)."""
    specs = parse_panel(args.panel)
    if args.method == "ensemble" and not any(kind == "seen" for _, kind in specs):
        raise SystemExit("--method ensemble trains against the training simulator and every seen --panel member, "
                         "and --panel names none, so it would train like --method single: give one or more, e.g. "
                         "--simulator A --panel B,C (members without 'unseen:' are seen; unseen:D stays held out)")
    if not scripted and not any(kind == "unseen" for _, kind in specs):   # a scripted partner has no panel
        print("note: no unseen --panel member, so the collapse monitor's divergence alarm is off; turn it on "
              "with --panel unseen:MODEL (a simulator the policy never trains against)", file=sys.stderr)


def check_device(name) -> None:
    """--device cuda / mps on a machine without one: one line, before any folder or model."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU here; use --device cpu (or auto)")
    mps = getattr(torch.backends, "mps", None)
    if name == "mps" and not (mps is not None and mps.is_available()):
        raise SystemExit("--device mps: this machine has no MPS device (Apple silicon); use --device cpu (or auto)")


def check_memory_args(args):
    """--rollout-batch, --eval-temperature, --device, --dtype and --logprob-backend, checked
    before any model loads."""
    check_device(getattr(args, "device", None))
    from .hardware import pick_dtype
    from .models import pick_device

    device = pick_device(setting(args, "device"))
    pick_dtype(setting(args, "dtype"), device)           # --dtype float16: refused here, in one line
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if setting(args, "logprob_backend") == "triton" and device != "cuda" and not interpreted:
        raise SystemExit(f"--logprob-backend triton: Triton's kernels run on CUDA, and this run is on {device}; "
                         "use --logprob-backend torch (or auto)")
    if getattr(args, "rollout_batch", None) is not None and args.rollout_batch < 1:
        raise SystemExit(f"--rollout-batch {args.rollout_batch}: give at least 1 episode")
    group = getattr(args, "group_size", None)
    if getattr(args, "rollout_batch", None) is not None and group and args.rollout_batch < group:
        raise SystemExit(f"--rollout-batch {args.rollout_batch}: below --group-size {group}; the rollout plays whole "
                         f"groups (their shared prompt is encoded once), so give at least {group}, or lower "
                         "--group-size to save memory")
    temperature = getattr(args, "eval_temperature", None)
    if temperature is not None and not 0 <= temperature < float("inf"):
        raise SystemExit(f"--eval-temperature {temperature}: give 0 (greedy) or a positive number")
