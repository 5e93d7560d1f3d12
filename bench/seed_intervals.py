"""Seed-level intervals re-derived from the per-seed values a results table already shows.

    python bench/seed_intervals.py docs/RESULTS.md "## The default run"
    python bench/seed_intervals.py docs/ARCHIVE.md "### Six seeds"

Reads the first markdown table after the heading that starts with the given text, takes each
row's "per seed" column (values such as `.241 .169 .103`, in seed order), and prints each arm's
mean with its 95% t-interval over seeds (n - 1 degrees of freedom), then each arm minus RL
(Single) and minus Base, paired by seed (minscope.seedstats). The values are the table's,
rounded to 3 decimals, so the intervals can differ from a run's own report in the last digit.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minscope.seedstats import paired, t_interval  # noqa: E402


def read_table(path: str, heading: str) -> dict[str, list[float]]:
    """The table's rows, name -> per-seed values; SystemExit (one line) when the file, the
    heading, its table or the "per seed" column is missing or a value is not a number."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: cannot read it ({e})") from None
    start = next((i for i, line in enumerate(lines) if line.startswith(heading)), None)
    if start is None:
        raise SystemExit(f"{path}: no line starts with {heading!r}")
    rows, header = {}, None
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            if header:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = cells
            if "per seed" not in header:
                raise SystemExit(f"{path}: the table after {heading!r} has no \"per seed\" column")
            col = header.index("per seed")
            continue
        if set(cells[0]) <= set("-: "):
            continue
        try:
            rows[cells[0]] = [float(v) for v in cells[col].split()]
        except (ValueError, IndexError):
            raise SystemExit(f"{path}: row {cells[0]!r} has no per-seed numbers in its \"per seed\" cell") from None
    if header is None:
        raise SystemExit(f"{path}: no table after {heading!r}")
    return rows


def fmt(d) -> str:
    return f"{d['mean']:.3f} ({d['lo']:.3f} to {d['hi']:.3f})" if d["lo"] is not None else f"{d['mean']:.3f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a markdown file (e.g. docs/RESULTS.md)")
    p.add_argument("heading", help="the start of the heading whose first table is read")
    a = p.parse_args(argv)
    path, heading = a.path, a.heading
    rows = read_table(path, heading)
    print("command: " + shlex.join(["python", "bench/seed_intervals.py", *(sys.argv[1:] if argv is None else argv)]),
          flush=True)
    print(f"{path}, table after '{heading}': 95% t-intervals over seeds (n - 1 df)\n")
    print("| method | n | mean (95% t over seeds) |\n|---|---|---|")
    for name, vals in rows.items():
        print(f"| {name} | {len(vals)} | {fmt(t_interval(vals))} |")
    refs = {k: v for k, v in rows.items() if k.startswith(("RL (Single)", "Base"))}
    print("\n| method | against | difference, paired by seed (95% t) | wins | verdict |\n|---|---|---|---|---|")
    for ref_name, ref in refs.items():
        for name, vals in rows.items():
            if name == ref_name or name.startswith("Base"):
                continue
            d = paired(dict(enumerate(vals)), dict(enumerate(ref)))
            print(f"| {name} | {ref_name} | {fmt(d)} | {d['wins']}/{d['n']} | {d['verdict']} |")


if __name__ == "__main__":
    main()
