"""Compute accounting: the tokens each training step generates and trains on, and a FLOPs
estimate from them, so that methods can be compared at equal compute as well as at equal steps
(Verbalized Sampling's simulator writes k candidates per turn; Co-Training also trains the
simulator: the paper puts it at ~2x and compares at matched steps only).

The counts are taken where the work happens, not re-derived from transcripts:

    rollout   LMSpeaker._sample, per episode and party (ep.info["tokens"][role]): the ids fed
              to the model before sampling ("prefilled", only the part not already in the KV
              cache) and the ids sampled ("generated"), with N of the model that did it. So
              VS's k-candidate answers and its retries are counted, and a scripted partner
              (the oracle's real users) costs nothing.
    update    trainer.grpo_update: the real (non-pad) tokens of the batch, which every epoch's
              pass feeds forward and back ("backprop"), and the trained (loss) tokens among them;
              the reference model's forward when the KL coefficient beta > 0; the realism
              anchor's SFT step (methods.anchor_step) when the arm has one.

FLOPs estimate (the usual dense-transformer rule, attention's context-dependent term left out):

    forward  2 N per token processed    (rollout prefill + decode; the KL reference pass)
    training 6 N per token per epoch    (forward + backward over every token of the batch)

N = the parameter count of the model that processes the token: the base model (a tied
embedding counted once) plus the one LoRA adapter in use (`parameter_count`); the reference
pass runs the base alone. Training is charged for every token the pass feeds, not only the
trained ones: the forward and backward run over the whole conversation, the loss mask only
selects where the loss is read. With a frozen base the backward computes no weight gradients
for it, so 6 N is an upper estimate (~4 N); every arm trains LoRA adapters, so the ratios
between methods do not depend on it. Padding, and rows decoded past their end before the
engine's next finished-check, are not counted.

Only training counts: evaluations, the collapse meter and pool-diversity measurements run
outside `methods.train_step` and are left out. Counts are this process's work (under torchrun
`distributed.merge_metrics` adds the ranks' dicts). `experiment.run_arm` keeps the running
totals in the arm's saved state, so a resumed run continues them.
"""

from __future__ import annotations

import weakref

FORWARD_FLOPS_PER_PARAM = 2          # per token, forward pass
TRAIN_FLOPS_PER_PARAM = 6            # per token and epoch, forward + backward

# one training step's counts (methods.train_step's metrics["compute"]); every value an int
KEYS = ("policy_prefilled", "policy_decoded", "sim_prefilled", "sim_decoded",   # rollout tokens
        "policy_trained", "policy_backprop", "sim_trained", "sim_backprop",     # update tokens (x epochs)
        "ref_forward",                                                          # KL reference pass tokens
        "rollout_flops", "update_flops", "flops")

_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def parameter_count(model, adapter: str | None = None) -> int:
    """N of `model` run through `adapter`: every base parameter (shared, tied tensors once) plus
    that adapter's LoRA parameters (None: the base alone). Cached per model and adapter."""
    from .adapters import lora_parameters

    counts = _COUNTS.setdefault(model, {})
    if adapter not in counts:
        base = sum(p.numel() for name, p in model.named_parameters() if "lora_" not in name)
        counts[adapter] = base + (sum(p.numel() for p in lora_parameters(model, adapter).values()) if adapter else 0)
    return counts[adapter]


def step_compute(m, episodes, policy_update: dict, sim_update: dict | None = None) -> dict:
    """The compute of one training step of method `m` (a `methods.Method`): its rollout's
    `episodes` and the statistics its `grpo_update` calls returned (see the module docstring)."""
    out = dict.fromkeys(KEYS, 0)
    for ep in episodes:
        for role, count in ep.info.get("tokens", {}).items():
            side = "policy" if role == "agent" else "sim"
            out[f"{side}_prefilled"] += count["prefilled"]
            out[f"{side}_decoded"] += count["generated"]
            out["rollout_flops"] += FORWARD_FLOPS_PER_PARAM * count["params"] * (count["prefilled"] + count["generated"])
    updates = [("policy", m.policy.model, m.policy.adapter, m.policy_cfg, policy_update)]
    if sim_update is not None:
        updates.append(("sim", m.partner.model, m.partner.trainable_adapter, m.sim_cfg, sim_update))
    for side, model, adapter, cfg, u in updates:
        out[f"{side}_trained"] += u["tokens_trained"] * cfg.epochs
        out[f"{side}_backprop"] += u["tokens_fed"] * cfg.epochs
        out["update_flops"] += TRAIN_FLOPS_PER_PARAM * parameter_count(model, adapter) * u["tokens_fed"] * cfg.epochs
        if cfg.beta:                          # the reference log-probs: one forward of the base
            out["ref_forward"] += u["tokens_fed"]
            out["update_flops"] += FORWARD_FLOPS_PER_PARAM * parameter_count(model) * u["tokens_fed"]
    if sim_update is not None and m.anchor is not None:      # the anchor's SFT step, one pass
        fed, trained = m.anchor_tokens
        out["sim_trained"] += trained
        out["sim_backprop"] += fed
        out["update_flops"] += TRAIN_FLOPS_PER_PARAM * parameter_count(m.partner.model, m.partner.trainable_adapter) * fed
    out["flops"] = out["rollout_flops"] + out["update_flops"]
    return out


def totals(saved: dict | None = None) -> dict:
    """Running totals to start from: zeros, or those saved in an arm's state (a state saved
    before a key existed counts it from 0)."""
    return add(saved or {}, {})


def add(total: dict, step: dict) -> dict:
    """Running totals plus one step's counts (a new dict)."""
    return {k: total.get(k, 0) + step.get(k, 0) for k in KEYS}
