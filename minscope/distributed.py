"""Data parallelism for real-model runs: `torchrun --nproc_per_node N train.py --env ...`.

Every process (rank) holds the whole model (a LoRA run's trainable part is a few MB, so
there is nothing to shard) and plays its share of each step's rollout groups; the update
sums the adapters' gradients over ranks, so every rank takes the same optimiser step:

    step's groups ──► rank r plays groups [r*G/N, (r+1)*G/N)   (group numbers stay global)
                 ──► grpo_update: per-token weights normalised by the GLOBAL token count
                     (`rescale_weights`), local backward, one all-reduce (sum) of the
                     adapter's gradients (`all_reduce_grads`), the same clip and AdamW step
    rank 0 alone evaluates, logs, saves adapters and state.pt (with every rank's random
    streams, so `--resume` under the same N continues each rank where it stopped)

Because each rollout chunk samples from a stream seeded by (step, its first group)
(`rollout(seed=...)`), a group's episodes do not depend on which process played it: with
the same seeds and total batch, and rollout chunks that fall on the ranks' boundaries
(`--rollout-batch` = G/N groups x group size, or a divisor of it), the first update equals
the one-process run's up to the order of floating-point sums. Later steps drift apart by
those rounding differences only (tests/test_distributed.py measures the first).

Backends: NCCL on CUDA (each rank on GPU LOCAL_RANK), gloo on CPU. While rank 0 evaluates
the other ranks wait in the next step's first collective: the timeout is
MINSCOPE_DIST_TIMEOUT seconds (default 7200), so a long evaluation does not kill the job.
Nothing here does anything in a plain `python train.py` run (one process).
"""

from __future__ import annotations

import datetime
import os
from collections import Counter

import torch
import torch.distributed as dist

# metrics.jsonl keys that are counts over the step's episodes: summed over ranks (the rest
# are means over equal shares, identical values, or maxima: see `merge_metrics`)
SUM_KEYS = {"score_errors", "tokens_prefilled", "tokens_generated", "served_requests", "served_retries",
            "served_prompt_tokens", "served_completion_tokens", "vs_requests", "vs_retries",
            "vs_parse_failures", "vs_fallbacks", "vs_draws"}
MAX_KEYS = {"rollout_s", "served_latency_max_s"}
GROUP_LIST_KEYS = {"pool_played"}       # one entry per group: the ranks' lists joined


def launched() -> bool:
    """True in a process started by torchrun with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def setup() -> tuple[int, int]:
    """Join the torchrun job (once); returns (rank, world size). (0, 1) without torchrun."""
    if not launched():
        return 0, 1
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        seconds = float(os.environ.get("MINSCOPE_DIST_TIMEOUT", "7200"))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=seconds))
    return dist.get_rank(), dist.get_world_size()


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def refuse_toy() -> None:
    if launched():
        raise SystemExit("the toy experiment runs its arms in worker processes of its own (--workers); "
                         "torchrun is for real environments (--env p4g|tau2|wordgame)")


def shard(tasks: list) -> tuple[list, int]:
    """This rank's contiguous share of a step's tasks (rollout groups), and the global
    number of its first group."""
    n = world_size()
    if len(tasks) % n:
        raise SystemExit(f"--groups {len(tasks)} cannot be split evenly over {n} processes; "
                         f"give a multiple of {n}")
    per = len(tasks) // n
    r = rank()
    return tasks[r * per:(r + 1) * per], r * per


# --------------------------------------------------------------------------- the update
def all_sum(x):
    """The sum over ranks of a number or tensor (itself in one process)."""
    if not active():
        return x
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    t = t.to("cuda") if dist.get_backend() == "nccl" else t.cpu()
    dist.all_reduce(t)
    return t.item() if not isinstance(x, torch.Tensor) else t.to(x.device, x.dtype)


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every rank (so that all of them skip, or take, a step)."""
    return bool(all_sum(0.0 if flag else 1.0) == 0) if active() else flag


def rescale_weights(weights: torch.Tensor, mask: torch.Tensor, aggregation: str,
                    max_len: int | None) -> torch.Tensor:
    """`grpo.aggregation_weights` of this rank's batch, renormalised as if computed on the
    whole batch of every rank: token by the global token count, sequence by the global
    count of sequences, fixed by the global rows x (max_len or the global padded length)."""
    if not active():
        return weights
    if aggregation == "token":
        local, total = mask.sum().clamp_min(1.0), all_sum(mask.sum()).clamp_min(1.0)
    elif aggregation == "sequence":
        n = (mask.sum(dim=1) > 0).sum().float()
        local, total = n.clamp_min(1.0), all_sum(n).clamp_min(1.0)
    elif aggregation == "fixed":
        width = torch.tensor(float(max_len or mask.shape[1]))
        if not max_len:              # the padded length of the whole batch
            width = _all_max(width)
        local = torch.tensor(float(mask.shape[0] * (max_len or mask.shape[1])))
        total = all_sum(torch.tensor(float(mask.shape[0]))) * width
    else:
        return weights
    return weights * (local / total).to(weights.dtype)


def _all_max(t: torch.Tensor) -> torch.Tensor:
    t = t.to("cuda" if dist.get_backend() == "nccl" else "cpu", copy=True)   # NCCL reduces on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def all_reduce_grads(params: list) -> None:
    """Sum the gradients of `params` over ranks, in one flat all-reduce (a missing
    gradient counts as zeros, so every rank sends the same layout)."""
    if not active() or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])
    dist.all_reduce(flat)
    at = 0
    for p in params:
        n = p.numel()
        p.grad = flat[at:at + n].view_as(p).to(p.dtype)
        at += n


def sum_stats(stats: dict) -> dict:
    """Per-rank sums of a step's statistics (each already divided by the global count) added up."""
    if not active():
        return stats
    keys = sorted(stats)
    t = all_sum(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, t.tolist()))


# --------------------------------------------------------------------------- logging and state
def gather(obj) -> list:
    """Every rank's `obj` (a list in rank order); [obj] in one process."""
    if not active():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def merge_metrics(metrics: dict) -> dict:
    """One metrics.jsonl record from every rank's: counts summed, wall times maximal,
    dictionaries (served_by) added, per-group lists (pool_played) joined in rank order (the
    ranks' shares of the groups in order), other numbers averaged (equal shares of the batch)."""
    if not active():
        return metrics
    parts = gather(metrics)
    out = dict(parts[0])
    for key, value in parts[0].items():
        values = [p.get(key) for p in parts]
        if isinstance(value, dict):
            total = Counter()
            for v in values:
                total.update(v or {})
            out[key] = dict(total)
        elif key in GROUP_LIST_KEYS:
            out[key] = [x for v in values for x in (v or [])]
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and \
                all(isinstance(v, (int, float)) for v in values):
            if all(v == values[0] for v in values) and key not in SUM_KEYS:
                out[key] = values[0]       # the same on every rank (step, the update's statistics)
            elif key in SUM_KEYS:
                out[key] = sum(values)
            elif key in MAX_KEYS or key.endswith("_max_s"):
                out[key] = max(values)
            else:
                out[key] = sum(values) / len(values)
    return out


def decorrelate(partner, seed: int = 0) -> None:
    """Give ranks > 0 their own stream of the partner's draws (VS replies, personas, pool
    members), so that N ranks do not repeat one rank's draws on their N shares. An
    Ensemble keeps the shared stream: its rotation is by global group number, as in one
    process."""
    from .simulators import Ensemble

    if active() and rank() > 0 and hasattr(partner, "rng") and not isinstance(partner, Ensemble):
        partner.rng.seed(1_000_003 * (seed + 1) + rank())
