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

Damaged files (a renamed column, a short row, bytes that are not UTF-8, a file cut off in
the middle of a row, a JSON file that does not parse) raise `DataError`, whose message
names the file, the line and the column where that applies. A file cut off at a row
boundary cannot be told from a complete one, so the loader reports, with counts, the
dialogues that lack their persuadee row or their messages (`P4GCorpus.warnings`, also
printed to stderr): those dialogues give no task.

One file, though long: each reader (CSV, XLSX, ConvoKit) ends in the same `P4GCorpus`
checks, and its error messages name the file and line the same way.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import sys
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


class DataError(ValueError):
    """A Persuasion for Good file is there but damaged or not in the release's format. The
    message names the file (and line or column) and says what is wrong, so a command-line
    tool can print it as it is, without a traceback."""


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
    warnings: list[str] = field(default_factory=list)       # what was skipped, with counts

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


def _read_text(path: Path) -> str:
    """A file's text; bytes that are not UTF-8 are a DataError naming the line."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):       # a UTF-8 byte-order mark, as Excel writes
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); the "
                        "release files are UTF-8, so re-save the file as UTF-8 or download it "
                        "again") from None


# Columns the loader reads; every other column of full_info.csv is a survey answer.
_COLUMNS = {"full_dialog.csv": {"B2": "dialogue id", "B4": "role", "Unit": "message text"},
            "full_info.csv": {"B2": "dialogue id", "B3": "user id", "B4": "role"}}
_OTHER_COLUMNS = {"", "Turn", "B5", "B6", "B7"}


def _read_csv(path: Path) -> list[tuple[int, dict]]:
    """(line, row) of every row of a release CSV, checked: UTF-8, the columns the loader
    reads present, and every row as many fields as the header. A problem is a DataError
    naming the file and the line (or the column)."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    records = []
    try:
        for fields in reader:
            if fields:                   # (blank lines are skipped)
                records.append((reader.line_num, fields))
    except csv.Error as e:
        end = reader.line_num >= _read_text(path).count("\n") + 1
        raise DataError(f"{path}: line {reader.line_num}: {e}" + (
            "; the file ends inside a quoted field, so it looks truncated: download it again"
            if end and "end of data" in str(e) else "")) from None
    if not records:
        raise DataError(f"{path} is empty; download it again")
    _, header = records[0]
    missing = [f"'{c}' ({what})" for c, what in _COLUMNS[path.name].items() if c not in header]
    if missing:
        unknown = [c for c in header if c not in _COLUMNS[path.name] and c not in _OTHER_COLUMNS
                   and survey_field(c) is None]
        raise DataError(f"{path} has no column {' or '.join(missing)}; "
                        + (f"columns it has that the release does not: {', '.join(map(repr, unknown))}"
                           if unknown else f"its columns are {', '.join(map(repr, header))}"))
    rows = []
    for k, (line, fields) in enumerate(records[1:], start=2):
        if len(fields) != len(header):
            last = k == len(records) and len(fields) < len(header)
            raise DataError(f"{path}: line {line} has {len(fields)} of {len(header)} fields" + (
                "; it is the last row, so the file looks truncated: download it again" if last else ""))
        rows.append((line, dict(zip(header, fields))))
    return rows


def _row_role(path: Path, line: int, row: dict) -> str:
    """The row's role, and its dialogue (and, in full_info.csv, user) id present."""
    role = _role(row["B4"])
    if role is None:
        raise DataError(f"{path}: line {line}: column B4 (role) is {row['B4']!r}; "
                        "expected 0 (persuader) or 1 (persuadee)")
    for column in ("B2", "B3"):
        if column in _COLUMNS[path.name] and not row[column].strip():
            raise DataError(f"{path}: line {line}: column {column} "
                            f"({_COLUMNS[path.name][column]}) is empty")
    return role


def _warn(corpus: P4GCorpus, message: str) -> None:
    corpus.warnings.append(message)
    print(f"warning: {message}", file=sys.stderr)


def _report_unmatched(corpus: P4GCorpus, messages: dict, people: dict) -> None:
    """Dialogues that lack their persuadee row or their messages (e.g. a file cut off at a
    row boundary, which no row shows): reported with counts, as they give no task."""
    kept = [d for d in messages if not d.startswith("BAD_")]
    no_persuadee = [d for d in kept if "persuadee" not in people.get(d, {})]
    if no_persuadee:
        _warn(corpus, f"full_info.csv has no persuadee row for {len(no_persuadee)} of {len(kept)} "
                      f"dialogues (e.g. {no_persuadee[0]}); they give no task. A complete release "
                      "has two rows per dialogue: is the file cut off?")
    listed = [d for d in people if not d.startswith("BAD_")]
    no_messages = [d for d in listed if d not in messages]
    if no_messages:
        _warn(corpus, f"full_dialog.csv has no messages for {len(no_messages)} of {len(listed)} "
                      f"dialogues in full_info.csv (e.g. {no_messages[0]}); they are left out. "
                      "Is the file cut off?")


def _load_csv(folder: Path) -> P4GCorpus:
    info_path, dialog_path = folder / "full_info.csv", folder / "full_dialog.csv"
    info, rows = _read_csv(info_path), _read_csv(dialog_path)
    messages: dict[str, list] = {}
    for line, r in rows:             # rows are in dialogue order already
        role = _row_role(dialog_path, line, r)
        _add_message(messages.setdefault(r["B2"], []), role, r["Unit"])
    people: dict[str, dict] = {}     # dialogue id -> {"persuader": row, "persuadee": row}
    for line, r in info:
        people.setdefault(r["B2"], {})[_row_role(info_path, line, r)] = r
    corpus = P4GCorpus(dialogues=[])
    _report_unmatched(corpus, messages, people)
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


def _json_problem(path: Path, e: json.JSONDecodeError, last_line: int) -> DataError:
    cut = "; the file ends there, so it looks truncated: download it again" if e.lineno >= last_line else ""
    return DataError(f"{path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg}){cut}")


def _read_json_object(path: Path) -> dict:
    """A ConvoKit JSON file that maps ids to entries (speakers, conversations)."""
    text = _read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _json_problem(path, e, text.rstrip().count("\n") + 1) from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object mapping ids to entries, found a "
                        f"{type(value).__name__}")
    return value


def _read_utterances(path: Path) -> list[dict]:
    """utterances.jsonl: one JSON object per line; a broken line is a DataError naming it."""
    lines = _read_text(path).splitlines()
    last = max((k for k, line in enumerate(lines, start=1) if line.strip()), default=0)
    utterances = []
    for k, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            u = json.loads(line)
        except json.JSONDecodeError as e:
            cut = "; it is the last line, so the file looks truncated: download it again" if k == last else ""
            raise DataError(f"{path}: line {k}: not valid JSON ({e.msg}){cut}") from None
        if not isinstance(u, dict):
            raise DataError(f"{path}: line {k}: expected a JSON object (one utterance), found a "
                            f"{type(u).__name__}")
        utterances.append(u)
    return utterances


def _load_convokit(folder: Path) -> P4GCorpus:
    speakers_file = folder / "speakers.json"
    if not speakers_file.is_file():
        speakers_file = folder / "users.json"
    if not speakers_file.is_file():      # the survey answers: without them there are no tasks
        raise P4GDataNotFound(f"the ConvoKit corpus at '{folder}' has no speakers.json (or users.json), "
                              f"which holds the persuadees' survey answers. {DATA_HELP}")
    speakers = _read_json_object(speakers_file)
    conversations = _read_json_object(folder / "conversations.json")
    messages: dict[str, list] = {}
    ids: dict[str, dict] = {}        # conversation id -> {role: speaker id}
    for u in _read_utterances(folder / "utterances.jsonl"):
        conv = str(u.get("conversation_id", u.get("root")))
        speaker = u.get("speaker", u.get("user"))
        meta = u.get("meta") if isinstance(u.get("meta"), dict) else {}
        role = _role(meta.get("role", meta.get("B4")))
        if role is None:
            raise DataError(f"{folder / 'utterances.jsonl'}: utterance {u.get('id')} has no "
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
