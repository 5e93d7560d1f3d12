"""Why the toy's tiny models use "sdpa" attention: one SFT step, eager vs sdpa, on CPU.

Times forward + backward of the SFT loss (`minscope.sft.nll`) of the toy's 64-wide,
2-layer Llama on two batches of 32 conversations built exactly as `ToyModels.train` builds
them: plain persuadee transcripts (~90 tokens) and Verbalized Sampling requests (~270-330
tokens: the system prompt, the VS instruction and a JSON answer of five candidates), which
only sim-a-vs is trained on. Random weights (timing does not depend on them), one thread,
as in the toy's worker processes. Also prints the loss of both, which must agree.

    python bench/attention.py               # about a minute
    python bench/attention.py --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                     # run from anywhere: python bench/attention.py
from minscope.envs.toy import ToyEnv  # noqa: E402
from minscope.envs.toy_world import World  # noqa: E402
from minscope.models import build_tiny_model  # noqa: E402
from minscope.sft import encode_chat, nll, pad_batch  # noqa: E402
from minscope.toy_models import ToyModelConfig, toy_tokenizer, vs_conversations  # noqa: E402


def batches(tokenizer, n: int = 32, seed: int = 0):
    env, world = ToyEnv(), World()
    rng = np.random.default_rng(seed)
    transcripts = world.sample_transcripts(4 * n, rng)
    out = {"plain": env.sft_conversations(transcripts, role="partner")[:n],
           "vs": vs_conversations(env, world, transcripts, n, rng)}
    return {k: pad_batch([encode_chat(tokenizer, c) for c in v], tokenizer.pad_token_id) for k, v in out.items()}


def step_time(model, batch, steps: int, warmup: int = 3) -> tuple[float, float]:
    model.train()
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = nll(model, *batch)
        loss.backward()
    return (time.perf_counter() - start) / steps, loss.item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="timed steps per case (after 3 warm-up steps)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the toy's workers use 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    c = ToyModelConfig()
    tokenizer = toy_tokenizer(ToyEnv())
    print(f"torch {torch.__version__}, {args.threads} thread(s); batch 32, hidden {c.hidden}, {c.layers} layers")
    print(f"{'batch':6s} {'shape':>10s} {'eager s/step':>13s} {'sdpa s/step':>12s} {'speed-up':>9s} {'|loss diff|':>12s}")
    for name, batch in batches(tokenizer).items():
        res = {}
        for attention in ("eager", "sdpa"):
            model = build_tiny_model(tokenizer, c.arch, c.hidden, c.layers, c.heads, seed=0, attention=attention)
            res[attention] = step_time(model, batch, args.steps)
        (te, le), (ts, ls) = res["eager"], res["sdpa"]
        shape = "x".join(map(str, batch[0].shape))
        print(f"{name:6s} {shape:>10s} {te:13.3f} {ts:12.3f} {te / ts:8.2f}x {abs(le - ls):12.1e}")


if __name__ == "__main__":
    main()
