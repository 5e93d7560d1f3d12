"""Benchmark: GPU memory and time of one Population Co-Training step at Qwen3-0.6B / 1.7B shapes.

One shared base carries every adapter of Population Co-Training:

    base (random weights, 4-bit NF4 or bf16) ──┬── "policy"        LoRA, trained
                                                ├── "simulator"     LoRA, trained
                                                └── "pool0..pool4"  LoRA snapshots (K = 5)

The step measured is the *training* part of one Population Co-Training step on a batch of
G x tasks = 8 x 4 = 32 multi-turn episodes of up to --episode-tokens (1,024) tokens:

  policy      minscope.trainer.grpo_update on the "agent" streams, adapter "policy":
              reference log-probs (no grad, adapters disabled; beta = 0.005 as train.py),
              then forward + backward in micro-batches, clip, AdamW
  simulator   the same on the "partner" streams, adapter "simulator"
  snapshot    Population.snapshot: adapter_state of "simulator" (a CPU copy), pushed into
              the FIFO pool, and the pool loaded into the slots pool0..pool4

Generation is not measured: sampling 1k-token episodes from random weights would time the
sampler, not the update. The episodes are synthesized instead (see `synthetic_episodes`):
random token ids laid out as ChatML conversations (system prompt, then alternating agent
and partner turns), seen through each party's view, so the two streams of an episode have
complementary masks on the sampled tokens, as the rollout engine makes them. The
sampling log-probs ("old" log-probs) come from a no-grad forward under the adapter that
"sampled" each turn: "policy" for the agent, the episode's pool slot for the partner.

Configurations (each turns ONE feature of "all" off; "none" turns them all off):

  all                4-bit NF4 base, chunked LM-head log-probs (the trainer's
                     fused_grpo_token_loss, Triton on CUDA), gradient checkpointing,
                     micro-batches of --micro-batch (4) sequences
  bf16-base          the base in bf16 (no quantisation)
  naive-logprobs     the trainer computes log-probs the plain way, log_softmax(h @ W.T)
                     .gather(...), with every [B, T, V] tensor kept for backward. This is
                     done *inside this benchmark* by monkeypatching minscope.trainer's
                     token_logprobs and fused_grpo_token_loss (see `naive_logprobs`);
                     minscope itself has no such flag
  no-checkpointing   no gradient checkpointing
  no-micro-batching  one forward/backward over all 32 sequences (micro_batch = 32)
  none               all four off (not run by default: the largest; it may not fit)
  hf-qlora           the contrast, not minscope: a plain Hugging Face QLoRA step as a
                     tutorial writes it. One adapter on the 4-bit base,
                     prepare_model_for_kbit_training, gradient checkpointing, and
                     model(input_ids, labels=input_ids) (full [B, T, V] logits and HF's loss),
                     backward, AdamW, on G sequences of --episode-tokens tokens (8 x 1,024)

How the model is built. A Qwen3 config at the real shape with random weights is saved
once per shape to a temporary folder (with a small offline tokenizer) and loaded back with
`minscope.models.load_model`, the loader train.py uses, with load_in_4bit on or off.
transformers only quantises through from_pretrained (from_config does not take a
quantization_config), so going through a saved checkpoint is also the one path that
quantises exactly as a real run does (which layers stay in bf16: embeddings, tied LM head,
norms). No prepare_model_for_kbit_training: minscope does not call it either.

How it measures (CUDA). Each (shape, configuration) runs in a fresh subprocess. After
--warmup untimed steps (which also create the AdamW states and compile the Triton
log-prob kernels), --repeats steps are timed. Columns:

  weights   torch.cuda.memory_allocated() after loading the base
  static    memory_allocated() just before a measured step: base, 7 adapters, 2 AdamW
  peak      torch.cuda.max_memory_allocated() over the step (max over its phases)
  reserved  torch.cuda.max_memory_reserved(): what the caching allocator held
  policy / simulator / snapshot   the peak of each phase of the step
  step      median wall time of the step (torch.cuda.synchronize() around each phase)

On CPU only --smoke runs (a tiny Qwen3: hidden 64, 2 layers, vocab 1,000, 128-token
episodes, in-process) to test this script's logic; memory columns need CUDA.

Examples:
  python bench/memory.py --smoke                               # CPU: the script's logic
  python bench/memory.py                                       # CUDA: both shapes, 5 configs + hf-qlora
  python bench/memory.py --shapes 1.7b --configs all,bf16-base --json memory.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/memory.py
from minscope import grpo, trainer  # noqa: E402
from minscope.adapters import adapter_nbytes, add_adapters, lora_parameters  # noqa: E402
from minscope.batch import training_batch  # noqa: E402
from minscope.envs.base import Episode, Turn  # noqa: E402
from minscope.models import QWEN3_SHAPES, build_tokenizer, load_model  # noqa: E402
from minscope.simulators import Population  # noqa: E402
from minscope.stream import Stream  # noqa: E402

# Qwen3 shapes: the real ones (minscope.models.QWEN3_SHAPES) and a tiny one for CPU checks.
SHAPES = {
    **QWEN3_SHAPES,
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=256, vocab_size=1000),
}
# features: 4-bit base, chunked log-probs, gradient checkpointing, micro-batching
CONFIGS = {
    "all":               dict(four_bit=True,  chunked=True,  checkpointing=True,  micro_batching=True),
    "bf16-base":         dict(four_bit=False, chunked=True,  checkpointing=True,  micro_batching=True),
    "naive-logprobs":    dict(four_bit=True,  chunked=False, checkpointing=True,  micro_batching=True),
    "no-checkpointing":  dict(four_bit=True,  chunked=True,  checkpointing=False, micro_batching=True),
    "no-micro-batching": dict(four_bit=True,  chunked=True,  checkpointing=True,  micro_batching=False),
    "none":              dict(four_bit=False, chunked=False, checkpointing=False, micro_batching=False),
    "hf-qlora":          dict(four_bit=True,  chunked=False, checkpointing=True,  micro_batching=False),
}
DEFAULT_CONFIGS = ["all", "bf16-base", "naive-logprobs", "no-checkpointing", "no-micro-batching", "hf-qlora"]
TARGET_SHAPE, TARGET_BYTES = "1.7b", 8 * 2**30
LOGPROBS_LABEL = {"hf-qlora": "HF loss"}     # the table's log-probs column
BETA = 0.005          # the KL coefficient train.py uses, so the reference forward runs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="How it measures: see the top of bench/memory.py.")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shape, 128-token episodes, in-process: tests this script on CPU")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of {', '.join(SHAPES)} (default: 1.7b,0.6b; --smoke: tiny)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma list of {', '.join(CONFIGS)} (default: %(default)s)")
    p.add_argument("--episode-tokens", type=int, default=None,
                   help="longest stream of an episode (default 1024; --smoke 128)")
    p.add_argument("--group-size", type=int, default=8, help="G, episodes per task")
    p.add_argument("--tasks", type=int, default=4, help="tasks per step")
    p.add_argument("--pool-size", type=int, default=5, help="K, snapshots in the pool")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward when on")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (alpha = 2r, as add_adapters)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: cuda 1, cpu 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps (default: cuda 2, cpu 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration before giving up")
    p.add_argument("--in-process", action="store_true",
                   help="run every configuration in this process (default on CPU; on CUDA each "
                        "runs in a fresh subprocess so nothing one left behind counts for another)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)       # internal
    p.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)   # internal
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device; use --smoke (CPU) instead")
    cuda = args.device == "cuda"
    args.shapes = [s for s in (args.shapes or ("tiny" if args.smoke else "1.7b,0.6b")).split(",") if s]
    args.configs = [c for c in args.configs.split(",") if c]
    for name, known, what in ((args.shapes, SHAPES, "shape"), (args.configs, CONFIGS, "config")):
        bad = [n for n in name if n not in known]
        if bad:
            p.error(f"unknown {what} {bad[0]!r}; use one of {', '.join(known)}")
    if not cuda and any(s != "tiny" for s in args.shapes):
        p.error("the Qwen3 shapes need CUDA (this machine has none); run --smoke to test the "
                "script on CPU, or --device cuda on a GPU machine")
    args.episode_tokens = args.episode_tokens or (128 if args.smoke else 1024)
    args.warmup = args.warmup if args.warmup is not None else (1 if cuda else 0)
    args.repeats = args.repeats or (2 if cuda else 1)
    args.in_process = args.in_process or args.smoke or not cuda
    return args


# ------------------------------------------------------------------ synthetic episodes
class ChatIds:
    """Token ids of a ChatML-like template, taken from the top of the vocabulary."""

    def __init__(self, vocab_size: int):
        top = vocab_size - 1
        self.pad, self.im_start, self.im_end, self.newline = top, top - 1, top - 2, top - 3
        self.system, self.user, self.assistant = top - 4, top - 5, top - 6
        self.content_vocab = top - 6            # content tokens are drawn from [0, content_vocab)

    def header(self, role_id):
        return [self.im_start, role_id, self.newline]


def party_view(ids: ChatIds, system: list[int], turns: list[Turn], role: str) -> Stream:
    """One party's token stream: its own turns are "assistant" and sampled (mask 1),
    the other party's are "user" (mask 0), exactly as the rollout engine lays them out."""
    stream = Stream()

    def add(tokens, sampled):
        stream.ids += tokens
        stream.mask += [int(sampled)] * len(tokens)
        stream.logp += [0.0] * len(tokens)        # filled by `fill_old_logprobs`

    add(ids.header(ids.system) + system + [ids.im_end, ids.newline], False)
    for turn in turns:
        own = turn.role == role
        add(ids.header(ids.assistant if own else ids.user), False)
        add(turn.token_ids, own)                  # content + <|im_end|>: what was sampled
        add([ids.newline], False)
    return stream


def synthetic_episodes(n_tasks: int, group_size: int, max_tokens: int, vocab_size: int,
                       seed: int = 0) -> list[Episode]:
    """n_tasks x group_size multi-turn episodes of random tokens, grouped consecutively.

    Each episode has a longest stream of between 7/8 and all of `max_tokens` tokens: a
    system prompt per party (task and tools for the agent, a persona for the partner),
    then agent and partner turns in alternation, agent first. `info["streams"]` holds the
    "agent" and "partner" streams; every sampled token is mask 1 in exactly one of them.
    """
    rng = random.Random(seed)
    ids = ChatIds(vocab_size)

    def draw(n):
        return [rng.randrange(ids.content_vocab) for _ in range(n)]

    lengths = {"agent": (max_tokens // 16, max_tokens // 6), "partner": (max_tokens // 32, max_tokens // 12)}
    episodes = []
    for task in range(n_tasks):
        for _ in range(group_size):
            budget = rng.randint(max_tokens * 7 // 8, max_tokens)
            system = {"agent": draw(max_tokens // 8), "partner": draw(max_tokens // 12)}
            used = 5 + max(len(s) for s in system.values())          # longest view so far
            turns, role = [], "agent"
            while True:
                body = draw(rng.randint(*lengths[role])) + [ids.im_end]
                if used + len(body) + 4 > budget:                    # header 3 + newline 1
                    break
                turns.append(Turn(role=role, text="", token_ids=body))
                used += len(body) + 4
                role = "partner" if role == "agent" else "agent"
            streams = {r: party_view(ids, system[r], turns, r) for r in ("agent", "partner")}
            episodes.append(Episode(task=task, group=task, turns=turns, info={"streams": streams}))
    return episodes


@torch.no_grad()
def fill_old_logprobs(model, episodes, key: str, adapter_of, pad_id: int, micro_batch: int):
    """Write each stream's sampling log-probs: a no-grad forward under the adapter that
    sampled those tokens (adapter_of(episode)), kept where mask is 1, 0 elsewhere."""
    by_adapter = {}
    for ep in episodes:
        by_adapter.setdefault(adapter_of(ep), []).append(ep)
    device = next(model.parameters()).device
    for adapter, eps in by_adapter.items():
        for s in range(0, len(eps), micro_batch):
            chunk = eps[s:s + micro_batch]
            batch = training_batch(chunk, key, pad_id)
            logp = trainer.sequence_logprobs(model, batch.input_ids.to(device),
                                             batch.attention_mask.to(device), 1.0, adapter)  # [b, T-1]
            for row, ep in enumerate(chunk):
                stream = ep.info["streams"][key]
                # logp[:, t] is the log-prob of token t + 1 (see training_batch)
                values = logp[row, :len(stream.ids) - 1].float().cpu().tolist()
                stream.logp = [0.0] + [v if m else 0.0 for v, m in zip(values, stream.mask[1:])]


# ------------------------------------------------------------------ naive log-probs
def naive_token_logprobs(hidden, weight, targets, temperature: float = 1.0, return_entropy: bool = False,
                         **unused):
    """The plain way: full [B, T, V] logits, log_softmax, gather; autograd keeps them all."""
    logits = hidden.to(weight.dtype) @ weight.T                              # [B, T, V]
    # softmax maths in at least fp32, as token_logprobs does (bf16 logits lose too much)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)                             # [B, T, V]
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)     # [B, T]
    if not return_entropy:
        return logp
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)                       # [B, T]
    return logp, entropy


def naive_fused_grpo_token_loss(hidden, weight, targets, old_logp, ref_logp, advantages, token_weights,
                                eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0,
                                temperature: float = 1.0, return_entropy: bool = True, **unused):
    """`logprobs.fused_grpo_token_loss` done the plain way (for a trainer that calls it)."""
    out = naive_token_logprobs(hidden, weight, targets, temperature, return_entropy)
    logp, entropy = out if return_entropy else (out, None)
    per_token, _, _ = grpo.token_loss(logp, old_logp, ref_logp, advantages, eps_low, eps_high, beta)
    return (token_weights * per_token).sum(), logp.detach(), entropy


@contextlib.contextmanager
def naive_logprobs(enabled: bool = True):
    """Make minscope.trainer compute log-probs naively inside the block (then restore).

    The trainer looks its log-prob function up as a module global, so replacing that
    global is enough; the reference forward and the update both go through it.
    """
    patches = {"token_logprobs": naive_token_logprobs,
               "fused_grpo_token_loss": naive_fused_grpo_token_loss}
    patches = {name: fn for name, fn in patches.items() if hasattr(trainer, name)} if enabled else {}
    if enabled and not patches:
        raise RuntimeError("minscope.trainer calls neither token_logprobs nor fused_grpo_token_loss; "
                           "update naive_logprobs() in bench/memory.py to patch what it calls now")
    saved = {name: getattr(trainer, name) for name in patches}
    try:
        for name, fn in patches.items():
            setattr(trainer, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(trainer, name, fn)


# ------------------------------------------------------------------ the base model
def write_checkpoint(shape: str, folder: str, device: str, seed: int = 0) -> None:
    """Save a random-weight Qwen3 of `shape` (bf16) and a small offline tokenizer to `folder`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=40_960)
    torch.manual_seed(seed)
    with torch.device(device):          # initialise on the GPU: seconds instead of a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    # The tokenizer is never used to encode (the episodes are token ids); load_model needs one.
    build_tokenizer(["a small offline tokenizer for bench/memory.py"], vocab_size=300).save_pretrained(folder)
    del model


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer: each layer keeps only
    its input and recomputes the rest during backward (transformers 5.2x renamed the call)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# ------------------------------------------------------------------ one configuration
def measure_hf_qlora(shape: str, checkpoint: str, args) -> dict:
    """The contrast: one plain Hugging Face QLoRA step (see "hf-qlora" at the top)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    cuda = args.device == "cuda"
    torch.manual_seed(args.seed)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else None
    model, _ = load_model(checkpoint, load_in_4bit=True, dtype=torch.bfloat16, device=args.device)
    weights = torch.cuda.memory_allocated() - before if cuda else None
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"] - 8, (args.group_size, args.episode_tokens),
                        generator=gen).to(args.device)
    model.train()
    times, peak, reserved, static = [], None, None, None
    for i in range(args.warmup + args.repeats):
        if cuda:
            gc.collect()
            torch.cuda.synchronize()
            static = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return dict(shape=shape, config="hf-qlora", device=args.device, **CONFIGS["hf-qlora"], base="nf4",
                micro_batch=args.group_size, episodes=args.group_size, logprobs_function="transformers loss",
                max_tokens=args.episode_tokens, loss=loss.item(), weights_bytes=weights, static_bytes=static,
                peak_bytes=peak, reserved_bytes=reserved, phase_peak_bytes=None,
                step_time_s=statistics.median(times), step_times_s=times)


def measure(shape: str, config: str, checkpoint: str, args) -> dict:
    """Load the base, add every adapter, and time Population Co-Training steps. One dict."""
    if config == "hf-qlora":
        return measure_hf_qlora(shape, checkpoint, args)
    features = CONFIGS[config]
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def allocated():
        return torch.cuda.memory_allocated() if cuda else None

    torch.manual_seed(args.seed)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base_before = allocated()
    # bf16 also on CPU, so that "bf16-base" means the same everywhere (and 4-bit computes in bf16)
    model, tokenizer = load_model(checkpoint, load_in_4bit=features["four_bit"], dtype=torch.bfloat16,
                                  device=args.device)
    weights = allocated() - base_before if cuda else None
    if features["checkpointing"]:
        enable_checkpointing(model)
    model = add_adapters(model, ["policy", "simulator"], r=args.lora_r, alpha=2 * args.lora_r)
    population = Population(model, tokenizer, adapter="simulator", size=args.pool_size, every=1,
                            seed=args.seed)
    for step in range(args.pool_size):             # a full pool: the measured push evicts one
        population.snapshot(step)

    n_episodes = args.tasks * args.group_size
    cfg = trainer.UpdateConfig(lr=1e-6, beta=BETA,
                               micro_batch=args.micro_batch if features["micro_batching"] else n_episodes)
    policy_opt = trainer.make_optimizer(model, "policy", cfg)
    sim_opt = trainer.make_optimizer(model, "simulator", cfg)

    chat = ChatIds(SHAPES[shape]["vocab_size"])
    episodes = synthetic_episodes(args.tasks, args.group_size, args.episode_tokens,
                                  SHAPES[shape]["vocab_size"], args.seed)
    population.assign(episodes)                    # each group draws a pool slot
    fill_old_logprobs(model, episodes, "agent", lambda ep: "policy", chat.pad, args.micro_batch)
    fill_old_logprobs(model, episodes, "partner", lambda ep: ep.partner_name, chat.pad, args.micro_batch)
    gen = torch.Generator().manual_seed(args.seed)
    rewards = torch.bernoulli(torch.full((n_episodes,), 0.5), generator=gen)   # [B]
    policy_adv, _ = grpo.group_advantages(rewards, args.group_size)
    sim_r = grpo.simulator_rewards(rewards, args.group_size, "adversarial")
    sim_adv = (sim_r - sim_r.mean()) / sim_r.std(unbiased=False).clamp_min(1e-6)  # batch baseline

    phases = {
        "policy": lambda step: trainer.grpo_update(model, "policy", policy_opt, episodes, "agent",
                                                   policy_adv, cfg, chat.pad),
        "simulator": lambda step: trainer.grpo_update(model, "simulator", sim_opt, episodes, "partner",
                                                      sim_adv, cfg, chat.pad),
        "snapshot": lambda step: population.snapshot(step),
    }
    steps = []
    with naive_logprobs(enabled=not features["chunked"]):
        for i in range(args.warmup + args.repeats):
            if cuda:
                gc.collect()       # free what the last step dropped before reading `static`
            sync()
            record = dict(static_bytes=allocated(), phase_time_s={}, phase_peak_bytes={}, reserved_bytes=0)
            for name, run in phases.items():
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                out = run(args.pool_size + i)
                sync()
                record["phase_time_s"][name] = time.perf_counter() - t0
                if cuda:
                    record["phase_peak_bytes"][name] = torch.cuda.max_memory_allocated()
                    record["reserved_bytes"] = max(record["reserved_bytes"], torch.cuda.max_memory_reserved())
                if name != "snapshot":
                    record[f"{name}_tokens"], record[f"{name}_loss"] = out["tokens"], out["loss"]
            if i >= args.warmup:
                steps.append(record)
        logprobs_function = trainer.token_logprobs.__name__       # what the trainer called

    slot_bytes = sum(adapter_nbytes(lora_parameters(model, slot)) for slot in population.slots)
    lengths = [len(ep.info["streams"]["agent"].ids) for ep in episodes]
    last = steps[-1]
    times = [sum(r["phase_time_s"].values()) for r in steps]
    return dict(
        shape=shape, config=config, device=args.device, **features,
        base="nf4" if features["four_bit"] else "bf16", micro_batch=cfg.micro_batch, episodes=n_episodes,
        logprobs_function=logprobs_function,
        checkpointed_layers=sum(bool(getattr(m, "gradient_checkpointing", False))
                                for m in model.get_base_model().model.layers),
        max_tokens=max(lengths), mean_tokens=statistics.mean(lengths),
        agent_tokens=last["policy_tokens"], partner_tokens=last["simulator_tokens"],
        policy_loss=last["policy_loss"], simulator_loss=last["simulator_loss"],
        weights_bytes=weights, static_bytes=last["static_bytes"],
        peak_bytes=max(last["phase_peak_bytes"].values()) if cuda else None,
        reserved_bytes=last["reserved_bytes"] if cuda else None,
        phase_peak_bytes=last["phase_peak_bytes"] if cuda else None,
        phase_time_s={k: statistics.median(r["phase_time_s"][k] for r in steps) for k in phases},
        step_time_s=statistics.median(times), step_times_s=times,
        adapter_bytes=adapter_nbytes(population.pool[-1][1]),
        pool_bytes=population.pool_nbytes(), pool_slot_bytes=slot_bytes, pool_size=len(population.pool),
    )


# ------------------------------------------------------------------ orchestration
def run_subprocess(args, extra: list[str]):
    """One worker in a fresh process: (result dict or None, error or None)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", args.device,
           "--episode-tokens", str(args.episode_tokens), "--group-size", str(args.group_size),
           "--tasks", str(args.tasks), "--pool-size", str(args.pool_size),
           "--micro-batch", str(args.micro_batch), "--lora-r", str(args.lora_r),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--seed", str(args.seed)] + extra
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {args.timeout} s"
    if proc.returncode != 0:
        lines = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()
        if any("out of memory" in line.lower() for line in lines):
            return None, "OOM"
        return None, lines[-1][:160]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def run_worker(args):
    """Internal: one job named by --worker, in this (fresh) process; prints one JSON line."""
    shape = args.shapes[0]
    if args.worker == "checkpoint":
        write_checkpoint(shape, args.checkpoint, args.device, args.seed)
        print(json.dumps({"ok": True}))
    else:
        print(json.dumps(measure(shape, args.worker, args.checkpoint, args)))


def unavailable(config: str) -> str | None:
    """Why `config` cannot run here, or None."""
    import importlib.util

    if CONFIGS[config]["four_bit"] and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes not installed (pip install bitsandbytes)"
    return None


def fmt_bytes(b):
    return "-" if b is None else f"{b / 2**30:.2f} GB" if b >= 2**30 else f"{b / 2**20:.1f} MB"


def table(results) -> str:
    """The results as a markdown table."""
    head = ("| shape | config | base | log-probs | grad ckpt | micro-batch | weights | static | peak "
            "| reserved | peak policy / simulator / snapshot | step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['config']} | skipped: {r['skipped']} |" + " |" * 9)
            continue
        phases = r["phase_peak_bytes"]
        phase = " / ".join(fmt_bytes(phases[k]) for k in ("policy", "simulator", "snapshot")) if phases else "-"
        lines.append(
            f"| {r['shape']} | {r['config']} | {r['base']} | {LOGPROBS_LABEL.get(r['config'], 'chunked' if r['chunked'] else 'naive')} "
            f"| {'on' if r['checkpointing'] else 'off'} | {r['micro_batch']} | {fmt_bytes(r['weights_bytes'])} "
            f"| {fmt_bytes(r['static_bytes'])} | {fmt_bytes(r['peak_bytes'])} | {fmt_bytes(r['reserved_bytes'])} "
            f"| {phase} | {r['step_time_s']:.2f} s |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    print("command: " + shlex.join(["python", "bench/memory.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)
    cuda = args.device == "cuda"
    print(f"One Population Co-Training training step on {args.device}: {args.tasks} tasks x G={args.group_size} "
          f"episodes of up to {args.episode_tokens} tokens, policy + simulator + {args.pool_size} pool "
          f"adapters (LoRA r={args.lora_r}) on one base; {args.warmup} warm-up, {args.repeats} timed step(s)")
    results = []
    for shape in args.shapes:
        with tempfile.TemporaryDirectory(prefix="minscope-bench-") as folder:
            if args.in_process:
                write_checkpoint(shape, folder, args.device, args.seed)
            else:
                _, err = run_subprocess(args, ["--worker", "checkpoint", "--shapes", shape, "--checkpoint", folder])
                if err:
                    print(f"{shape}: could not write the random checkpoint: {err}")
                    continue
            for config in args.configs:
                why = unavailable(config)
                if why:
                    res, err = None, why
                elif args.in_process:
                    res, err = measure(shape, config, folder, args), None
                    if cuda:
                        gc.collect()
                        torch.cuda.empty_cache()
                else:
                    res, err = run_subprocess(args, ["--worker", config, "--shapes", shape, "--checkpoint", folder])
                results.append(res if res else dict(shape=shape, config=config, skipped=err))
                print(f"  {shape} {config}: " + (f"peak {fmt_bytes(res['peak_bytes'])}, step "
                                                 f"{res['step_time_s']:.2f} s" if res else err), flush=True)
                write_json(args, results)          # after every config: a killed run keeps what it measured
    print()
    print(table(results))
    done = [r for r in results if "skipped" not in r]
    for shape in args.shapes:
        r = next((r for r in done if r["shape"] == shape and r["config"] != "hf-qlora"), None)
        if r:
            print(f"\n{shape}: {r['episodes']} episodes, streams of up to {r['max_tokens']} tokens (mean "
                  f"{r['mean_tokens']:.0f}); trained tokens: policy {r['agent_tokens']:,}, simulator "
                  f"{r['partner_tokens']:,}. Pool: {r['pool_size']} snapshots x {fmt_bytes(r['adapter_bytes'])} "
                  f"= {fmt_bytes(r['pool_bytes'])} of CPU memory (adapter_nbytes); the {args.pool_size} "
                  f"slots on the base hold {fmt_bytes(r['pool_slot_bytes'])}.")
    target = next((r for r in done if r["shape"] == TARGET_SHAPE and r["config"] == "all"), None)
    if target and cuda:
        verdict = "met" if target["peak_bytes"] <= TARGET_BYTES else "NOT met"
        print(f"\nTarget: peak <= {TARGET_BYTES / 2**30:.0f} GB at the {TARGET_SHAPE} shape with every feature on: "
              f"{fmt_bytes(target['peak_bytes'])}, {verdict}.")
        plain = next((r for r in done if r["shape"] == TARGET_SHAPE and r["config"] == "hf-qlora"), None)
        if plain:
            print(f"Contrast: a plain Hugging Face QLoRA step (one adapter, one update, {plain['episodes']} x "
                  f"{plain['max_tokens']} tokens) peaks at {fmt_bytes(plain['peak_bytes'])}.")
    if not cuda:
        print("\nGPU memory figures need CUDA: on CPU this checks the script's logic and times only.")
    if args.json:
        write_json(args, results)
        print(f"\nwrote {args.json}")
    return results


def write_json(args, results):
    if args.json:
        keep = {k: v for k, v in vars(args).items() if k not in ("worker", "checkpoint")}
        Path(args.json).write_text(json.dumps(dict(config=keep, results=results), indent=2))


if __name__ == "__main__":
    main()
