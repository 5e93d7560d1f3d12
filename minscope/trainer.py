"""The GRPO update of one adapter from a batch of episodes (used for the policy and, in
Co-Training, for the simulator: the same loss on the other party's tokens).

    episodes ──► training_batch(key)  ids, mask of this party's sampled tokens, old logp
             ──► final_hidden_states ──► fused_grpo_token_loss(hidden, LM head, old_logp,
                 ref_logp, A, weights): the GRPO loss with the LM head fused in (no [B,T,V]
                 logits; the gradient w.r.t. the hidden states is made in the same pass)
             ──► backward ──► clip ──► AdamW

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

from . import distributed
from .errors import RunStopped
from .grpo import aggregation_weights, kl_log_ratio, token_loss
from .logprobs import fused_grpo_token_loss, token_logprobs
from .models import final_hidden_states, output_embedding, trainable_parameters, use_adapter
from .rollout import training_batch


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


def make_optimizer(model, adapter: str, cfg: UpdateConfig):
    """AdamW over one adapter's parameters (betas as in the paper)."""
    params = trainable_parameters(model, adapter)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float, adapter, backend: str = "auto"):
    """Log-probs [B, T-1] of each next token under `adapter` (None: the base model)."""
    with use_adapter(model, adapter):
        hidden = final_hidden_states(model, input_ids, attention_mask)[:, :-1]   # [B, T-1, H]
        return token_logprobs(hidden, output_embedding(model), input_ids[:, 1:], temperature=temperature,
                              backend=backend)


def grpo_update(model, adapter: str, optimizer, episodes, key: str, advantages: torch.Tensor,
                cfg: UpdateConfig, pad_id: int, row_stats: bool = False) -> dict:
    """One GRPO step on adapter `adapter` from the `key` party's tokens of `episodes`.

    advantages: [len(episodes)], one per episode. Returns the statistics averaged over the epochs
    whose update was applied (a skipped, non-finite epoch is counted in `skipped_steps`, not averaged in).
    row_stats: also return, per episode with tokens, the first pass's importance ratios
    (`rows`: episode index -> [trained tokens, clipped tokens, sum of |log ratio|]): a
    measurement only, from tensors the update computes anyway.
    """
    batch = training_batch(episodes, key, pad_id)
    device = next(model.parameters()).device
    adv = advantages[batch.index].to(device)                                     # [B]
    ids, attn = batch.input_ids.to(device), batch.attention_mask.to(device)
    mask, old = batch.loss_mask.to(device), batch.old_logp.to(device)
    weights = aggregation_weights(mask, cfg.aggregation, cfg.max_len)                # [B, T-1]
    weights = distributed.rescale_weights(weights, mask, cfg.aggregation, cfg.max_len)   # torchrun: whole batch
    ref = None
    if cfg.beta:   # the reference model = the base with adapters disabled (micro-batched too)
        with torch.no_grad():
            ref = torch.cat([sequence_logprobs(model, ids[s:s + cfg.micro_batch], attn[s:s + cfg.micro_batch],
                                               cfg.temperature, adapter=None, backend=cfg.logprob_backend)
                             for s in range(0, ids.shape[0], cfg.micro_batch)])
    # this adapter's parameters, kept as a list: peft flips requires_grad whenever the active
    # adapter changes (use_adapter restores the model's default on exit), so it cannot tell
    params = trainable_parameters(model, adapter)
    model.train()
    sums = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    skipped = 0     # epochs whose update was dropped (non-finite); the statistics average the others
    n_tok = distributed.all_sum(mask.sum()).clamp_min(1)     # over every rank's batch under torchrun
    rows = {}
    for epoch_i in range(cfg.epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0}
        finite = True
        for s in range(0, ids.shape[0], cfg.micro_batch):
            sl = slice(s, s + cfg.micro_batch)
            ref_sl = None if ref is None else ref[sl]
            adv_tok = adv[sl, None].expand_as(old[sl])
            with use_adapter(model, adapter):
                hidden = final_hidden_states(model, ids[sl], attn[sl])[:, :-1]  # [b, T-1, H]
                # weights already hold the batch normaliser; logp and ent come back detached
                loss, logp, ent = fused_grpo_token_loss(
                    hidden, output_embedding(model), ids[sl, 1:], old[sl], ref_sl, adv_tok, weights[sl],
                    cfg.eps_low, cfg.eps_high, cfg.beta, cfg.temperature, backend=cfg.logprob_backend)
                # backward inside the block: with activation checkpointing the layers are
                # recomputed now, and must see the same adapter as in the forward pass
                loss.backward()
            finite = finite and bool(torch.isfinite(loss.detach()))
            clipped = token_loss(logp, old[sl], ref_sl, adv_tok, cfg.eps_low, cfg.eps_high, cfg.beta)[2]
            m = mask[sl].bool()
            epoch["loss"] += loss.item()
            epoch["clip_frac"] += (clipped & m).sum().item() / n_tok.item()
            if row_stats and epoch_i == 0:
                log_ratio = kl_log_ratio(logp.detach(), old[sl], mask[sl]).abs()
                for i, n_i, c_i, lr_i in zip(batch.index[sl], m.sum(1).tolist(),
                                             (clipped & m).sum(1).tolist(), (log_ratio * m).sum(1).tolist()):
                    rows[i] = [n_i, c_i, lr_i]
            epoch["entropy"] += (ent * mask[sl]).sum().item() / n_tok.item()
            if ref is not None:
                d = kl_log_ratio(ref[sl], logp.detach(), mask[sl])   # no exp where untrained
                epoch["kl"] += ((d.exp() - d - 1) * mask[sl]).sum().item() / n_tok.item()
        distributed.all_reduce_grads(params)      # torchrun: the whole batch's gradient on every rank
        epoch, finite = distributed.sum_stats(epoch), distributed.all_true(finite)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        if finite and math.isfinite(grad_norm):
            optimizer.step()
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
    # tokens each epoch feeds forward and back, and the trained ones among them
    sums["tokens_fed"], sums["tokens_trained"] = int(attn.sum().item()), int(mask.sum().item())
    sums["skipped_steps"] = skipped
    if row_stats:
        sums["rows"] = rows
    return sums


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
