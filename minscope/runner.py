"""Training with real Hugging Face models on a real environment (P4G, tau2-bench, ...).

The same `methods.train_step` as the toy experiment; what differs is where the models and
tasks come from. Policy and simulator may share one base model (then the frozen simulator
is that base with adapters disabled, and the trainable simulator is a second adapter on
it). Every `--eval-every` steps the policy is evaluated on the test tasks against the panel
and the adapters are saved in PEFT format; the full training state is saved every step so
`--resume` continues an interrupted run.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .evaluate import evaluate_panel
from .methods import build_method, train_step
from .models import adapter_state, add_adapters, load_adapter_state, load_model, save_adapter
from .simulators import Frozen
from .trainer import UpdateConfig
from .rollout import LMSpeaker


def make_env(args):
    if args.env == "p4g":
        from .envs.p4g import P4GEnv

        return P4GEnv(args.data)            # raises one clear error when the data is missing
    if args.env == "tau2":
        from .envs.tau2 import Tau2Env

        return Tau2Env(args.domain)
    if args.env == "wordgame":
        from .envs.wordgame import WordGame

        return WordGame()
    raise SystemExit(f"unknown environment {args.env!r}")


def run_real(args):
    env = make_env(args)                    # before loading any model: fail fast on data
    if not args.policy:
        raise SystemExit(f"--env {args.env} needs --policy MODEL (a Hugging Face name or local path)")
    run_dir = Path(args.resume) if args.resume else Path(args.runs_dir) / (args.name or f"{args.env}-{args.method}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(vars(args), indent=2))
    torch.manual_seed(0)
    random.seed(0)

    policy_model, tok = load_model(args.policy, load_in_4bit=args.load_in_4bit)
    shared = not args.simulator or args.simulator == args.policy
    needs_sim_adapter = args.method in ("cotrain", "population")
    names = ["policy"] + (["simulator"] if shared and needs_sim_adapter else [])
    policy_model = add_adapters(policy_model, names)
    if shared:
        sim_model, sim_tok = policy_model, tok
    else:
        sim_model, sim_tok = load_model(args.simulator, load_in_4bit=args.load_in_4bit)
        if needs_sim_adapter:
            sim_model = add_adapters(sim_model, ["simulator"])
    policy = LMSpeaker(policy_model, tok, "agent", adapter="policy", temperature=0.7,
                       max_new_tokens=args.max_new_tokens, name="policy")
    frozen = [Frozen(sim_model, sim_tok, adapter=None, temperature=0.7,
                     max_new_tokens=args.max_new_tokens, name="simulator")]
    panel = {"train-simulator": (frozen[0], "seen")}
    for entry in filter(None, (e.strip() for e in args.panel.split(","))):
        kind, _, name = entry.rpartition(":") if entry.startswith("unseen:") else ("seen", "", entry)
        model, mtok = load_model(name, load_in_4bit=args.load_in_4bit)
        panel[Path(name).name] = (Frozen(model, mtok, temperature=0.7, max_new_tokens=args.max_new_tokens,
                                         name=Path(name).name), kind or "seen")
    if args.method == "ensemble":
        frozen = [p for p, _ in panel.values() if _ == "seen"]

    ucfg = dict(epochs=1, micro_batch=args.micro_batch, temperature=0.7, beta=0.005)
    personas = env.persona_bank("train") if hasattr(env, "persona_bank") else None
    method = build_method(args.method, policy, frozen, UpdateConfig(lr=args.lr, **ucfg),
                          UpdateConfig(lr=args.sim_lr, **ucfg), sim_model=sim_model if needs_sim_adapter else None,
                          sim_tokenizer=sim_tok, sim_reward=env.default_simulator_reward, personas=personas)
    train_tasks, test_tasks = env.tasks("train"), env.tasks("test")
    state_path, start = run_dir / "state.pt", 0
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        load_adapter_state(policy_model, "policy", st["policy"])
        method.policy_opt.load_state_dict(st["policy_opt"])
        if method.trains_simulator:
            load_adapter_state(sim_model, "simulator", st["simulator"])
            method.sim_opt.load_state_dict(st["sim_opt"])
        torch.set_rng_state(st["torch_rng"])
        random.setstate(st["py_rng"])
        start = st["step"] + 1
    steps = args.steps if args.steps is not None else 250
    log = (run_dir / "metrics.jsonl").open("a")
    rng = random.Random(start)
    for step in tqdm(range(start, steps + 1), desc=f"{args.env}/{args.method}", initial=start, total=steps + 1):
        if step % args.eval_every == 0 or step == steps:
            res = evaluate_panel(env, policy, panel, test_tasks[: args.groups], episodes_per_task=1)
            rec = {"kind": "eval", "step": step, **{k: v["mean"] for k, v in res.items()}}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            save_adapter(policy_model, "policy", run_dir / f"policy-step{step}")
        if step == steps:
            break
        t0 = time.time()
        batch = rng.sample(train_tasks, min(args.groups, len(train_tasks)))
        m = train_step(method, env, batch, args.group_size, step)
        m.pop("_episodes")
        m.update(kind="train", seconds=time.time() - t0)
        log.write(json.dumps(m) + "\n")
        log.flush()
        st = {"step": step, "policy": adapter_state(policy_model, "policy"),
              "policy_opt": method.policy_opt.state_dict(), "torch_rng": torch.get_rng_state(),
              "py_rng": random.getstate()}
        if method.trains_simulator:
            st.update(simulator=adapter_state(sim_model, "simulator"), sim_opt=method.sim_opt.state_dict())
        torch.save(st, state_path)
    print(f"done: {run_dir}")
    return run_dir
