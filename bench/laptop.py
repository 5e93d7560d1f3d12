"""The README's laptop-GPU commands, each with its peak GPU memory and its step times.

    python bench/laptop.py [--policy Qwen/Qwen3-0.6B] [--only numbers,p4g-4bit] [--json OUT.json]

Runs each command through train.py in this process (a fresh run folder under --runs-dir), then
prints one line: the peak GPU memory torch allocated (CUDA only) and the median and largest
training-step time from the run's metrics.jsonl. A command that runs out of GPU memory prints
one line naming the flags that lower it, and the next command runs; the exit status is 1 if
any command failed. On the CPU the same commands run (no memory figure): slow, but the same code.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FIXTURE = str(ROOT / "tests" / "fixtures" / "p4g" / "csv")
# the README's "On a laptop GPU" commands, in its order; {policy} is --policy
COMMANDS = {
    "numbers": "--env numbers --policy {policy} --groups 2 --max-new-tokens 12 --steps 8 --eval-every 4",
    "p4g-4bit": ("--env p4g --data " + FIXTURE + " --policy {policy} --simulator {policy} --method population "
                 "--simulator-4bit --p4g-reward expected --groups 2 --group-size 4 --max-turns 2 "
                 "--max-new-tokens 24 --steps 2 --eval-every 100"),
}
LOWER = ("lower --rollout-batch (episodes decoded at once: the rollout's KV cache is the peak), "
         "--group-size or --max-new-tokens, or --micro-batch (the update); --simulator-4bit puts the simulators in NF4")


def measure(key: str, argv: list[str], runs_dir: Path) -> dict:
    """Run train.py with `argv`; its peak memory and step times, or why it failed."""
    import train

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = {"command": key, "argv": argv}
    try:
        train.main([*argv, "--runs-dir", str(runs_dir), "--name", key])
    except torch.OutOfMemoryError as e:
        out["error"] = f"out of GPU memory ({(str(e).splitlines() or [''])[0][:120]}); {LOWER}"
    except SystemExit as e:                     # train.py's one-line refusals
        if e.code not in (None, 0):
            out["error"] = str(e.code)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if cuda:
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    log = runs_dir / key / "metrics.jsonl"
    steps = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    seconds = [r["seconds"] for r in steps if r.get("kind") == "train"]
    if seconds:
        out.update(steps=len(seconds), step_s_median=round(statistics.median(seconds), 2),
                   step_s_max=round(max(seconds), 2))
    return out


def line(rec: dict) -> str:
    parts = [rec["command"]]
    if "peak_gib" in rec:
        parts.append(f"peak {rec['peak_gib']:.2f} GiB")
    if "steps" in rec:
        parts.append(f"step {rec['step_s_median']:.1f} s median, {rec['step_s_max']:.1f} s max ({rec['steps']} steps)")
    parts.append(f"{rec['wall_s']:.0f} s in all")
    if "error" in rec:
        parts.append(f"FAILED: {rec['error']}")
    return ": ".join(parts[:1]) + ": " + ", ".join(parts[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="Qwen/Qwen3-0.6B", help="the model of every command (a hub name or a "
                   "local folder; default Qwen/Qwen3-0.6B, as the README)")
    p.add_argument("--only", help=f"comma-separated commands (default all: {','.join(COMMANDS)})")
    p.add_argument("--runs-dir", help="where the runs go (default: a temporary folder)")
    p.add_argument("--json", help="write the records here")
    args = p.parse_args(argv)
    keys = args.only.split(",") if args.only else list(COMMANDS)
    unknown = [k for k in keys if k not in COMMANDS]
    if unknown:
        p.error(f"--only {','.join(unknown)}: choose from {','.join(COMMANDS)}")
    runs = Path(args.runs_dir or tempfile.mkdtemp(prefix="minscope-laptop-"))
    records = []
    for key in keys:
        rec = measure(key, COMMANDS[key].format(policy=args.policy).split(), runs)
        records.append(rec)
        print(line(rec), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    print("command: " + shlex.join(["python", "bench/laptop.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
