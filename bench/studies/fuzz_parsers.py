"""Fuzz the text parsers that read model output: they must never raise, and must stay fast.

Model output is arbitrary text (early RL policies and small simulators write anything), and
every generation goes through one of these parsers during a rollout:

  toolcalls     minscope.toolcalls.parse_tool_calls       (tau2 agent turns)
  donation      minscope.envs.p4g_parse.parse_donation    (P4G persuadee turns)
  vs            minscope.verbalized_parse.parse_candidates (Verbalized Sampling answers)
  vs_fallback   minscope.verbalized.fallback              (when a VS answer cannot be read)

For each parser the script runs `--count` seeded inputs: realistic outputs, each mutated a
few times (characters inserted, deleted, duplicated, replaced by tags, brackets, digits,
quotes and the Unicode letters that case-fold to ASCII ones, such as the long s), and
short adversarial shapes (one token repeated). It counts exceptions (must be 0), outputs
of the wrong type, and inputs that ran over `--max-seconds`.

Then it times long adversarial inputs (one token repeated, e.g. `<tool_call>` or `$1 `) at
`--long-kb` / 4 and `--long-kb` KB and prints the worst seconds per KB of each parser and
the growth from the small to the large size (about 4 when time is linear in the length,
16 when it is quadratic).

    python bench/studies/fuzz_parsers.py             # 20,000 inputs per parser, long inputs up to 1 MB
    python bench/studies/fuzz_parsers.py --count 300 --long-kb 64  # quick check (the test suite runs this)

Exit status 1 when any parser raised, returned the wrong type or ran over the time limit
(on a fuzzed or a long input).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from minscope.envs.p4g_parse import parse_donation  # noqa: E402
from minscope.toolcalls import ParsedTurn, format_tool_call, parse_tool_calls  # noqa: E402
from minscope.verbalized import fallback, format_candidates  # noqa: E402
from minscope.verbalized_parse import Candidate, parse_candidates  # noqa: E402

# ----------------------------------------------------------------------- realistic outputs
TOOL_SEEDS = [
    format_tool_call("get_user_details", {"user_id": "sara_doe_496"}),
    "Let me look that up.\n" + format_tool_call("find_user_id_by_email", {"email": "a@b.com"}),
    format_tool_call("get_order", {"order_id": "#W123"}) + "\n" + format_tool_call("cancel", {"ids": [1, 2.5, None]}),
    '<tool_call>\n```json\n{"name": "list_items", "arguments": {}}\n```\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}',
    '<tool_call>{"type": "function", "function": {"name": "f", "parameters": {"k": true}}}</tool_call>',
    "<tool_call>{'name': 'update', 'arguments': {'flag': True, 'n': None}}</tool_call>",
    '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": "x"}}]</tool_call>',
    'Sure!</tool_call> <tool_call>{"name": "x" "arguments": {}}</tool_call> done',
]
DONATION_SEEDS = [
    "Okay, I'll donate $1.50 to Save the Children. [DONATE $1.50]",
    "I can't give $2, but I'll give 50 cents.",
    "Would $1 be enough? I think I will give half a dollar.",
    "I won't donate, sorry. I'd rather keep it.",
    "I donated $20 last year. This time I'll do twenty-five cents.",
    "Let's go with $1 of my $2. [GIVE $1]",
    "I will give six dollars! Actually make it all of it.",
    "I'll keep my full $2. Maybe I'll pledge 0.50 cents?",
    "[donate: $ 0.25 cents] ok",
    "I can contribute 1$ or 2 dollars, let's say .75 usd.",
]
VS_SEEDS = [
    format_candidates([Candidate("Sure, I can help.", 0.4), Candidate("Not now, thanks.", 0.35),
                       Candidate("Why should I?", None)]),
    '```json\n{"responses": [{"text": "Hi there", "probability": 0.5}, {"text": "Hello", "probability": "30%"}]}\n```',
    "<response><text>I'll think about it</text><probability>0.6</probability></response>\n"
    "<response><text>No.</text><probability>40</probability></response>",
    "Here are options: [{'text': 'ok', 'prob': .2}, {reply: \"maybe\", p: 1,}] thanks",
    '{"candidates": [{"response": "a \\"quoted\\" reply", "confidence": 0.9}, {"text": "cut off',
    '["just one reply", "and another"]',
    '{"responses": [{"text": "x", "probability": NaN}, {"text": "y", "probability": 1e999}]}',
]

# Tokens inserted by mutations and repeated by the adversarial shapes.
TOKENS = ["<tool_call>", "</tool_call>", "<response>", "</response>", "<text>", "</text>",
          "<probability>", "</probability>", "{", "}", "[", "]", '"', "'", ":", ",", "\\", "```",
          "```json", "$", "$1 ", "1", "0.5", "9" * 50, " ", "\n", "?", ".", "give ", "donate ",
          "I will give ", "can't give ", "not ", "of my ", "cents", "dollars", "[DONATE ",
          "[give:", "six", "twenty", "half a", "True", "None", "NaN", "1e999", "%",
          '"name"', '"arguments"', '"text"', '"probability"', "responses"]
FOLDS = {"s": "\u017f", "S": "\u017f", "i": "\u0130\u0131", "I": "\u0130\u0131", "k": "\u212a", "K": "\u212a"}
ODD_CHARS = ["\u017f", "\u0130", "\u0131", "\u212a", "\u2019", "\u0663", "\x00", "\ud800",
             "\u00a0", "\u2028", "\u00e9", "\U0001f600", "\ufeff", "\r"]


def mutate(text: str, rng: random.Random) -> str:
    """A few random edits of a realistic output."""
    for _ in range(rng.randint(1, 6)):
        i = rng.randint(0, len(text))
        op = rng.random()
        if op < 0.25:
            text = text[:i] + rng.choice(TOKENS) + text[i:]
        elif op < 0.4:
            text = text[:i] + rng.choice(ODD_CHARS) + text[i:]
        elif op < 0.55:
            text = text[:i] + text[i + rng.randint(1, 8):]
        elif op < 0.7:
            j = rng.randint(i, min(len(text), i + 40))
            text = text[:j] + text[i:j] * rng.randint(1, 4) + text[j:]
        elif op < 0.8:
            text = text[:i]                                     # generation cut off
        elif op < 0.85:
            text = text[:i] + chr(rng.randint(32, 0x2FF)) + text[i:]
        elif op < 0.9:                                          # letters that case-fold to ASCII
            text = "".join(rng.choice(FOLDS[c]) if c in FOLDS and rng.random() < 0.5 else c for c in text)
        else:
            j = rng.randint(i, len(text))
            text = text[:i] + text[i:j].swapcase() + text[j:]
    return text


def short_shape(seeds: list[str], rng: random.Random) -> str:
    """An adversarial input: the start of a realistic output, then tokens repeated; mostly a
    few hundred characters, sometimes several thousand (e.g. a number longer than Python's
    4,300-digit int limit)."""
    most = 30 if rng.random() < 0.9 else 300
    head = rng.choice(seeds)[:rng.randint(0, 40)] if rng.random() < 0.5 else ""
    return head + "".join(rng.choice(TOKENS) * rng.randint(1, most) for _ in range(rng.randint(1, 4)))


def fuzz_inputs(seeds: list[str], count: int, rng: random.Random):
    for k in range(count):
        if k % 5 == 4:
            yield short_shape(seeds, rng)
        else:
            yield mutate(rng.choice(seeds), rng)


# --------------------------------------------------------------------- long adversarial shapes
def repeat(unit: str, size: int, prefix: str = "", suffix: str = "") -> str:
    return prefix + unit * max(1, (size - len(prefix) - len(suffix)) // len(unit)) + suffix


LONG_SHAPES = {
    "toolcalls": {
        "open tags": lambda n: repeat("<tool_call>", n),
        "open tags and text": lambda n: repeat("<tool_call>x ", n),
        "close tags": lambda n: repeat("</tool_call>", n),
        "digits in a call": lambda n: repeat("1", n, "<tool_call>"),
        "fence and spaces": lambda n: repeat(" ", n, "<tool_call>```", "x"),
        "python list": lambda n: repeat("{'name': 'a', 'arguments': {'k': (1, 2)}}, ", n, "<tool_call>["),
        "json list": lambda n: repeat('{"name": "a", "arguments": {}}, ', n, "<tool_call>[", "]"),
        "open brackets": lambda n: repeat("[", n, "<tool_call>"),
        "string": lambda n: repeat("a", n, '<tool_call>{"name": "'),
    },
    "donation": {
        "digits after give": lambda n: repeat("1", n, "I will give "),
        "digits and spaces": lambda n: repeat("1 ", n, "I will give "),
        "many $1": lambda n: repeat("$1 ", n, "I will give "),
        "negations": lambda n: repeat("can't give $1 ", n),
        "of my": lambda n: repeat("of my $2 ", n, "I will give "),
        "sentences": lambda n: repeat("I'll give $1. ", n),
        "tag and spaces": lambda n: repeat(" ", n, "[donate", "x"),
        "word numbers": lambda n: repeat("twenty five dollars ", n, "I will give "),
        "questions": lambda n: repeat("Would you give $1? ", n),
        "whitespace": lambda n: repeat(" ", n, "I will give of", "$2"),
    },
    "vs": {
        "open tags": lambda n: repeat("<response>", n),
        "text tags": lambda n: repeat("<text>", n, "<response>"),
        "brackets then string": lambda n: repeat("a", n, "[" * 64 + '"'),
        "brackets then numbers": lambda n: repeat("1,", n, "[" * 64),
        "open braces": lambda n: repeat("{", n),
        "quotes": lambda n: repeat('"a', n, '{"text": '),
        "list of objects": lambda n: repeat('{"text": "x", "probability": 0.1}, ', n, '{"responses": ['),
        "probability tags": lambda n: repeat("<probability>", n),
    },
}
LONG_SHAPES["vs_fallback"] = dict(LONG_SHAPES["vs"])
LONG_SHAPES["vs_fallback"]["text field"] = lambda n: repeat("\\a", n, '"text": "')

PARSERS = {
    "toolcalls": (parse_tool_calls, TOOL_SEEDS, lambda out: isinstance(out, ParsedTurn)),
    "donation": (parse_donation, DONATION_SEEDS,
                 lambda out: out is None or (isinstance(out, float) and 0.0 <= out <= 2.0)),
    "vs": (parse_candidates, VS_SEEDS,
           lambda out: isinstance(out, list) and all(isinstance(c, Candidate) for c in out)),
    "vs_fallback": (fallback, VS_SEEDS, lambda out: isinstance(out, str)),
}


# ------------------------------------------------------------------------------- running
class _TimeLimit(Exception):
    pass


def _alarm(signum, frame):
    raise _TimeLimit()


def run_one(parse, text: str, limit: float):
    """(output, seconds, error) of one call, stopped after `limit` seconds (regex matching
    and Python code check for signals; a C-level JSON decode finishes first)."""
    signal.setitimer(signal.ITIMER_REAL, limit)
    start = time.perf_counter()
    try:
        out, error = parse(text), None
    except _TimeLimit:
        out, error = None, "timeout"
    except Exception as e:   # noqa: BLE001 - counting every exception is the point
        out, error = None, e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return out, time.perf_counter() - start, error


def fuzz(name: str, count: int, seed: int, limit: float) -> dict:
    parse, seeds, well_formed = PARSERS[name]
    rng = random.Random(f"{seed}:{name}")
    errors, bad, timeouts, examples = 0, 0, 0, {}
    for text in fuzz_inputs(seeds, count, rng):
        out, _, error = run_one(parse, text, limit)
        if error == "timeout":
            timeouts += 1
            examples.setdefault("timeout", text)
        elif error is not None:
            errors += 1
            examples.setdefault(type(error).__name__, text)
        elif not well_formed(out):
            bad += 1
            examples.setdefault("bad output", text)
    return {"exceptions": errors, "bad_outputs": bad, "timeouts": timeouts, "examples": examples}


def long_inputs(name: str, long_kb: int, limit: float) -> dict:
    parse = PARSERS[name][0]
    worst = {"s_per_kb": 0.0, "shape": None, "growth": None, "failures": 0}
    failures = 0
    for shape, build in LONG_SHAPES[name].items():
        times = []
        for kb in (max(1, long_kb // 4), long_kb):
            text = build(kb * 1024)
            _, seconds, error = run_one(parse, text, limit)
            if error is not None:
                failures += 1
                print(f"  {name} / {shape} at {kb} KB: "
                      f"{'over the time limit' if error == 'timeout' else repr(error)[:120]}")
                seconds = float("inf") if error == "timeout" else seconds
            times.append((seconds, len(text) / 1024))
        (t_small, kb_small), (t_big, kb_big) = times
        per_kb = t_big / kb_big
        if per_kb >= worst["s_per_kb"]:
            growth = t_big / max(t_small, 1e-4)
            worst = {"s_per_kb": per_kb, "shape": shape, "growth": growth,
                     "seconds": t_big, "kb": kb_big}
    worst["failures"] = failures
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=20_000, help="fuzzed inputs per parser (20,000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-kb", type=int, default=1024,
                    help="size of the long adversarial inputs in KB (also timed at a quarter of it)")
    ap.add_argument("--max-seconds", type=float, default=10.0,
                    help="an input that takes longer counts as a failure (timeout)")
    ap.add_argument("--parsers", nargs="+", default=list(PARSERS), choices=list(PARSERS))
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGALRM, _alarm)
    results, failed = {}, False
    print(f"{'parser':12s} {'inputs':>7s} {'exceptions':>10s} {'bad':>5s} {'timeouts':>8s}   "
          f"worst s/KB at {args.long_kb} KB (shape, growth x4 size)")
    for name in args.parsers:
        r = fuzz(name, args.count, args.seed, args.max_seconds)
        r["long"] = long_inputs(name, args.long_kb, args.max_seconds)
        results[name] = r
        failed |= bool(r["exceptions"] or r["bad_outputs"] or r["timeouts"] or r["long"]["failures"])
        w = r["long"]
        print(f"{name:12s} {args.count:7d} {r['exceptions']:10d} {r['bad_outputs']:5d} {r['timeouts']:8d}   "
              f"{w['s_per_kb']:.2e} ({w['shape']}, x{w['growth']:.1f}); "
              f"{w['failures']} long inputs failed", flush=True)
        for kind, text in r["examples"].items():
            print(f"    e.g. {kind}: {text[:100]!r}{' ...' if len(text) > 100 else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("exceptions: " + ", ".join(f"{n} {r['exceptions']}" for n, r in results.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
