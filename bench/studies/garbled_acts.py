"""How the training simulator and the real users answer a garbled act.

    python bench/studies/garbled_acts.py [--cache-dir .cache/minscope] [--n 64]

RL (Single)'s policy ends up prefixing its asks with stray tokens ("Answould you give 1
dollar?", from its last evaluations' transcripts). The real users match acts exactly, so such
an utterance is an invalid act to them; sim-a is a tiny LM, and this prints what it answers:
its three most frequent replies (n per persona, the four personas pooled, at the temperature
the frozen arms sample it, 1/gamma) next to the real users' exact distribution.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from minscope.diversity import exact_replies, sampled_replies  # noqa: E402
from minscope.toy_setup import Toy, ToyConfig  # noqa: E402

OPEN = ("what matters to you?", "hmm hard to say")
PLEDGED = OPEN + ("would you give 1 dollar?", "sure i give 1 dollar")
CASES = [OPEN + ("would you give 1 dollar?",), OPEN + ("Answould you give 1 dollar?",),
         OPEN + ("prowould you give 1 dollar?",), OPEN + ("ushingwould you give 1 dollar?",),
         PLEDGED + ("would you give 2 dollars?",), PLEDGED + ("ushingwould you give 2 dollars?",)]


def pooled(table: dict, history: tuple) -> Counter:
    out = Counter()
    rows = [d for (_, h), d in table.items() if h == history]
    for d in rows:
        for reply, p in d.items():
            out[reply] += p / len(rows)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=".cache/minscope")
    p.add_argument("--n", type=int, default=64)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    toy = Toy(ToyConfig(), a.cache_dir, log=lambda *x: None, progress=False)
    sim = sampled_replies(toy.frozen["sim-a"], toy.world, CASES, a.n)
    real = exact_replies(toy.world.reply_dist, toy.world, CASES)
    print("| the policy's last utterance | sim-a's top replies | the real users' top replies |\n|---|---|---|")
    for h in CASES:
        top = lambda c: ", ".join(f"{r} {v:.2f}" for r, v in c.most_common(2))   # noqa: E731
        print(f"| \"{h[-1]}\"{' (after a pledge)' if len(h) == 5 else ''} | {top(pooled(sim, h))} | "
              f"{top(pooled(real, h))} |")


if __name__ == "__main__":
    main()
