"""Hostile input to the server, the served client, the run lock and the trainer (issue 32,
cases 11-15): each case below failed on the code before it, with a traceback, a crash, a
wrong number or two holders of one lock."""
import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

from minscope import files
from minscope.envs.wordgame import Asker, WordGame
from minscope.methods import build_method
from minscope.models import add_adapters, build_tiny_model
from minscope.rollout import LMSpeaker, rollout
from minscope.trainer import UpdateConfig, grpo_update


# --------------------------------------------------------------------------- 14. the run lock
def _contend(run_dir, barrier, holders, trials):
    """One of several processes: every trial, all try to take a fresh (or stale) lock at once;
    the winners hold it until every process has tried."""
    for t in range(trials):
        folder = os.path.join(run_dir, str(t))
        barrier.wait()
        lock = files.RunLock(folder, warn=lambda msg: None)
        try:
            lock.acquire()
            with holders.get_lock():
                holders[t] += 1
        except SystemExit:
            pass
        barrier.wait()                 # everyone has tried: the holder lets go
        if lock.held:
            lock.release()
        barrier.wait()


def test_at_most_one_of_several_racing_processes_holds_the_lock(tmp_path):
    """4 processes x 100 trials, every other one against a stale lock (a dead pid). Before
    (an empty lock file, the pid written after): two holders in 2-15 of 100 trials."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    procs, trials = 4, 100
    for t in range(trials):
        (tmp_path / str(t)).mkdir()
        if t % 2:
            (tmp_path / str(t) / "lock").write_text(f"{dead.pid}\n")
    ctx = multiprocessing.get_context("fork")
    barrier, holders = ctx.Barrier(procs), ctx.Array("i", trials)
    workers = [ctx.Process(target=_contend, args=(str(tmp_path), barrier, holders, trials))
               for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    twice = sum(h > 1 for h in holders)
    assert twice == 0, f"two or more holders in {twice} of {trials} trials"
    assert list(holders) == [1] * trials                    # and a holder every time
    assert not any((tmp_path / str(t) / "lock").exists() for t in range(trials))


# --------------------------------------------------------------------------- 15. trainer statistics
def test_statistics_average_the_epochs_applied_not_the_skipped_one(tokenizer):
    """Two epochs at lr 0 (the weights never move, so both epochs see the same entropy); the
    first epoch's gradient is made infinite, so it is skipped. The logged entropy is the one
    epoch's entropy. Before: halved (divided by both epochs), enough for a false alarm."""
    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"], init_lora_weights=False)
    policy = LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=3)
    env = WordGame()
    episodes = rollout(env, env.tasks()[:2], policy, Asker(), group_size=2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    one = build_method("single", policy, [Asker()], UpdateConfig(lr=0.0, epochs=1))
    want = grpo_update(model, "policy", one.policy_opt, episodes, "agent", adv, one.policy_cfg,
                       tokenizer.pad_token_id)
    two = build_method("single", policy, [Asker()], UpdateConfig(lr=0.0, epochs=2))
    param = next(p for n, p in model.named_parameters() if "lora_B" in n and "policy" in n)
    calls = []

    def first_infinite(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 1 else grad
    hook = param.register_hook(first_infinite)
    out = grpo_update(model, "policy", two.policy_opt, episodes, "agent", adv, two.policy_cfg,
                      tokenizer.pad_token_id)
    hook.remove()
    assert out["skipped_steps"] == 1 and len(calls) == 2
    assert out["entropy"] > 0 and out["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    assert out["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    assert out["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
