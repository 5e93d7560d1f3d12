"""The GRPO update of one adapter from a batch of episodes (used for the policy and, in
Co-Training, for the simulator: the same loss on the other party's tokens).

    episodes ──► training_batch(key)  ids, mask of this party's sampled tokens, old logp
             ──► update_units  micro-batches of rows, each feeding its shared prompt prefix once
             ──► per unit: prefix.unit_hidden_states ──► fused_grpo_token_loss(hidden, LM head,
                 old_logp, ref_logp, A, weights): the GRPO loss with the LM head fused in (no
                 [B,T,V] logits; the gradient w.r.t. the hidden states is made in the same pass)
             ──► backward ──► clip ──► AdamW

Read top-down, each file is entered once: the batch (minscope/batch.py), the adapter trained
and its LM head (minscope/adapters.py), a unit's hidden states (minscope/prefix.py: feeding
the shared prompt prefix once and keeping it under activation checkpointing happen inside that
one call), then the log-probs (minscope/logprobs.py), whose kernels are all that is below them.

The GRPO loss is a weighted sum over tokens of a function of each token's own log-prob
(every aggregation is a choice of weights), which is what lets `fused_grpo_token_loss`
produce the LM-head gradient in its forward pass: two LM-head matmuls instead of three.

`old_logp` is the log-prob recorded when the token was sampled, so the ratio is correct
even when the tokens came from another adapter (a pool snapshot in Population
Co-Training): that is ordinary importance sampling, and the clip keeps it safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import distributed, prefix
from .adapters import output_embedding, trainable_parameters, use_adapter
from .batch import training_batch
from .errors import RunStopped
from .grpo import aggregation_weights, kl_log_ratio, token_loss
from .logprobs import fused_grpo_token_loss, token_logprobs
from .models import activation_bytes_per_token, checkpointing
from .precision import round_parameters, work_dtype


@dataclass
class UpdateConfig:
    lr: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0            # KL-to-reference coefficient (paper: 0.005)
    aggregation: str = "token"   # token | sequence | fixed (see grpo.aggregation_weights)
    max_len: int | None = None   # "fixed": the constant normaliser (None: each batch's padded length)
    epochs: int = 1              # passes over the batch per step
    micro_batch: int = 64        # sequences per forward/backward (memory knob; same result)
    grad_clip: float = 1.0
    temperature: float = 1.0     # the sampling temperature the tokens were drawn with
    weight_decay: float = 0.1
    logprob_backend: str = "auto"   # LM-head kernels: auto | torch | triton | cublas (see logprobs)
    # skip the whole update (policy forward/backward, reference pass, optimiser step) when every
    # advantage is 0: no group carries a reward signal, and only the KL term (beta) and AdamW's
    # momentum/weight decay would move the adapter (see DESIGN_NOTES, "Updates without signal").
    # Off by default (the paper's update); real-model runs (runner.build_real_method) turn it on.
    skip_zero_signal: bool = False
    # compute each micro-batch's shared prompt prefix once (minscope/prefix.py): the same loss
    # and gradients, fewer forward tokens
    prefix_sharing: bool = True
    # recompute the sampled tokens' old log-probs with the update's own forward pass before the
    # first epoch, so the importance ratio at an unchanged policy is 1: the rollout's come from
    # its cached decode in the model's dtype, which in bf16 differ by up to 0.2 nats. None (auto):
    # for a model that computes below float32 (bf16, fp16, 4-bit); float32/float64 models keep
    # the rollout's (they agree to ~1e-6, and the toy's numbers stay as they were)
    recompute_old: bool | None = None
    # activation checkpointing (models.enable_checkpointing) only for units whose activations
    # would take more than this many bytes (models.activation_bytes_per_token x the unit's padded
    # ids); smaller units keep them and skip the recomputation. None: every unit as the model is set
    checkpoint_above: int | None = None


def make_optimizer(model, adapter: str, cfg: UpdateConfig):
    """AdamW over one adapter's parameters (betas as in the paper)."""
    params = trainable_parameters(model, adapter)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float, adapter, backend: str = "auto"):
    """Log-probs [B, T-1] of each next token under `adapter` (None: the base model)."""
    with use_adapter(model, adapter):
        hidden = prefix.hidden_states(model, input_ids, attention_mask)[:, :-1]   # [B, T-1, H]
        return token_logprobs(hidden, output_embedding(model), input_ids[:, 1:], temperature=temperature,
                              backend=backend)


def skipped_update(episodes, key: str, pad_id: int, reason: str) -> dict:
    """The statistics of an update that was not run (`UpdateConfig.skip_zero_signal`): nothing
    was fed forward or back; the statistics that only a forward pass measures are None."""
    batch = training_batch(episodes, key, pad_id)     # (the same checks as a real update)
    return {"loss": 0.0, "clip_frac": 0.0, "kl": None, "entropy": None, "grad_norm": 0.0,
            "tokens": int(batch.loss_mask.sum().item()), "tokens_fed": 0, "tokens_trained": 0,
            "tokens_forward": 0, "tokens_forward_plain": 0, "skipped_steps": 0,
            "skipped_update": True, "skip_reason": reason}


def zero_signal(advantages: torch.Tensor) -> bool:
    """True when no episode has a nonzero advantage (every group's rewards were equal)."""
    return not bool((advantages != 0).any())


def grpo_update(model, adapter: str, optimizer, episodes, key: str, advantages: torch.Tensor,
                cfg: UpdateConfig, pad_id: int, row_stats: bool = False, sampled_by=None) -> dict:
    """One GRPO step on adapter `adapter` from the `key` party's tokens of `episodes`.

    advantages: [len(episodes)], one per episode. Returns the statistics averaged over the epochs
    whose update was applied (a skipped, non-finite epoch is counted in `skipped_steps`, not averaged in).
    With `cfg.skip_zero_signal` and every advantage 0, nothing is computed: the statistics say
    `skipped_update: True` and why.
    row_stats: also return, per episode with tokens, the first pass's importance ratios
    (`rows`: episode index -> [trained tokens, clipped tokens, sum of |log ratio|]): a
    measurement only, from tensors the update computes anyway.
    sampled_by(episode) -> the adapter that sampled its `key` tokens (default: `adapter`; a
    population's pool snapshots): the old log-probs are recomputed under it (`cfg.recompute_old`).
    `ratio_dev_max` in the statistics is the largest |ratio - 1| of the first pass (0 at an
    unchanged policy when the old log-probs are recomputed).
    """
    if cfg.skip_zero_signal and zero_signal(distributed.all_sum(advantages.abs().sum()).reshape(1)):
        return skipped_update(episodes, key, pad_id, "every advantage is 0 (no group's rewards differ)")
    batch = training_batch(episodes, key, pad_id, dtype=work_dtype(model))
    device = next(model.parameters()).device
    adv = advantages[batch.index].to(device)                                     # [B]
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
    mask, old = batch.loss_mask.to(device), batch.old_logp.to(device)
    weights = aggregation_weights(mask, cfg.aggregation, cfg.max_len)                # [B, T-1]
    weights = distributed.rescale_weights(weights, mask, cfg.aggregation, cfg.max_len)   # torchrun: whole batch
    units = update_units(model, ids, attn, mask, cfg)
    if cfg.recompute_old if cfg.recompute_old is not None else computes_below_fp32(model):
        samplers = [adapter if sampled_by is None else sampled_by(episodes[i]) for i in batch.index]
        old = recompute_old_logprobs(model, ids, attn, mask, old, units, samplers, cfg)
    ref = None
    if cfg.beta:   # the reference model = the base with adapters disabled (micro-batched too)
        ref = torch.zeros_like(old)
        with torch.no_grad():
            for rows, p, n in units:
                ref[rows, p:n - 1] = unit_logprobs(model, ids, attn, (rows, p, n), cfg.temperature,
                                                   adapter=None, backend=cfg.logprob_backend,
                                                   where=mask[rows, p:n - 1] != 0)
    # this adapter's parameters, kept as a list: peft flips requires_grad whenever the active
    # adapter changes (use_adapter restores the model's default on exit), so it cannot tell
    params = trainable_parameters(model, adapter)
    per_token = activation_bytes_per_token(model) if cfg.checkpoint_above is not None else None
    model.train()
    sums = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    skipped = 0     # epochs whose update was dropped (non-finite); the statistics average the others
    n_tok = distributed.all_sum(mask.sum()).clamp_min(1)     # over every rank's batch under torchrun
    row_ratios = {}     # row_stats: episode index -> [trained, clipped, sum |log ratio|]
    ratio_dev = 0.0     # the first pass's largest |ratio - 1|
    for epoch_i in range(cfg.epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0}
        finite = True
        for rows, p, n in units:
            sl = (rows, slice(p, n - 1))          # the unit's loss positions (those before p carry none)
            ref_sl = None if ref is None else ref[sl]
            adv_tok = adv[rows, None].expand_as(old[sl])
            trained = mask[sl] != 0     # the LM head runs at these positions only (the rest weigh 0)
            with use_adapter(model, adapter), checkpointing(model, checkpointed((rows, p, n), per_token, cfg)):
                hidden = prefix.unit_hidden_states(model, ids, attn, (rows, p, n))   # [b, n-1-p, H]
                # weights already hold the batch normaliser; logp and ent come back detached
                loss, lp, en = fused_grpo_token_loss(
                    hidden[trained], output_embedding(model), ids[rows, p + 1:n][trained], old[sl][trained],
                    None if ref_sl is None else ref_sl[trained], adv_tok[trained], weights[sl][trained],
                    cfg.eps_low, cfg.eps_high, cfg.beta, cfg.temperature, backend=cfg.logprob_backend)
                # backward inside the block: with activation checkpointing the layers are
                # recomputed now, and must see the same adapter as in the forward pass
                loss.backward()
            # back to the unit's [b, n-1-p] positions: untrained ones read as the old policy
            # (ratio 1) with entropy 0; every statistic below masks them out anyway
            logp = old[sl].clone().masked_scatter_(trained, lp.to(old.dtype))
            ent = torch.zeros_like(old[sl]).masked_scatter_(trained, en.to(old.dtype))
            finite = finite and bool(torch.isfinite(loss.detach()))
            clipped = token_loss(logp, old[sl], ref_sl, adv_tok, cfg.eps_low, cfg.eps_high, cfg.beta)[2]
            m = mask[sl].bool()
            epoch["loss"] += loss.item()
            epoch["clip_frac"] += (clipped & m).sum().item() / n_tok.item()
            if epoch_i == 0 and m.any():
                ratio_dev = max(ratio_dev, float(((logp.detach() - old[sl])[m].exp() - 1).abs().max()))
            if row_stats and epoch_i == 0:
                log_ratio = kl_log_ratio(logp.detach(), old[sl], mask[sl]).abs()
                for i, n_i, c_i, lr_i in zip([batch.index[r] for r in rows], m.sum(1).tolist(),
                                             (clipped & m).sum(1).tolist(), (log_ratio * m).sum(1).tolist()):
                    row_ratios[i] = [n_i, c_i, lr_i]
            epoch["entropy"] += (ent * mask[sl]).sum().item() / n_tok.item()
            if ref is not None:
                d = kl_log_ratio(ref_sl, logp.detach(), mask[sl])   # no exp where untrained
                epoch["kl"] += ((d.exp() - d - 1) * mask[sl]).sum().item() / n_tok.item()
        distributed.all_reduce_grads(params)      # torchrun: the whole batch's gradient on every rank
        epoch, finite = distributed.sum_stats(epoch), distributed.all_true(finite)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        if finite and math.isfinite(grad_norm):
            optimizer.step()
            round_parameters(params)      # float64 (the toy's) only: minscope/precision.py
            for k, v in epoch.items():
                sums[k] += v
            sums["grad_norm"] += grad_norm
            optimizer.nonfinite_streak = 0
        else:
            skip_step(optimizer, adapter)
            skipped += 1
    model.eval()
    applied = cfg.epochs - skipped
    if applied:
        sums = {k: v / applied for k, v in sums.items()}
    sums["tokens"] = int(n_tok.item())
    # this process's batch, per pass (the compute estimate, minscope/compute.py): the real
    # tokens each epoch feeds forward and back (a shared prefix once per unit), and the
    # trained ones among them; tokens_forward_plain: what feeding every row whole would take
    sums["tokens_fed"], sums["tokens_trained"] = prefix.fed_tokens(attn, units), int(mask.sum().item())
    sums["tokens_forward"], sums["tokens_forward_plain"] = sums["tokens_fed"], int(attn.sum().item())
    sums["skipped_steps"] = skipped
    sums["skipped_update"] = False
    sums["ratio_dev_max"] = ratio_dev
    if row_stats:
        sums["rows"] = row_ratios
    return sums


def update_units(model, ids, attn, mask, cfg: UpdateConfig):
    """The update's forward units (rows, shared prefix length, padded length): shared prompt
    prefixes (minscope/prefix.py) with `cfg.prefix_sharing`, else plain micro-batches of the
    whole padded width (the path before prefix sharing)."""
    if cfg.prefix_sharing and prefix.supported(model):
        return prefix.plan(ids, attn, mask, cfg.micro_batch)
    B, T = ids.shape
    return [(list(range(s, min(s + cfg.micro_batch, B))), 0, T) for s in range(0, B, cfg.micro_batch)]


def checkpointed(unit, per_token: int | None, cfg: UpdateConfig) -> bool:
    """Whether unit (rows, p, n) recomputes its activations in the backward pass: its padded
    ids (the prefix once, each row's n - p) times `per_token` above `cfg.checkpoint_above`."""
    if cfg.checkpoint_above is None or per_token is None:
        return True
    rows, p, n = unit
    return (p + len(rows) * (n - p)) * per_token > cfg.checkpoint_above


def unit_logprobs(model, input_ids, attention_mask, unit, temperature: float, adapter,
                  backend: str = "auto", where=None):
    """Log-probs [b, n-1-p] of the next tokens of a unit (rows, p, n) after position p
    (prefix.unit_hidden_states). where [b, n-1-p] bool: only those positions go through the LM
    head (the others read 0): the head's [positions, vocabulary] products are the update's
    largest after the body's, and the other party's tokens carry no loss."""
    rows, p, n = unit
    with use_adapter(model, adapter):
        hidden = prefix.unit_hidden_states(model, input_ids, attention_mask, unit)
        targets = input_ids[rows, p + 1:n]
        if where is None:
            return token_logprobs(hidden, output_embedding(model), targets, temperature=temperature, backend=backend)
        lp = token_logprobs(hidden[where], output_embedding(model), targets[where], temperature=temperature,
                            backend=backend)
        return torch.zeros(targets.shape, dtype=lp.dtype, device=lp.device).masked_scatter_(where, lp)


def computes_below_fp32(model) -> bool:
    """Whether some weight of `model` is narrower than float32 (bf16, fp16, a 4-bit base)."""
    return any(p.dtype not in (torch.float32, torch.float64) for p in model.parameters())


def recompute_old_logprobs(model, ids, attn, mask, old, units, samplers, cfg: UpdateConfig):
    """`old` with every trained token's log-prob recomputed by the update's forward pass (no
    gradient), each row under the adapter that sampled it (`samplers[row]`)."""
    out = old.clone()
    with torch.no_grad():
        for rows, p, n in units:
            for name in dict.fromkeys(samplers[r] for r in rows):
                sub = [r for r in rows if samplers[r] == name]
                keep = mask[sub, p:n - 1].bool()
                lp = unit_logprobs(model, ids, attn, (sub, p, n), cfg.temperature, adapter=name,
                                   backend=cfg.logprob_backend, where=keep)
                out[sub, p:n - 1] = torch.where(keep, lp.to(out.dtype), out[sub, p:n - 1])
    return out


MAX_NONFINITE_IN_A_ROW = 3


def skip_step(optimizer, adapter: str) -> None:
    """Drop an optimiser step whose loss or gradient is NaN/inf. One such step would make
    every parameter of the adapter NaN (AdamW's moments keep it forever), so it is skipped
    and counted; `MAX_NONFINITE_IN_A_ROW` of them in a row mean the training itself has gone
    wrong, and the run stops (RunStopped) with its last good state on disk. The count lives
    on the optimizer because each adapter has its own."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.nonfinite_streak = getattr(optimizer, "nonfinite_streak", 0) + 1
    if optimizer.nonfinite_streak >= MAX_NONFINITE_IN_A_ROW:
        raise RunStopped(f"adapter '{adapter}': {optimizer.nonfinite_streak} optimiser steps in a row had a "
                         "non-finite (NaN/inf) loss or gradient, so none was applied; the run stops here. "
                         "Its last good state is saved: lower the learning rate or check the rewards, "
                         "then --resume")
