"""`torchrun --nproc_per_node 2 train.py` (gloo, CPU): two ranks play one rollout group each,
sum the LoRA gradients, and rank 0 alone writes the run folder; the first update equals a
one-process run's with the same total batch up to the order of floating-point sums."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train as train_cli
from minscope.envs.wordgame import WordGame
from minscope.files import load_state
from minscope.models import build_tiny_model, build_tokenizer
from minscope.sft import sft

ROOT = Path(__file__).resolve().parent.parent
LR = 1e-3
# two groups of four: one-process rollout chunks of one group, as each rank's share
RUN = ["--env", "wordgame", "--method", "single", "--groups", "2", "--group-size", "4", "--steps", "2",
       "--eval-every", "1", "--max-new-tokens", "4", "--rollout-batch", "4", "--lr", str(LR)]
TOLERANCE = 1e-6     # on adapter weights whose first AdamW step moves each by about LR = 1e-3


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A tiny Qwen3 SFT'd to answer the word game with a random word: rewards vary within
    groups (about 1 in 4 answers is right), so the first update is not zero."""
    env = WordGame()
    tok = build_tokenizer(env.corpus() + ["hello there"], vocab_size=300)
    torch.manual_seed(0)
    model = build_tiny_model(tok, "qwen3", hidden_size=32, num_layers=2)
    sft(model, tok, env.sft_conversations(), steps=120, batch_size=16, lr=3e-3, progress=False)
    path = tmp_path_factory.mktemp("wordgame") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def records(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def adapter(run: Path, step: int) -> dict:
    return load_file(str(next((run / f"policy-step{step}").rglob("adapter_model.safetensors"))))


def test_two_ranks_take_the_one_process_first_update_and_rank_0_alone_writes(word_model, tmp_path):
    train_cli.main([*RUN, "--policy", word_model, "--runs-dir", str(tmp_path / "one"), "--name", "run"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "train.py", *RUN, "--policy", word_model, "--runs-dir", str(tmp_path / "two"),
                           "--name", "run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done: ") == 1 and "2 processes (torchrun)" in done.stdout   # rank 0 speaks
    one, two = tmp_path / "one" / "run", tmp_path / "two" / "run"

    # rank 0 alone writes: the same files as one process, each record once
    # (the in-process run's lock file goes when this process exits; torchrun's ranks have)
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir() if p.name != "lock")
    assert [p.name for p in (tmp_path / "two").iterdir()] == ["run"]
    r1, r2 = records(one), records(two)
    assert [(r["kind"], r["step"]) for r in r2] == [(r["kind"], r["step"]) for r in r1]

    # the first step: the same episodes (each rank played one of the two groups) ...
    s1, s2 = (next(r for r in rs if r["kind"] == "train" and r["step"] == 0) for rs in (r1, r2))
    for key in ("train_reward", "zero_var_frac", "tokens_prefilled", "tokens_generated", "served_by"):
        assert s2[key] == s1[key], key
    assert s1["grad_norm"] > 0.01                        # a real update, not a zero one
    assert s2["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-5)
    # ... and the same update: every adapter weight within TOLERANCE of the one-process run's
    a1, a2 = adapter(one, 1), adapter(two, 1)
    assert a1.keys() == a2.keys()
    moved = max(float(v.abs().max()) for k, v in a1.items() if "lora_B" in k)
    assert moved == pytest.approx(LR, rel=1e-3)          # B starts at 0; one AdamW step moves it by lr
    assert max(float((a1[k] - a2[k]).abs().max()) for k in a1) <= TOLERANCE

    # the state holds every rank's random streams, and a resume must use the same N
    state = load_state(two / "state.pt")
    assert state["step"] == 1 and state["world_size"] == 2 and len(state["ranks"]) == 2
    with pytest.raises(SystemExit, match=r"saved by 2 process\(es\), this job has 1.*--nproc_per_node 2"):
        train_cli.main(["--env", "wordgame", "--resume", str(two), "--steps", "3"])


def test_torchrun_refuses_the_toy_and_groups_it_cannot_split(monkeypatch, tmp_path, word_model):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="torchrun is for real environments"):
        train_cli.main(["--quick", "--runs-dir", str(tmp_path)])
    monkeypatch.setattr("minscope.distributed.setup", lambda: (0, 2))
    with pytest.raises(SystemExit, match="--groups 3 cannot be split evenly over 2 processes"):
        train_cli.main([*RUN, "--groups", "3", "--policy", word_model, "--runs-dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())                  # refused before anything was written


def test_merged_metrics_join_the_ranks_per_group_lists_in_rank_order(monkeypatch):
    from minscope import distributed

    ranks = [{"step": 3, "pool_played": [0, 4], "served_by": {"pool0": 1, "pool1": 1}, "group_std": [0.1, 0.2, 0.3],
              "tokens_generated": 10},
             {"step": 3, "pool_played": [4, 4], "served_by": {"pool1": 2}, "group_std": [0.0, 0.2, 0.4],
              "tokens_generated": 12}]
    monkeypatch.setattr(distributed, "active", lambda: True)
    monkeypatch.setattr(distributed, "gather", lambda metrics: ranks)
    out = distributed.merge_metrics(ranks[0])
    assert out["pool_played"] == [0, 4, 4, 4] and out["served_by"] == {"pool0": 1, "pool1": 3}
    assert out["tokens_generated"] == 22 and out["step"] == 3
