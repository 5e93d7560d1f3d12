"""The models of a real run or of its evaluation: the policy, the frozen training
simulator(s), a trainable simulator adapter and the panel (`build_models` -> `Models`), the
method assembled on them (`build_real_method`), and what every LM speaker shares (thinking,
prefix sharing, the rollout batch that fits in memory). `real_eval` (eval.py) rebuilds the
same models from a run's config.json.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import add_adapters, load_adapter
from .hardware import pick_dtype
from .methods import build_method
from .models import (
    enable_checkpointing,
    load_model,
    pick_device,
)
from .real_args import TRAINS_SIMULATOR, parse_panel, resolve_path, setting
from .rollout import LMSpeaker
from .served import ServedSpeaker, is_spec, parse_spec
from .sft import AnchorBatches, encode_chat
from .simulators import Frozen
from .trainer import UpdateConfig

CPU_ROLLOUT_BATCH = 32                         # episodes generated at once on a CPU


def adapter_folder(path: str) -> Path | None:
    """The folder holding a PEFT adapter (adapter_config.json) at `path` or in its only
    subfolder (save_adapter writes `DIR/<adapter name>/`); None for a model directory."""
    p = Path(path).expanduser()
    if (p / "adapter_config.json").is_file():
        return p
    subs = list(p.glob("*/adapter_config.json")) if p.is_dir() else []
    return subs[0].parent if len(subs) == 1 else None


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


def check_model_settings(model, args) -> None:
    """Settings that only the loaded model can check, one line each: a LoRA rank above its
    width adds parameters and nothing else (a huge one would try to allocate them), and a
    turn longer than its context cannot be generated (the cache would be sized for it)."""
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None)
    r = setting(args, "lora_r")
    if width is not None and r > width:
        raise SystemExit(f"--lora-r {r}: above the model's hidden size ({width}); give at most {width}")
    context = getattr(config, "max_position_embeddings", None)
    tokens = getattr(args, "max_new_tokens", None)
    if context is not None and tokens is not None and tokens > context:
        raise SystemExit(f"--max-new-tokens {tokens}: above the model's context length ({context} "
                         "tokens); give fewer")


def build_models(args, train_simulator: bool = False, panel_spec: str | None = None,
                 partner=None) -> Models:
    """Load the policy, the simulator and the panel named by train.py's `args`.

    train_simulator: add a trainable "simulator" adapter on the simulator's base
    (Co-Training). panel_spec overrides `args.panel`. The frozen training simulator is
    the simulator's base with adapters disabled; it is also the panel's first member.
    partner: the environment's scripted partner (`Environment.scripted_partner`): it is the
    training partner and the whole panel, and no simulator model is loaded.
    """
    device = pick_device(setting(args, "device"))
    bits = dict(load_in_4bit=args.load_in_4bit, device=device, dtype=pick_dtype(setting(args, "dtype"), device))
    # --simulator-4bit: the simulators' bases (training simulator, population, panel) in NF4 and the
    # policy's as --dtype says; a simulator on the policy's model then gets a base of its own
    sim_bits = {**bits, "load_in_4bit": args.load_in_4bit or bool(setting(args, "simulator_4bit"))}
    temperature = setting(args, "temperature")
    lora = dict(r=setting(args, "lora_r"), alpha=setting(args, "lora_alpha"))   # every trained adapter's
    if partner is not None:
        policy_model, tok = load_model(resolve_path(args.policy), **bits)
        check_model_settings(policy_model, args)
        policy_model = add_adapters(policy_model, ["policy"], **lora)
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
    shared = not sim_path or (sim_path == policy_path and sim_bits == bits)
    sim_model, sim_tok = (policy_model, tok) if shared else load_model(sim_path, **sim_bits)
    sim_path = sim_path or policy_path
    check_model_settings(policy_model, args)

    # Decide every adapter before creating any speaker: wrapping a model in peft changes
    # which object has to be called (the raw base would then run the active adapter).
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
        elif path == policy_path and shared:
            member = frozen_speaker(name, policy_model, tok)
        else:
            member = frozen_speaker(name, *load_model(path, **sim_bits))
        panel[name] = (member, kind)
    policy = LMSpeaker(policy_model, tok, "agent", adapter="policy", temperature=temperature,
                       max_new_tokens=args.max_new_tokens, name="policy")
    return Models(policy_model, tok, sim_model, sim_tok, policy, [frozen], panel)


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
    # checkpoint_above: an update unit whose activations fit in --checkpoint-above MiB keeps them
    # (no recomputation); bigger ones are checkpointed (minscope/trainer.py, `checkpointed`)
    above = getattr(args, "checkpoint_above", None)
    above = CHECKPOINT_ABOVE_MIB if above is None else above
    ucfg = dict(epochs=1, micro_batch=args.micro_batch, temperature=setting(args, "temperature"),
                beta=setting(args, "kl"), skip_zero_signal=True, prefix_sharing=sharing,
                logprob_backend=setting(args, "logprob_backend"), checkpoint_above=above * 2**20)
    method = build_method(args.method, models.policy, frozen, UpdateConfig(lr=args.lr, **ucfg),
                          UpdateConfig(lr=args.sim_lr, **ucfg),
                          sim_model=models.sim_model if args.method in TRAINS_SIMULATOR else None,
                          sim_tokenizer=models.sim_tokenizer,
                          sim_reward=getattr(args, "sim_reward", None) or env.default_simulator_reward,
                          personas=personas, pool_draw=getattr(args, "pool_draw", None) or "uniform",
                          vs_k=setting(args, "vs_k"), pool_size=setting(args, "pool_size"),
                          pool_every=setting(args, "pool_every"), seed=seed)
    if setting(args, "sim_anchor") > 0 and method.trains_simulator:
        method.anchor, method.anchor_weight = realism_anchor(env, models.sim_tokenizer, seed), setting(args, "sim_anchor")
    if not getattr(args, "no_grad_checkpointing", False):   # the trained bases recompute activations
        for model in _trained_models(models, method):
            enable_checkpointing(model.get_base_model())
    set_thinking(method, models, getattr(args, "thinking", False))
    for speaker in speakers_of(method, models):     # ... and once in the rollout (sampling.share_prefixes)
        speaker.share_prefix = sharing
    return models, method


# Activations an update unit may keep instead of recomputing them (MiB): a 2-turn P4G unit of
# SmolLM2 (a group's ~430-id persona prompt once, 4 rows of ~85 ids) keeps ~0.9 GiB
CHECKPOINT_ABOVE_MIB = 1024

ANCHOR_BATCH = 4     # real persuadees per anchor step (--sim-anchor)


def realism_anchor(env, tokenizer, seed: int) -> AnchorBatches:
    """`--sim-anchor`'s batches: the environment's real-user transcripts (P4G: its corpus's
    persuadees, `anchor_conversations`), encoded once, drawn on a stream of their own."""
    if not hasattr(env, "anchor_conversations"):
        raise SystemExit(f"--sim-anchor: --env {env.name} has no real-user transcripts to anchor to (p4g has)")
    convs = env.anchor_conversations()
    if not convs:
        raise SystemExit(f"--sim-anchor: the {env.split} split of the data holds no dialogue with a recorded donation")
    encoded = [encode_chat(tokenizer, c) for c in convs]
    return AnchorBatches(encoded, ANCHOR_BATCH, tokenizer.pad_token_id, random.Random(seed + 777))


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


def eval_panel(panel: dict, temperature: float) -> dict:
    """The panel with every LM simulator sampling at `temperature` (copies; 0 = greedy)."""
    out = {}
    for name, (speaker, kind) in panel.items():
        if isinstance(speaker, (LMSpeaker, ServedSpeaker)):
            speaker = copy.copy(speaker)
            speaker.temperature = temperature
        out[name] = (speaker, kind)
    return out
