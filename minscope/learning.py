"""Does GRPO make a real model better? A before/after check on a scripted-partner task.

The policy's success rate is measured on a fixed evaluation batch (every request of the
task, `per_task` episodes each, sampled on a fixed random stream so that the same adapter
always gives the same rate), then the policy takes `steps` GRPO updates against the
environment's own scripted partner (`Environment.scripted_partner`), then the rate is
measured again on the same batch. Used by tests/test_learning_smollm2.py (the CI check that
SmolLM2 learns `numbers`), bench/learning_rate.py (the learning-rate sweep) and notebook 06.
"""

from __future__ import annotations

import math
import time

import torch

from .adapters import adapter_state, load_adapter_state
from .loop import run_loop
from .methods import build_method, train_step
from .rollout import LMSpeaker, rollout
from .trainer import UpdateConfig


def success_rate(policy: LMSpeaker, env, tasks, per_task: int, seed: int = 1234) -> tuple[float, list]:
    """Mean reward over `per_task` episodes of each task, sampled on random stream `seed`
    (the caller's stream is left as it was). Returns (rate, episodes)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        episodes = rollout(env, list(tasks), policy, env.scripted_partner(), group_size=per_task)
    finally:
        torch.set_rng_state(state)
    return sum(e.reward for e in episodes) / len(episodes), episodes


def standard_error(rate: float, n: int) -> float:
    """Binomial standard error of a rate measured on n episodes (at least that of 1 in n, so
    that a rate of 0 or 1 does not claim certainty)."""
    p = min(max(rate, 1 / n), 1 - 1 / n)
    return math.sqrt(p * (1 - p) / n)


def train(policy: LMSpeaker, env, steps: int, lr: float, seed: int, groups: int = 2, group_size: int = 8,
          beta: float = 0.005, micro_batch: int = 16, log=None) -> list[float]:
    """`steps` GRPO updates of `policy`'s adapter (a fresh AdamW) against the environment's
    scripted partner, `groups` requests a step drawn on stream `seed`; returns the training
    reward of every step. `log(step, metrics)` is called after each step."""
    cfg = UpdateConfig(lr=lr, epochs=1, micro_batch=micro_batch, temperature=policy.temperature, beta=beta)
    method = build_method("single", policy, [env.scripted_partner()], cfg)
    tasks = env.tasks("train")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rewards = []

    def one_step(step):
        batch = [tasks[i] for i in torch.randperm(len(tasks), generator=gen)[:groups].tolist()]
        t0 = time.perf_counter()
        metrics = train_step(method, env, batch, group_size, step, seed=seed * 100_003 + step)
        metrics.pop("_episodes")
        metrics["seconds"] = time.perf_counter() - t0
        rewards.append(metrics["train_reward"])
        if log is not None:
            log(step, metrics)
        return metrics
    # the one training loop (loop.run_loop), with nothing to evaluate, save or write
    run_loop(steps, steps + 1, one_step, evaluate=lambda step: None, log=lambda rec: None, progress=False)
    return rewards


def reset(policy: LMSpeaker, state: dict) -> None:
    """Put the policy's adapter back to `state` (from `adapters.adapter_state`)."""
    load_adapter_state(policy.model, policy.adapter, state)


def snapshot(policy: LMSpeaker) -> dict:
    """A copy of the policy's adapter weights, for `reset`."""
    return adapter_state(policy.model, policy.adapter)
