"""How often does parse_donation read, from a persuadee's messages, the donation they made?

For every human Persuasion for Good dialogue, the persuadee's messages are read with
`minscope.envs.p4g_parse.episode_donation` (the same call the environment's reward uses: the
persuadee's sentences that echo the persuader's messages are dropped, the rest is joined and
read by `parse_donation`),
then compared with the donation the persuadee actually made after the chat (B6 of the
persuadee row). Humans saw no tag rule, so this checks only the plain-language fallback.

It is a measurement of the parser, not a target: people sometimes pledge one amount and
pay another, and many never name an amount in the chat. Where 300_info.xlsx (the
annotated subset) lies next to the data, the parser is also compared with the intended
donation annotators read from each dialogue (B5), and B5 with B6, which shows how much of
the gap to B6 is people rather than the parser.

    python bench/p4g_parser_agreement.py --data PATH   # CSV release or ConvoKit corpus folder
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minscope.envs.base import Episode, Turn  # noqa: E402
from minscope.envs.p4g_parse import MAX_DONATION, episode_donation, parse_donation  # noqa: E402
from minscope.envs.p4g_data import DataError, P4GDataNotFound, load_p4g  # noqa: E402


def read_xlsx_rows(path: Path) -> list[dict]:
    """Rows of the first sheet of a simple .xlsx (inline or shared strings) as dicts keyed
    by the header row; enough for 300_info.xlsx without a spreadsheet library."""
    ns = {"x": "http://schemas.openxmlformats.org/spreadsheetml/2006/main"}
    with zipfile.ZipFile(path) as z:
        shared = []
        if "xl/sharedStrings.xml" in z.namelist():
            shared = ["".join(t.text or "" for t in si.iter(f"{{{ns['x']}}}t"))
                      for si in ET.fromstring(z.read("xl/sharedStrings.xml")).findall("x:si", ns)]
        sheet = ET.fromstring(z.read("xl/worksheets/sheet1.xml"))
    table = []
    for row in sheet.iter(f"{{{ns['x']}}}row"):
        cells = {}
        for c in row.findall("x:c", ns):
            column = re.match(r"[A-Z]+", c.get("r"))[0]
            if c.get("t") == "inlineStr":
                cells[column] = "".join(t.text or "" for t in c.iter(f"{{{ns['x']}}}t"))
            elif c.get("t") == "s":
                cells[column] = shared[int(c.find("x:v", ns).text)]
            else:
                v = c.find("x:v", ns)
                cells[column] = "" if v is None else v.text
        table.append(cells)
    header = table[0]
    return [{header[k]: v for k, v in r.items() if k in header} for r in table[1:]]


def intended_donations(path: Path) -> dict[str, float | None]:
    """Dialogue id -> the persuadee's intended donation B5 as annotated by people who read
    the dialogue (None where the annotation is empty), from 300_info.xlsx."""
    out = {}
    for r in read_xlsx_rows(path):
        if str(r.get("B4", "")).strip() in ("1", "1.0"):
            b5 = str(r.get("B5", "") or "").strip()
            out[r["B2"]] = float(b5) if b5 else None
    return out


def dialogue_donation(d) -> float | None:
    """The donation the environment's reward reads from a human dialogue."""
    roles = {"persuader": "agent", "persuadee": "partner"}
    turns = [Turn(roles[role], text) for role, text in d.messages if role in roles]
    return episode_donation(Episode(task=d.id, group=0, turns=turns))


def last_amount_message(persuadee_messages: list[str]) -> str:
    """The persuadee message that stated the amount which counted (the last one that states any)."""
    for text in reversed(persuadee_messages):
        if parse_donation(text) is not None:
            return text
    return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "p4g"),
                    help="folder with full_dialog.csv + full_info.csv, or a ConvoKit corpus folder")
    ap.add_argument("--annotated", default=None,
                    help="300_info.xlsx with the annotated intended donation B5 "
                         "(default: next to the data, if there)")
    ap.add_argument("--examples", type=int, default=8, help="misses to print per kind")
    ap.add_argument("--seed", type=int, default=0, help="which misses are printed")
    args = ap.parse_args()
    try:
        corpus = load_p4g(args.data)
    except (P4GDataNotFound, DataError) as e:
        sys.exit(f"error: {e}")

    agree, disagree, none_stated, unknown = [], [], [], 0
    for d in corpus.dialogues:
        if d.donation is None:      # recorded donation missing or over $2 (a data error)
            unknown += 1
            continue
        said = [text for role, text in d.messages if role == "persuadee"]
        parsed = dialogue_donation(d)
        row = (d, parsed, said)
        if parsed is None:
            none_stated.append(row)
        elif abs(parsed - d.donation) < 0.005:
            agree.append(row)
        else:
            disagree.append(row)

    n = len(agree) + len(disagree) + len(none_stated)
    stated = len(agree) + len(disagree)
    # What the environment's reward would see: no amount stated counts as $0.
    reward_agree = len(agree) + sum(d.donation == 0 for d, _, _ in none_stated)
    over = sum(p > d.donation for d, p, _ in disagree)
    print(f"data: {args.data}")
    print(f"dialogues kept: {len(corpus.dialogues)} (dropped BAD_: {corpus.dropped_bad}); "
          f"recorded donation unknown or over $2: {unknown}; evaluated: {n}")
    print(f"agree: {len(agree)} ({len(agree) / n:.1%})  disagree: {len(disagree)} "
          f"({len(disagree) / n:.1%})  no amount stated: {len(none_stated)} ({len(none_stated) / n:.1%})")
    print(f"agreement where an amount was stated: {len(agree)}/{stated} = {len(agree) / max(stated, 1):.1%}")
    print(f"  of the disagreements, parsed > recorded: {over}, parsed < recorded: {len(disagree) - over}")
    print(f"no amount stated and recorded $0: {sum(d.donation == 0 for d, _, _ in none_stated)}, "
          f"recorded > $0: {sum(d.donation > 0 for d, _, _ in none_stated)}")
    print(f"reward-level agreement (no amount = $0, as in the environment): "
          f"{reward_agree}/{n} = {reward_agree / n:.1%}")

    annotated = Path(args.annotated) if args.annotated else Path(args.data) / "300_info.xlsx"
    if annotated.is_file():
        compare_with_intended(corpus, intended_donations(annotated))

    rng = random.Random(args.seed)
    print("\n== disagreements (recorded vs parsed; the persuadee message that counted)")
    for d, parsed, said in rng.sample(disagree, min(args.examples, len(disagree))):
        print(f"- {d.id}: recorded ${d.donation:g}, parsed ${parsed:g}: {last_amount_message(said)[:240]!r}")
    print("\n== no amount stated but recorded > $0 (the persuadee's last two messages)")
    gave = [r for r in none_stated if r[0].donation > 0]
    for d, _, said in rng.sample(gave, min(args.examples, len(gave))):
        print(f"- {d.id}: recorded ${d.donation:g}: {' | '.join(said[-2:])[:240]!r}")


def compare_with_intended(corpus, intended: dict) -> None:
    """The parser against what annotators read as the intended donation (B5, capped at $2
    like the parser; annotators also recorded pledges such as $10), and B5 against the
    donation made (B6): how much of the B6 gap is people, not the parser."""
    rows = [(d, None if intended[d.id] is None else min(intended[d.id], MAX_DONATION))
            for d in corpus.dialogues if d.id in intended]
    with_b5 = [(d, b5) for d, b5 in rows if b5 is not None]
    same = lambda a, b: a is not None and b is not None and abs(a - b) < 0.005  # noqa: E731
    parsed = {d.id: dialogue_donation(d) for d, _ in rows}
    print(f"\nannotated dialogues (300_info.xlsx): {len(rows)}; with an intended donation B5: {len(with_b5)}")
    hits = sum(same(parsed[d.id], b5) for d, b5 in with_b5)
    read = sum(parsed[d.id] is not None for d, _ in with_b5)
    print(f"  parser == B5: {hits}/{len(with_b5)} = {hits / max(len(with_b5), 1):.1%}; "
          f"where the parser read an amount: {hits}/{read} = {hits / max(read, 1):.1%}")
    print(f"  B5 empty and parser reads none: {sum(b5 is None and parsed[d.id] is None for d, b5 in rows)}/"
          f"{sum(b5 is None for _, b5 in rows)}")
    known = [(d, b5) for d, b5 in with_b5 if d.donation is not None]
    kept = sum(same(b5, d.donation) for d, b5 in known)
    print(f"  B5 == B6 (annotated intent == donation made, B5 capped at $2): {kept}/{len(known)} "
          f"= {kept / max(len(known), 1):.1%}")


if __name__ == "__main__":
    main()
