"""GRPO: group-relative advantages and the clipped policy-gradient loss, with diagnostics.

The update shared by every method in the paper (REINFORCE on whole multi-turn
trajectories, group-relative baseline, PPO-style clipping, optional KL to a reference):

    A_i      = (R_i - mean_g R) / std_g R          std over the group (population std)
    r_t      = exp(logp_t - old_logp_t)            per-token importance ratio
    surr_t   = min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1        (the "k3" estimator, >= 0)
               (ratio and kl_t are set to 1 and 0 on untrained tokens *before* the exp:
               exp of an untrained token's log-ratio can be inf, and 0 * inf = NaN)
    loss     = aggregate_t( -surr_t + beta * kl_t )

Every token the policy generated in trajectory i gets the same A_i; tokens said by the
partner or the environment are masked out. A group whose rewards are all equal carries
no signal (A = 0 for all its members): we count it as a "zero-variance group", one of the
symptoms of simulator collapse.
"""

from __future__ import annotations

import torch

from .precision import widen


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, std_floor: float = 0.0):
    """Z-score rewards within groups of `group_size` consecutive rows.

    rewards: [B] with B = n_groups * group_size. Returns (advantages [B], zero_var [n_groups]
    bool). A group with zero spread gets advantage 0 everywhere. std_floor: the z-score
    divides by max(std, std_floor), so a group of continuous rewards that differ by less than
    the reward's resolution gets small advantages instead of +-1 (P4G's read rewards).
    """
    rewards = widen(rewards)     # float64 stays float64 (the toy: minscope/precision.py)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size)                     # [n_groups, G]
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, unbiased=False, keepdim=True)     # population std, as in the paper
    zero_var = std.squeeze(1) < eps
    adv = torch.where(std < eps, torch.zeros_like(r), (r - mean) / std.clamp_min(max(eps, std_floor)))
    return adv.view(-1), zero_var


def token_loss(logp, old_logp, ref_logp, advantages, eps_low: float = 0.2,
               eps_high: float = 0.28, beta: float = 0.0, mask=None):
    """Per-token GRPO loss (before aggregation). All arguments broadcast to the same shape.

    `ref_logp` may be None when beta == 0. `mask` (optional, nonzero = a trained token):
    the KL term is 0 wherever it is 0. Pass it whenever some positions are not trained
    (prompt, the other party's turns, padding): their log-probs can be anything, and
    exp(ref - logp) overflows to inf past ~88, which the aggregation weight 0 would turn
    into 0 * inf = NaN in the loss and in every gradient. Returns (loss, ratio, clipped).
    """
    ratio = torch.exp(kl_log_ratio(logp, old_logp, mask))      # (1 where not trained)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surr = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    loss = -surr
    if beta:
        d = kl_log_ratio(ref_logp, logp, mask)
        loss = loss + beta * (torch.exp(d) - d - 1.0)
    # A token is "clipped" when the clipped branch is the one the min picked (no gradient).
    clipped = (clipped_ratio * advantages < ratio * advantages)
    return loss, ratio, clipped


def kl_log_ratio(a, b, mask=None):
    """a - b (a log-ratio: ref_logp - logp for the KL, logp - old_logp for the ratio), set
    to 0 outside `mask` *before* any exponential: untrained positions stay finite."""
    d = a - b
    return d if mask is None else torch.where(mask != 0, d, torch.zeros_like(d))


def aggregation_weights(mask: torch.Tensor, aggregation: str = "token", max_len: int | None = None):
    """Per-token weights w [B, T] so that loss = sum(w * token_loss).

    token:    mean over all masked tokens in the batch (long answers weigh more)
    sequence: mean per sequence, then mean over sequences (each trajectory weighs the same)
    fixed:    sum / (B * max_len) (Dr. GRPO style; no length bias when max_len is a constant,
              e.g. the generation budget; without it, the batch's padded length)
    """
    mask = mask.float()
    if aggregation == "token":
        return mask / mask.sum().clamp_min(1.0)
    if aggregation == "sequence":
        per_seq = mask.sum(dim=1, keepdim=True).clamp_min(1.0)
        n_seq = (mask.sum(dim=1) > 0).sum().clamp_min(1)
        return mask / per_seq / n_seq
    if aggregation == "fixed":
        return mask / (mask.shape[0] * (max_len or mask.shape[1]))
    raise ValueError(f"unknown aggregation {aggregation!r}; use token, sequence or fixed")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, eps_low: float = 0.2,
              eps_high: float = 0.28, beta: float = 0.0, aggregation: str = "token",
              max_len: int | None = None, entropy=None, zero_var=None):
    """The clipped GRPO loss over a batch of token sequences, in one readable function.

    logp, old_logp, ref_logp, mask, entropy: [B, T]; advantages: [B] (one per sequence).
    Returns (loss scalar, stats dict of floats). Training computes the same loss without
    ever holding [B, T, V] logits: `trainer.grpo_update` passes `token_loss` and
    `aggregation_weights` to `logprobs.fused_grpo_token_loss` (a test checks they agree).
    """
    adv = widen(advantages).unsqueeze(1).expand_as(logp)           # [B, T]
    per_token, ratio, clipped = token_loss(logp, old_logp, ref_logp, adv, eps_low, eps_high, beta, mask)
    w = aggregation_weights(mask, aggregation, max_len)
    loss = (w * per_token).sum()

    m = mask.bool()
    n = m.sum().clamp_min(1)
    with torch.no_grad():
        if ref_logp is not None:
            d = kl_log_ratio(ref_logp, logp, mask)
            k3 = torch.exp(d) - d - 1
        stats = {
            "clip_frac": (clipped & m).sum().item() / n.item(),
            "ratio_mean": ratio[m].mean().item() if m.any() else 1.0,
            # k3 estimate of KL(policy || ref) per token; 0 when no reference given
            "kl": (k3[m].mean().item() if ref_logp is not None and m.any() else 0.0),
        }
        if entropy is not None:
            stats["entropy"] = entropy[m].mean().item() if m.any() else 0.0
        if zero_var is not None:
            stats["zero_var_frac"] = zero_var.float().mean().item()
    return loss, stats


# ----------------------------------------------------------------------- simulator rewards
def simulator_rewards(policy_rewards: torch.Tensor, group_size: int, kind: str):
    """The reward a trainable simulator gets for each episode (Co-Training).

    adversarial: -r_policy           (the simulator wins when the policy fails)
    cooperative: +r_policy           (a helper; the paper's ablation shows it goes trivial)
    curriculum:  exp(-(Var_g(r_policy) - 0.25)^2 / 0.02), the same value for the whole
                 group: highest when the policy succeeds about half the time
    shared:      r_policy            (symmetric tasks: both players share the task reward)
    """
    r = widen(policy_rewards)
    peak, width = 0.25, 0.02     # a 0/1 reward's variance peaks at 0.25 (success half the time)
    if kind == "adversarial":
        return -r
    if kind in ("cooperative", "shared"):
        return r.clone()
    if kind == "curriculum":
        var = r.view(-1, group_size).var(dim=1, unbiased=False)        # [n_groups]
        value = torch.exp(-((var - peak) ** 2) / width)
        return value.repeat_interleave(group_size)
    raise ValueError(f"unknown simulator reward {kind!r}; use adversarial, cooperative, "
                     "curriculum or shared")
