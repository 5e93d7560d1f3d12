"""Benchmark: one full training step (rollout + update) with and without the kept KV cache.

A training step of minscope is `methods.train_step`: a multi-turn rollout of tasks x G
episodes between the policy and the method's simulator, then the GRPO update(s). This
script runs that step for methods `single`, `vs` and `population` on a random-weight Qwen3
of a given shape, once per sampling mode, on the same model and the same batch:

  kept        each party keeps its KV cache between its turns and feeds only the new
              suffix of its stream (minscope's default)
  reprefill   every turn feeds each party's whole stream again (LMSpeaker.reuse_cache
              = False): the prefill work of the sampler before the kept cache
  legacy      (--modes legacy) the sampler as it was before the kept cache, defined in this
              file: re-prefill every turn, a DynamicCache grown by concatenation, finished
              rows kept in the decode batch, a device->host copy every token
  generate    (--modes generate) what a user would write: `model.generate` on each party's
              whole stream every turn (transformers' own sampling loop and cache; log-probs
              from its returned logits)

--model NAME runs a real checkpoint instead of a random shape: any name `load_model` takes,
e.g. `smollm2` (the built-in SmolLM2-135M-Instruct, converted once into the model cache), its
own tokenizer and chat template; --no-update times the rollout alone (the update is the same
work in every mode). The last line compares the kept cache with the other modes' tokens/s.

Episodes are P4G-shaped: the agent opens, the parties alternate for --turns turns each
(10 on CUDA), every turn is exactly --turn-tokens (85) sampled tokens (EOS is suppressed:
random weights would otherwise end turns at random), system prompts of a persuader
(~300 tokens) and a persona (~120 tokens). `vs` asks for k = 5 candidates per partner
turn, so its partner turns are (k + 1) x --turn-tokens long; random text never parses, and
with retries = 0 each partner turn falls back to its raw text.

Model: a Qwen3Config of the real shape with random weights (no download); the tokenizer is
a small offline BPE with the real Qwen3 chat template (tests/fixtures/templates/qwen3.jinja;
ChatML if absent). At the real shapes the vocabulary (151,936) is larger than the
tokenizer's, so sampling is restricted to the tokenizer's ids by a hook on the LM head (the
update does not see the hook: its log-probs are over the full vocabulary, which changes
the loss values, not the work). --load-in-4bit loads the base in NF4 (bitsandbytes, CUDA
only), the way train.py does.

Columns: rollout tokens/s = tokens sampled by both parties / rollout wall time;
prefilled = ids fed to the model outside decoding (ep.info["tokens"]); rollout_s and
update_s (the update is the rest of train_step); peak = torch.cuda.max_memory_allocated()
over the step (CUDA only). With --repeats N each mode runs N steps, the modes interleaved
(a loaded machine slows whichever runs when it is busiest), and the table shows medians.

Ratios printed at the end: each method's whole step against RL (Single)'s (`--methods
single,population`), and, for a real --model on the CPU, one decode step at batch 8 (adapters
off, and through one adapter) against its floor: the weights read once at the memory bandwidth
measured in the same run (bench/decode_profile.py's measurement).

--prefix-sharing on|off|both: whether a group's shared prompt prefix is prefilled once in the
rollout (sampling.share_prefixes) and fed forward once per micro-batch in the update
(minscope/prefix.py); `both` runs every mode both ways (interleaved) and prints, per pair, the
rollout and update times, the prefilled ids and the update's forward tokens (policy and
reference passes, and the simulator's update where there is one).

Examples:
  python bench/step.py --model smollm2 --device cpu --tasks 2 --group-size 4 --turns 2 \
      --turn-tokens 24 --modes kept --prefix-sharing both     # the P4G step of docs/BENCHMARKS.md
  python bench/step.py --device cpu                       # small shape, single, batch 32, 4+4 turns
  python bench/step.py --model smollm2 --device cpu --tasks 2 --group-size 8 --turns 5 \
      --turn-tokens 16 --modes kept,reprefill,generate --no-update   # SmolLM2-135M, batch 16, 5+5 turns
  python bench/step.py --device cuda --shapes 1.7b --load-in-4bit --methods population
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import resource
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/step.py
from minscope import methods as methods_mod  # noqa: E402
from minscope import rollout as rollout_mod  # noqa: E402
from minscope import sampling  # noqa: E402
from minscope.adapters import adapter_state, add_adapters, load_adapter_state  # noqa: E402
from minscope.envs.base import Environment, Step  # noqa: E402
from minscope.models import QWEN3_SHAPES, build_tokenizer, enable_checkpointing, load_model, model_device  # noqa: E402
from minscope.rollout import LMSpeaker  # noqa: E402
from minscope.simulators import Frozen  # noqa: E402
from minscope.trainer import UpdateConfig  # noqa: E402

SHAPES = {
    **QWEN3_SHAPES,
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=256, vocab_size=None),     # None: the tokenizer's
}
METHODS = ("single", "vs", "population")
MODES = ("kept", "reprefill", "legacy", "generate")
WORDS = ("donation charity children save help give today money school food water family health "
         "please consider small amount difference world together support kind share hope future "
         "yes no maybe think about it sure why how much when where organization trust").split()
TEMPLATE = REPO / "tests" / "fixtures" / "templates" / "qwen3.jinja"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--model", default=None, help="a real checkpoint (a name load_model takes, e.g. smollm2) "
                   "instead of --shapes")
    p.add_argument("--no-update", action="store_true", help="time the rollout only (no GRPO update)")
    p.add_argument("--shapes", default=None, help="comma list of 0.6b,1.7b,small (default: cuda 0.6b,1.7b; cpu small)")
    p.add_argument("--methods", default=None, help="comma list of single,vs,population (default: cuda all, cpu single)")
    p.add_argument("--modes", default="kept,reprefill", help="comma list of kept,reprefill,legacy")
    p.add_argument("--turns", type=int, default=None, help="turns per party (default: cuda 10, cpu 4)")
    p.add_argument("--turn-tokens", type=int, default=85, help="sampled tokens per turn")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8, help="G: batch = tasks x G episodes")
    p.add_argument("--rollout-batch", type=int, default=None,
                   help="episodes generated at once (whole groups; default all): bounds the KV caches' memory")
    p.add_argument("--load-in-4bit", action="store_true", help="NF4 base (bitsandbytes, CUDA only)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward of the update")
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing in the update")
    p.add_argument("--warmup", type=int, default=1, help="untimed short rollouts per shape first")
    p.add_argument("--repeats", type=int, default=1,
                   help="steps per mode, the modes interleaved; the table shows each mode's median")
    p.add_argument("--prefix-sharing", default="on", choices=["on", "off", "both"],
                   help="prefill/feed a group's shared prompt prefix once (rollout and update), or not, or both")
    p.add_argument("--pool-members", type=int, default=5,
                   help="population: distinct snapshots in the pool (the default pool's size; 1: every row "
                        "through one adapter, as at a run's first steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here (after each step)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.load_in_4bit and args.device != "cuda":
        p.error("--load-in-4bit needs CUDA (bitsandbytes' 4-bit kernels)")
    args.shapes = (args.shapes or ("0.6b,1.7b" if args.device == "cuda" else "small")).split(",")
    if args.model:
        if "--shapes" in (argv if argv is not None else sys.argv):
            p.error("--model and --shapes exclude each other")
        args.shapes = []
    args.turns = args.turns or (10 if args.device == "cuda" else 4)
    args.methods = args.methods or (",".join(METHODS) if args.device == "cuda" else "single")
    for name, allowed in (("shapes", SHAPES), ("methods", METHODS), ("modes", MODES)):
        value = getattr(args, name) if name == "shapes" else getattr(args, name).split(",")
        bad = [v for v in value if v not in allowed]
        if bad:
            p.error(f"unknown {name} {bad}; choose from {', '.join(allowed)}")
        setattr(args, name, value)
    return args


# ------------------------------------------------------------------ the episodes
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Shaped(Environment):
    """P4G-shaped conversations: the agent opens, strict alternation, `turns` turns each."""

    def __init__(self, turns: int, seed: int = 0):
        self.turns, rng = turns, random.Random(seed)
        self.persuader = "You are a persuader for a children's charity. " + words(rng, 240)
        self.personas = ["You are a persuadee. Your persona: " + words(rng, 90) for _ in range(8)]

    def tasks(self, split="train"):
        return list(range(8))

    def agent_messages(self, task):
        return [{"role": "system", "content": self.persuader}]

    def partner_messages(self, task):
        return [{"role": "system", "content": self.personas[task % len(self.personas)]}]

    def after_turn(self, episode):
        if len(episode.turns) >= 2 * self.turns:
            return Step(None)
        return Step("partner" if episode.turns[-1].role == "agent" else "agent")

    def score(self, episode):
        return float(sum(len(t.text) for t in episode.turns if t.role == "agent") % 7), {}


# ------------------------------------------------------------------ models
def build_real(name: str, args):
    """(model, tokenizer) of a real checkpoint as train.py loads it (activation checkpointing
    on unless --no-checkpointing, on the CPU too), with the two adapters."""
    model, tokenizer = load_model(name, load_in_4bit=args.load_in_4bit, device=args.device,
                                  dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
    if not args.no_checkpointing:
        enable_checkpointing(model)
    return add_adapters(model, ["policy", "simulator"]), tokenizer


def build(shape: str, args):
    """(model, tokenizer) for `shape`: random weights, the Qwen3 template when available."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = build_tokenizer([words(random.Random(i), 60) for i in range(200)], vocab_size=600)
    if TEMPLATE.exists():
        tokenizer.chat_template = TEMPLATE.read_text()
    dims = dict(SHAPES[shape])
    dims["vocab_size"] = dims["vocab_size"] or len(tokenizer)
    config = Qwen3Config(**dims, tie_word_embeddings=True, max_position_embeddings=40_960,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.load_in_4bit:        # transformers quantises only through from_pretrained
        with tempfile.TemporaryDirectory() as folder:
            with torch.device(args.device):
                AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            model, _ = load_model(folder, load_in_4bit=True, dtype=dtype, device=args.device)
    else:
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if not args.no_checkpointing and args.device == "cuda":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.vocab_size > len(tokenizer):           # sample only ids the tokenizer can spell
        n = len(tokenizer)
        model.get_output_embeddings().register_forward_hook(
            lambda m, i, out: out.index_fill_(-1, torch.arange(n, out.shape[-1], device=out.device),
                                              float("-inf")))
    model = add_adapters(model, ["policy", "simulator"])
    return model, tokenizer


def make_method(name: str, model, tokenizer, args, sharing: bool = True):
    new = args.turn_tokens
    policy = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=new)
    frozen = Frozen(model, tokenizer, adapter=None, max_new_tokens=new)
    cfg = UpdateConfig(lr=1e-6, beta=0.005, micro_batch=args.micro_batch, prefix_sharing=sharing)
    kw = dict(sim_model=model, sim_tokenizer=tokenizer,
              sim_cfg=UpdateConfig(lr=1e-6, micro_batch=args.micro_batch, prefix_sharing=sharing))
    method = methods_mod.build_method(name, policy, [frozen], cfg, seed=args.seed,
                                      **(kw if name == "population" else {}))
    if name == "vs":
        method.partner.retries = 0
    if name == "population":
        fill_pool(method.partner, args.pool_members, args.seed)
    speakers = [policy, frozen, getattr(method.partner, "speaker", None), method.partner]
    for sp in speakers:
        if isinstance(sp, LMSpeaker):
            sp.eos = set()                  # fixed-length turns: EOS never ends a turn
    return method


def fill_pool(pop, members: int, seed: int):
    """A pool of `members` distinct snapshots (random LoRA weights), as a Population run holds
    after its first members * every steps: the rollout's groups then spread over that many
    per-row adapters. The trainable adapter is left as it was."""
    saved = adapter_state(pop.model, pop.trainable_adapter)
    gen = torch.Generator().manual_seed(seed)
    try:
        for i in range(members):
            load_adapter_state(pop.model, pop.trainable_adapter,
                               {k: (torch.randn(v.shape, generator=gen) * 0.01).to(v) for k, v in saved.items()})
            pop.snapshot(i)
    finally:
        load_adapter_state(pop.model, pop.trainable_adapter, saved)


# ------------------------------------------------------------------ the sampler before the kept cache
def left_pad(prompts, pad_id):
    """Token ids and attention mask of `prompts`, left-padded to the longest (CPU tensors)."""
    T = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, T - len(p):] = torch.tensor(p)
        attention[i, T - len(p):] = 1
    return input_ids, attention


@torch.no_grad()
def legacy_sample(model, prompts, pad_id, eos_ids, max_new_tokens, temperature=1.0, adapter_names=None,
                  cache=None, owners=None, **_):
    """minscope's sampler before the kept KV cache (for the `legacy` mode only)."""
    device = model_device(model)
    model.eval()
    B = len(prompts)
    input_ids, attention = left_pad(prompts, pad_id)
    input_ids, attention = input_ids.to(device), attention.to(device)
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
    out_ids, out_logp = [[] for _ in range(B)], [[] for _ in range(B)]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
    past, kw = None, sampling._cache_kwarg(model)
    step_ids, step_pos = input_ids, position
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attention, position_ids=step_pos,
                    use_cache=True, logits_to_keep=1, **{kw: past}, **extra)
        past = getattr(out, "cache", None) or out.past_key_values
        logits = out.logits[:, -1].float()
        logprobs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1).squeeze(1) if temperature > 0 else logprobs.argmax(-1)
        ids_now, logp_now = token.tolist(), logprobs.gather(1, token[:, None]).squeeze(1).tolist()
        for i in torch.nonzero(~finished).flatten().tolist():
            out_ids[i].append(ids_now[i])
            out_logp[i].append(logp_now[i])
        finished |= torch.isin(token, eos)
        if finished.all():
            break
        step_ids, step_pos = token[:, None], step_pos[:, -1:] + 1
        attention = torch.cat([attention, torch.ones((B, 1), dtype=attention.dtype, device=device)], 1)
    if cache is not None:
        cache.last_prefilled = [len(p) for p in prompts]
    return out_ids, out_logp


@torch.no_grad()
def generate_sample(model, prompts, pad_id, eos_ids, max_new_tokens, temperature=1.0, adapter_names=None,
                    cache=None, owners=None, **_):
    """One turn through `model.generate` on each whole prompt (the `generate` mode): what a
    user writes without minscope's engine. Pure sampling (no top-k/top-p), the log-probs of
    the sampled tokens from the logits it returns; no EOS when `eos_ids` is empty."""
    device = model_device(model)
    model.eval()
    input_ids, attention = left_pad(prompts, pad_id)
    T = input_ids.shape[1]
    extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                         max_new_tokens=max_new_tokens, min_new_tokens=0, pad_token_id=pad_id,
                         eos_token_id=sorted(eos_ids) or None, return_dict_in_generate=True,
                         output_logits=True, **sampling, **extra)
    new = out.sequences[:, T:]                                         # [B, n]
    logits = torch.stack(out.logits, 1).float()                        # [B, n, V]
    logits = logits / temperature if temperature > 0 else logits
    logp = torch.log_softmax(logits, -1).gather(-1, new[..., None]).squeeze(-1)
    out_ids, out_logp = [], []
    for ids, lp in zip(new.tolist(), logp.tolist()):
        n = next((j + 1 for j, t in enumerate(ids) if t in eos_ids), len(ids))
        out_ids.append(ids[:n])
        out_logp.append(lp[:n])
    if cache is not None:
        cache.last_prefilled = [len(p) for p in prompts]
    return out_ids, out_logp


@contextlib.contextmanager
def mode(name: str, sharing: bool = True):
    """Sample in mode `name` inside the block (see the module docstring), sharing prompt prefixes or not."""
    saved = LMSpeaker.reuse_cache, LMSpeaker.share_prefix, rollout_mod.sample
    LMSpeaker.reuse_cache = name == "kept"
    LMSpeaker.share_prefix = sharing
    if name in ("legacy", "generate"):
        rollout_mod.sample = legacy_sample if name == "legacy" else generate_sample
    try:
        yield
    finally:
        LMSpeaker.reuse_cache, LMSpeaker.share_prefix, rollout_mod.sample = saved


# ------------------------------------------------------------------ one step
def measure(shape, method_name, mode_name, model, tokenizer, args, sharing: bool = True) -> dict:
    cuda = args.device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    env = Shaped(args.turns, args.seed)
    tasks = env.tasks()[:args.tasks]
    method = make_method(method_name, model, tokenizer, args, sharing)
    timed = {}
    real_rollout, real_update = methods_mod.rollout, methods_mod.grpo_update
    updates = []

    def counted_update(*a, **k):         # each update's forward tokens (prefix once, or every row whole)
        sync()
        t0 = time.perf_counter()
        stats = real_update(*a, **k)
        sync()
        role = a[4] if len(a) > 4 else k["key"]
        timed[f"{role}_update_s"] = timed.get(f"{role}_update_s", 0.0) + time.perf_counter() - t0
        cfg = a[6] if len(a) > 6 else k["cfg"]
        passes = cfg.epochs + (1 if cfg.beta else 0)          # policy epochs + the reference pass
        updates.append((stats["tokens_forward"] * passes, stats["tokens_forward_plain"] * passes))
        return stats

    def timed_rollout(*a, **k):          # train_step's rollout, timed on its own
        sync()
        t0 = time.perf_counter()
        episodes = real_rollout(*a, **k)
        sync()
        timed["rollout_s"] = time.perf_counter() - t0
        timed["episodes"] = episodes
        return episodes

    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    methods_mod.rollout, methods_mod.grpo_update = timed_rollout, counted_update
    try:
        with mode(mode_name, sharing), rollout_mod.rollout_batch(args.rollout_batch):
            sync()
            t0 = time.perf_counter()
            if args.no_update:
                methods_mod.rollout(env, tasks, method.policy, method.partner, args.group_size)
            else:
                methods_mod.train_step(method, env, tasks, args.group_size, step=1)
            sync()
            total = time.perf_counter() - t0
    finally:
        methods_mod.rollout, methods_mod.grpo_update = real_rollout, real_update
    episodes = timed.pop("episodes")
    counts = [c for ep in episodes for c in ep.info.get("tokens", {}).values()]
    prefilled = sum(c["prefilled"] for c in counts)
    generated = sum(c["generated"] for c in counts)
    return {"shape": shape, "method": method_name, "mode": mode_name, "batch": len(episodes),
            "sharing": "on" if sharing else "off",
            "update_forward": sum(u[0] for u in updates), "update_forward_plain": sum(u[1] for u in updates),
            "turns": args.turns, "prefilled": prefilled, "generated": generated,
            "rollout_s": timed["rollout_s"], "update_s": total - timed["rollout_s"],
            "policy_update_s": timed.get("agent_update_s", 0.0), "sim_update_s": timed.get("partner_update_s", 0.0),
            "tokens_per_s": generated / timed["rollout_s"],
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_rss_bytes": peak_rss(),
            "four_bit": args.load_in_4bit, "rollout_batch": args.rollout_batch}


def peak_rss() -> int:
    """The process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def medians(rows) -> list[dict]:
    """One row per (shape, method, mode): the median rollout/update time of its repeats."""
    out = {}
    for r in rows:
        out.setdefault((r["shape"], r["method"], r["mode"], r.get("sharing", "on")), []).append(r)
    merged = []
    for group in out.values():
        row = dict(group[0], repeats=len(group))
        for k in ("rollout_s", "update_s", "policy_update_s", "sim_update_s"):
            row[k] = statistics.median(g[k] for g in group)
        row["tokens_per_s"] = row["generated"] / row["rollout_s"]
        if row["peak_bytes"] is not None:
            row["peak_bytes"] = max(g["peak_bytes"] for g in group)
        merged.append(row)
    return merged


def table(rows) -> str:
    lines = ["| shape | method | mode | prefix sharing | batch | prefilled | generated | rollout s | tok/s | update s "
             "| of which simulator's | update forward tokens | step s | peak | peak RSS |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        rss = f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" if r.get("peak_rss_bytes") else "-"
        lines.append(f"| {r['shape']} | {r['method']} | {r['mode']} | {r.get('sharing', 'on')} | {r['batch']} | "
                     f"{r['prefilled']:,} | {r['generated']:,} | {r['rollout_s']:.2f} | {r['tokens_per_s']:,.1f} | "
                     f"{r['update_s']:.2f} | {r['sim_update_s']:.2f} | {r.get('update_forward', 0):,} | "
                     f"{r['rollout_s'] + r['update_s']:.2f} | {peak} | {rss} |")
    return "\n".join(lines)


def summary(rows) -> list[str]:
    """One line per (shape, method) with a kept and a generate row: the three modes' tokens/s."""
    label = {"kept": "kept", "reprefill": "re-prefill", "generate": "generate per turn", "legacy": "legacy"}
    out = []
    rows = [r for r in rows if r.get("sharing", "on") == "on"] or rows     # (--prefix-sharing both: the "on" rows)
    for key in dict.fromkeys((r["shape"], r["method"]) for r in rows):
        group = {r["mode"]: r for r in rows if (r["shape"], r["method"]) == key}
        if "kept" in group and len(group) > 1:
            ref = "generate" if "generate" in group else next(m for m in group if m != "kept")
            parts = ", ".join(f"{label[m]} {group[m]['tokens_per_s']:.1f}" for m in label if m in group)
            out.append(f"{key[0]} {key[1]}: rollout tokens/s: {parts} -> "
                       f"{group['kept']['tokens_per_s'] / group[ref]['tokens_per_s']:.2f}x {ref}")
    return out


def comparisons(rows) -> list[str]:
    """One line per (shape, method): the kept cache against each baseline mode."""
    out = []
    for r in rows:
        if r["mode"] == "kept":
            continue
        kept = next((k for k in rows if k["mode"] == "kept" and k["shape"] == r["shape"]
                     and k["method"] == r["method"] and k.get("sharing") == r.get("sharing")), None)
        if kept:
            fewer = 1 - kept["prefilled"] / max(r["prefilled"], 1)
            out.append(f"{r['shape']} {r['method']}: prefill tokens: {kept['prefilled']:,} vs "
                       f"{r['prefilled']:,} {'re-prefilled' if r['mode'] == 'reprefill' else r['mode']} "
                       f"({fewer:.0%} fewer); rollout {kept['tokens_per_s'] / r['tokens_per_s']:.2f}x the "
                       f"tokens/s of {r['mode']} ({kept['rollout_s']:.2f} s vs {r['rollout_s']:.2f} s)")
    return out


def method_lines(rows) -> list[str]:
    """One line per (shape, mode, sharing) where RL (Single) and another method both ran: the
    other method's whole step, rollout and update against Single's."""
    out = []
    for r in rows:
        if r["method"] == "single":
            continue
        one = next((o for o in rows if o["method"] == "single" and (o["shape"], o["mode"], o.get("sharing"))
                    == (r["shape"], r["mode"], r.get("sharing"))), None)
        if one:
            step, step1 = r["rollout_s"] + r["update_s"], one["rollout_s"] + one["update_s"]
            out.append(f"{r['shape']} {r['mode']}: {r['method']} vs single: step {step:.2f} s vs {step1:.2f} s "
                       f"({step / step1:.2f}x); rollout {r['rollout_s'] / one['rollout_s']:.2f}x; update "
                       f"{r['update_s'] / one['update_s']:.2f}x (the simulator's own update {r['sim_update_s']:.2f} s, "
                       f"the policy's {r['policy_update_s']:.2f} s vs {one['policy_update_s']:.2f} s)")
    return out


def sharing_lines(rows) -> list[str]:
    """One line per (shape, method, mode) measured with prefix sharing on and off."""
    out = []
    for r in rows:
        if r.get("sharing") != "on":
            continue
        off = next((o for o in rows if o.get("sharing") == "off" and
                    (o["shape"], o["method"], o["mode"]) == (r["shape"], r["method"], r["mode"])), None)
        if off:
            step_on, step_off = r["rollout_s"] + r["update_s"], off["rollout_s"] + off["update_s"]
            out.append(f"{r['shape']} {r['method']} {r['mode']}: prefix sharing on vs off: rollout "
                       f"{r['rollout_s']:.2f} s vs {off['rollout_s']:.2f} s, prefilled {r['prefilled']:,} vs "
                       f"{off['prefilled']:,}; update {r['update_s']:.2f} s vs {off['update_s']:.2f} s, forward "
                       f"tokens {r['update_forward']:,} vs {off['update_forward']:,}; step {step_on:.2f} s vs "
                       f"{step_off:.2f} s ({step_off / step_on:.2f}x)")
    return out


def decode_floor_line(model, tokenizer, batch: int = 8, context: int = 400, steps: int = 16) -> str:
    """One decode step of `model` at `batch` rows (as bench/decode_profile.py times it, the
    rollout's default path) against its floor, the weights read once at the memory bandwidth
    measured now."""
    sys.path.insert(0, str(REPO / "bench"))
    from decode_profile import bandwidth_gbs, decode

    base = model.get_base_model()
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in base.parameters()}.values())
    floor = weights / (bandwidth_gbs() * 1e9) * 1e3
    parts = []
    for label, adapter in (("adapters off", None), ("one adapter", "policy")):
        ms, _ = decode(model, tokenizer, batch, context, steps, [adapter] * batch, profile=False)
        parts.append(f"{label} {ms:.0f} ms ({ms / floor:.1f}x)")
    return (f"decode at batch {batch} ({context} tokens cached): {', '.join(parts)} the floor of {floor:.0f} ms "
            f"({weights / 2**20:.0f} MiB of weights at the bandwidth measured in this run)")


def main(argv=None):
    args = parse_args(argv)
    torch.set_grad_enabled(True)
    print("command: " + shlex.join(["python", "bench/step.py", *(sys.argv[1:] if argv is None else argv)]), flush=True)
    rows = []
    floor_lines = []
    for shape in args.shapes or [args.model]:
        model, tokenizer = build_real(shape, args) if args.model else build(shape, args)
        for _ in range(args.warmup):     # first-call costs (allocator, kernels) stay out of the timings
            warm = make_method("single", model, tokenizer, args)
            warm.policy.max_new_tokens = warm.partner.max_new_tokens = 4
            env = Shaped(1, args.seed)
            rollout_mod.rollout(env, env.tasks()[:args.tasks], warm.policy, warm.partner, args.group_size)
        for method_name in args.methods:
            for _ in range(args.repeats):
                for mode_name in args.modes:
                    for sharing in {"on": [True], "off": [False], "both": [True, False]}[args.prefix_sharing]:
                        row = measure(shape, method_name, mode_name, model, tokenizer, args, sharing)
                        rows.append(row)
                        print(f"{shape} {method_name} {mode_name} sharing {row['sharing']}: {row['rollout_s']:.2f} s "
                              f"rollout, {row['prefilled']:,} prefilled, {row['tokens_per_s']:,.0f} tok/s, "
                              f"{row['update_s']:.2f} s update, {row['update_forward']:,} update forward tokens",
                              flush=True)
                        if args.json:
                            Path(args.json).write_text(json.dumps(rows, indent=1))
        if args.model and args.device == "cpu":
            floor_lines.append(f"{shape}: " + decode_floor_line(model, tokenizer))
        del model
    rows = medians(rows)
    print()
    print(table(rows))
    print()
    for line in comparisons(rows):
        print(line)
    print(f"peak RSS of the process: {peak_rss() / 2**30:.2f} GiB")
    for line in summary(rows):
        print(line)
    for line in sharing_lines(rows) + method_lines(rows) + floor_lines:
        print(line)


if __name__ == "__main__":
    main()
