"""Persuasion for Good data: read the official release, clean the survey, render personas, split.

Two official distributions carry the same 1,017 dialogues and survey answers:

  - the original CSV release (data/FullData of the authors' repository):
      full_dialog.csv  one row per sentence: Unit (text), Turn, B4 (0 persuader,
                       1 persuadee), B2 (dialogue id)
      full_info.csv    two rows per dialogue: B2, B3 (user id), B4 (role), B6 (donation
                       after the task, dollars), B7 (turns), survey answers "<field>.x"
  - a ConvoKit corpus directory ("persuasionforgood-corpus"): utterances.jsonl,
    conversations.json, corpus.json, index.json and speakers.json (users.json in older
    ConvoKit). Speaker meta holds the survey answers, conversation meta the donations,
    utterance meta the speaker's role. Older files say "user"/"root" where newer ones say
    "speaker"/"conversation_id", and a meta block may be stored bare or as
    {"meta": ..., "vectors": ...}; both are read.

`load_p4g(path)` turns either into the same `P4GCorpus`. Data quirks and what we do:

  - 27 dialogue ids start with "BAD_" (the authors' mark for broken sessions, e.g. a
    persuadee pasting unrelated text): these dialogues are dropped entirely. In a ConvoKit
    corpus the original id is read from conversation meta ("dialogue_id" or "B2").
  - 35 persuadee donations exceed the $2 task payment (up to 700): they are data-entry
    errors (50 is more likely cents than dollars), so the donation is set to None
    (unknown) rather than clipped to $2; the raw value stays in `donation_raw`.
  - A few rows lack some or all survey answers (empty cells, "NA", "nan"): a missing
    answer is left out of the persona, never printed; a persuadee with no answers at all
    gets no persona (and so no task). An age outside 18-100 (one row says 3) is treated
    as missing, since participants were adult crowd workers.
  - A user can be the persuadee in several dialogues (1,017 dialogues, 761 persuadees);
    the survey answers agree across rows, so one persona per user id.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

DATA_HELP = (
    "Get the Persuasion for Good data from the official release (full_dialog.csv and "
    "full_info.csv in data/FullData of https://gitlab.com/ucdavisnlp/persuasionforgood) "
    "or ConvoKit's \"persuasionforgood-corpus\" (pip install convokit; python -c "
    "\"import convokit; print(convokit.download('persuasionforgood-corpus'))\"), then "
    "pass --data PATH with the folder that holds those files."
)


class P4GDataNotFound(FileNotFoundError):
    """The Persuasion for Good files are not where the user pointed."""


# Survey fields: canonical name -> (group, label shown in the persona).
SURVEY_FIELDS = {
    "age": ("demographics", "Age"),
    "sex": ("demographics", "Sex"),
    "race": ("demographics", "Race"),
    "edu": ("demographics", "Education"),
    "marital": ("demographics", "Marital status"),
    "employment": ("demographics", "Employment"),
    "income": ("demographics", "Household income"),
    "religion": ("demographics", "Religion"),
    "ideology": ("demographics", "Political views"),
    "extrovert": ("big_five", "extraversion"),
    "agreeable": ("big_five", "agreeableness"),
    "conscientious": ("big_five", "conscientiousness"),
    "neurotic": ("big_five", "neuroticism"),
    "open": ("big_five", "openness"),
    "care": ("moral", "care"),
    "fairness": ("moral", "fairness"),
    "loyalty": ("moral", "loyalty"),
    "authority": ("moral", "authority"),
    "purity": ("moral", "purity"),
    "freedom": ("moral", "liberty"),
    "conform": ("schwartz", "conformity"),
    "tradition": ("schwartz", "tradition"),
    "benevolence": ("schwartz", "benevolence"),
    "universalism": ("schwartz", "universalism"),
    "self_direction": ("schwartz", "self-direction"),
    "stimulation": ("schwartz", "stimulation"),
    "hedonism": ("schwartz", "hedonism"),
    "achievement": ("schwartz", "achievement"),
    "power": ("schwartz", "power"),
    "security": ("schwartz", "security"),
    "rational": ("decision", "rational"),
    "intuitive": ("decision", "intuitive"),
}
CATEGORICAL = {"sex", "race", "edu", "marital", "employment", "religion", "ideology"}
# Score groups rendered as one line each, with the scale the survey used.
SCORE_LINES = [
    ("big_five", "Big Five personality (1-5)"),
    ("moral", "Moral foundations (1-6)"),
    ("schwartz", "Schwartz values (1-6)"),
    ("decision", "Decision style (1-5)"),
]
# Other spellings a corpus might use for the same field.
ALIASES = {"extraversion": "extrovert", "agreeableness": "agreeable",
           "conscientiousness": "conscientious", "neuroticism": "neurotic",
           "openness": "open", "conformity": "conform", "education": "edu",
           "gender": "sex", "liberty": "freedom", "selfdirection": "self_direction"}
_NORMALIZED = {re.sub(r"[^a-z]", "", k): k for k in SURVEY_FIELDS}
_NORMALIZED.update({re.sub(r"[^a-z]", "", a): k for a, k in ALIASES.items()})


@dataclass
class P4GDialogue:
    id: str                         # original dialogue id (B2) when known
    persuader_id: str | None
    persuadee_id: str | None
    messages: list[tuple[str, str]]  # (role, text), role "persuader" | "persuadee"
    donation: float | None          # persuadee's actual donation (B6) in [0, 2], or None
    donation_raw: float | None = None  # as recorded, before the > $2 check


@dataclass
class P4GCorpus:
    dialogues: list[P4GDialogue]
    surveys: dict[str, dict] = field(default_factory=dict)  # user id -> clean survey
    dropped_bad: int = 0            # "BAD_" dialogues skipped

    def persuadee_ids(self) -> list[str]:
        """Users who were a persuadee in a kept dialogue and answered the survey."""
        ids = {d.persuadee_id for d in self.dialogues if d.persuadee_id}
        return sorted(u for u in ids if self.surveys.get(u))


# ---------------------------------------------------------------------------- cleaning

def _missing(value) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    return isinstance(value, str) and value.strip().lower() in ("", "na", "nan", "none", "null")


def _number(value) -> float | None:
    if _missing(value):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def survey_field(key: str) -> str | None:
    """Canonical survey field for a column/meta key ("open.x", "Self-Direction" -> ...)."""
    k = key.strip().lower()
    if k.endswith(".x"):
        k = k[:-2]
    return _NORMALIZED.get(re.sub(r"[^a-z]", "", k))


def clean_survey(raw: dict) -> dict:
    """Keep the survey answers of a row or meta dict: canonical keys, floats for scores,
    stripped strings for categories, missing or implausible answers dropped."""
    out = {}
    for key, value in raw.items():
        name = survey_field(str(key))
        if name is None or _missing(value):
            continue
        if name in CATEGORICAL:
            out[name] = str(value).strip()
            continue
        x = _number(value)
        if x is None or (name == "age" and not 18 <= x <= 100):
            continue
        out[name] = x
    return out


def _donation(value) -> tuple[float | None, float | None]:
    """(donation in [0, 2] or None, raw value). Over $2 is a data error, see module doc."""
    raw = _number(value)
    if raw is None or raw < 0 or raw > 2:
        return None, raw
    return raw, raw


# --------------------------------------------------------------------------- rendering

def _fmt(x: float) -> str:
    return f"{round(x, 1):g}"


def render_persona(survey: dict) -> str:
    """A readable block of the survey answers, one line per field or score group.
    Missing answers are left out; a group with no answers has no line."""
    lines = []
    for name, (group, label) in SURVEY_FIELDS.items():
        if group != "demographics" or name not in survey:
            continue
        value = survey[name]
        if name == "age":
            value = str(int(round(value)))
        elif name == "income":
            value = f"bracket {_fmt(value)} on a 1-12 scale"
        lines.append(f"{label}: {value}")
    for group, title in SCORE_LINES:
        parts = [f"{label} {_fmt(survey[name])}" for name, (g, label) in SURVEY_FIELDS.items()
                 if g == group and name in survey]
        if parts:
            lines.append(f"{title}: " + ", ".join(parts))
    return "\n".join(lines)


# ------------------------------------------------------------------------------- split

def persona_split(user_id: str, test_fraction: float = 0.2) -> str:
    """"train" or "test" for a persuadee, from a SHA-256 hash of the user id alone: the
    same on every machine and Python run, and independent of which dialogues or other
    users a corpus holds. One user id is one persona, so no persona is in both splits."""
    h = int(hashlib.sha256(f"p4g-persona:{user_id}".encode()).hexdigest()[:8], 16)
    return "test" if h / 2 ** 32 < test_fraction else "train"


# ------------------------------------------------------------------------------ loading

def find_corpus_dir(path) -> tuple[Path, str]:
    """(folder, "csv" | "convokit"); looks in `path` and its direct subfolders."""
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "a file, not a folder" if root.exists() else "no such folder"
        raise P4GDataNotFound(f"Persuasion for Good data not found at '{root}' ({what}). {DATA_HELP}")
    for folder in [root] + sorted(p for p in root.iterdir() if p.is_dir()):
        if (folder / "full_dialog.csv").is_file() and (folder / "full_info.csv").is_file():
            return folder, "csv"
        if (folder / "utterances.jsonl").is_file() and (folder / "conversations.json").is_file():
            return folder, "convokit"
    raise P4GDataNotFound(f"Persuasion for Good data not found at '{root}': expected "
                          "full_dialog.csv + full_info.csv, or a ConvoKit corpus folder "
                          f"(utterances.jsonl, conversations.json, speakers.json). {DATA_HELP}")


def load_p4g(path) -> P4GCorpus:
    """Read either official distribution from `path` (see the module docstring)."""
    folder, kind = find_corpus_dir(path)
    return _load_csv(folder) if kind == "csv" else _load_convokit(folder)


def _role(value) -> str | None:
    """0/1 in any spelling (int, "1", "1.0", "persuadee", "ee") -> role name."""
    s = str(value).strip().lower()
    if s in ("persuader", "er"):
        return "persuader"
    if s in ("persuadee", "ee"):
        return "persuadee"
    x = _number(s)
    return {0.0: "persuader", 1.0: "persuadee"}.get(x) if x is not None else None


def _add_message(messages: list, role: str, text: str) -> None:
    """The data has one row per sentence; consecutive sentences of one speaker are one
    chat message."""
    text = str(text).strip()
    if not text:
        return
    if messages and messages[-1][0] == role:
        messages[-1] = (role, messages[-1][1] + " " + text)
    else:
        messages.append((role, text))


def _load_csv(folder: Path) -> P4GCorpus:
    with open(folder / "full_info.csv", newline="", encoding="utf-8-sig") as f:
        info = list(csv.DictReader(f))
    with open(folder / "full_dialog.csv", newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    messages: dict[str, list] = {}
    for r in rows:                   # rows are in dialogue order already
        role = _role(r.get("B4"))
        if role is not None:
            _add_message(messages.setdefault(r["B2"], []), role, r.get("Unit", ""))
    people: dict[str, dict] = {}     # dialogue id -> {"persuader": row, "persuadee": row}
    for r in info:
        role = _role(r.get("B4"))
        if role is not None:
            people.setdefault(r["B2"], {})[role] = r
    corpus = P4GCorpus(dialogues=[])
    for dialogue_id, msgs in messages.items():
        if dialogue_id.startswith("BAD_"):
            corpus.dropped_bad += 1
            continue
        er, ee = people.get(dialogue_id, {}).get("persuader"), people.get(dialogue_id, {}).get("persuadee")
        donation, raw = _donation(ee.get("B6") if ee else None)
        corpus.dialogues.append(P4GDialogue(
            id=dialogue_id, persuader_id=er["B3"] if er else None,
            persuadee_id=ee["B3"] if ee else None, messages=msgs,
            donation=donation, donation_raw=raw))
        for row in (er, ee):
            if row is not None and not corpus.surveys.get(row["B3"]):
                corpus.surveys[row["B3"]] = clean_survey(row)
    return corpus


def _meta(entry) -> dict:
    """A ConvoKit entry stored bare ({key: value}) or as {"meta": {...}, "vectors": [...]}."""
    if isinstance(entry, dict) and isinstance(entry.get("meta"), dict):
        return entry["meta"]
    return entry if isinstance(entry, dict) else {}


def _meta_donation(meta: dict):
    """The persuadee's donation in conversation meta: "donation_ee", "ee_donation",
    "persuadee_donation", ... (not the intended donation B5, not the persuader's)."""
    for key, value in meta.items():
        k = key.lower()
        if "donat" in k and "intend" not in k and re.search(r"(^|[^a-z])ee([^a-z]|$)|persuadee", k):
            return value
    return meta.get("B6")


def _load_convokit(folder: Path) -> P4GCorpus:
    speakers_file = folder / "speakers.json"
    if not speakers_file.is_file():
        speakers_file = folder / "users.json"
    if not speakers_file.is_file():      # the survey answers: without them there are no tasks
        raise P4GDataNotFound(f"the ConvoKit corpus at '{folder}' has no speakers.json (or users.json), "
                              f"which holds the persuadees' survey answers. {DATA_HELP}")
    speakers = json.loads(speakers_file.read_text(encoding="utf-8"))
    conversations = json.loads((folder / "conversations.json").read_text(encoding="utf-8"))
    messages: dict[str, list] = {}
    ids: dict[str, dict] = {}        # conversation id -> {role: speaker id}
    with open(folder / "utterances.jsonl", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            u = json.loads(line)
            conv = str(u.get("conversation_id", u.get("root")))
            speaker = u.get("speaker", u.get("user"))
            meta = u.get("meta") or {}
            role = _role(meta.get("role", meta.get("B4")))
            if role is None:
                raise ValueError(f"{folder / 'utterances.jsonl'}: utterance {u.get('id')} has no "
                                 "speaker role (meta 'role' or 'B4', 0 persuader / 1 persuadee)")
            _add_message(messages.setdefault(conv, []), role, u.get("text", ""))
            ids.setdefault(conv, {}).setdefault(role, None if speaker is None else str(speaker))
    corpus = P4GCorpus(dialogues=[])
    for conv, msgs in messages.items():
        meta = _meta(conversations.get(conv, {}))
        dialogue_id = str(meta.get("dialogue_id", meta.get("B2", conv)))
        if dialogue_id.startswith("BAD_"):
            corpus.dropped_bad += 1
            continue
        donation, raw = _donation(_meta_donation(meta))
        er, ee = ids[conv].get("persuader"), ids[conv].get("persuadee")
        corpus.dialogues.append(P4GDialogue(id=dialogue_id, persuader_id=er, persuadee_id=ee,
                                            messages=msgs, donation=donation, donation_raw=raw))
        for user in (er, ee):
            if user is not None and not corpus.surveys.get(user):
                corpus.surveys[user] = clean_survey(_meta(speakers.get(user, {})))
    return corpus
