"""A toy run's folder, read and written without the experiment itself.

    runs/<name>/config.json        the settings
    runs/<name>/arms/<arm>.jsonl   each arm's live log (`MetricsLog`)
    runs/<name>/arms/<arm>.pt      each arm's latest state; <arm>.best.pt its best adapter
    runs/<name>/metrics.jsonl      every arm's log in one file (`merge_metrics`)

The experiment writes these; the collapse monitor's command line (`python -m
minscope.monitor`) and the report read them. Keeping the folder's layout here, apart from
`experiment` (which imports the monitor), lets both sides use it without importing each
other. Only the standard library, `files` and the config's plain JSON are needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import RunFileError, load_state, read_json, read_jsonl, truncate_log


# --------------------------------------------------------------------------- format
# The meaning of a run folder's records. Bump FORMAT_VERSION (and say what changed in FORMATS)
# with any change that makes the records of an earlier run mean something else: a reward's
# definition, a prompt, a record's fields. config.json records it (`format_fields`), and
# `--resume` and eval.py refuse a run of another format (`check_format`), so that one curve
# never mixes two reward definitions or two prompts.
FORMAT_VERSION = 3
FORMATS = {
    1: "before run folders recorded their format",
    # (what the runs of format 2 hold: P4G's persuadee samples its decision in its own stream, the
    # expected reward is exact to the dime, read rewards have a group-std floor of 0.05, the persuadee
    # prompt gives concrete tag examples; the toy computes in float64, rounds its parameters to float32
    # after every update and logs 6 significant digits; records as `record_problem` checks them)
    2: "P4G's decision readout, expected reward, std floor and persuadee prompt; the toy's float64 numbers",
    # (format 3: P4G's read reward pays E[gift x 1{readable}], an unreadable answer $0, where format 2
    # paid E[gift | readable]; the parsed reward no longer reads quoted, negated, reported or copied
    # tags, -$N or non-ASCII digits; the toy's records are as in format 2)
    3: "P4G's read reward counts an unreadable answer $0; the parsed reward ignores quoted, negated and copied tags",
}


def format_fields() -> dict:
    """What config.json records of the format its run is written in."""
    return {"format": FORMAT_VERSION,
            "format_covers": "reward definitions, prompts, record fields (minscope/runfolder.py FORMATS)"}


def check_format(config: dict, run_dir: Path, doing: str) -> None:
    """Refuse (one line) to resume or evaluate a run written in another format than this code's.
    A folder that predates formats counts as format 1; only one with nothing logged yet (no
    state, no log: a resume starts it from scratch) is provably compatible. `doing`: "resume"
    or "evaluate"."""
    found = config.get("format", 1)
    if found == FORMAT_VERSION:
        return
    run_dir = Path(run_dir)
    if "format" not in config and not any((run_dir / p).exists() for p in ("state.pt", "metrics.jsonl")) \
            and not any((run_dir / "arms").glob("*.*")):
        return
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise RunFileError(f"{run_dir / 'config.json'} is damaged: \"format\" is {found!r}, not a format number")
    if found > FORMAT_VERSION:
        raise RunFileError(f"{run_dir} was written in run-folder format {found}, by a newer minscope than this one "
                           f"(format {FORMAT_VERSION}): update minscope to {doing} it")
    changed = "; ".join(f"format {v}: {FORMATS[v]}" for v in range(found + 1, FORMAT_VERSION + 1))
    legacy = (f"; if you know it was written by code of format {FORMAT_VERSION}, add \"format\": "
              f"{FORMAT_VERSION} to its config.json" if "format" not in config else "")
    raise RunFileError(f"{run_dir} was written in run-folder format {found} ({FORMATS[found]}), this code "
                       f"writes format {FORMAT_VERSION} (changed since: {changed}): to {doing} it here would mix "
                       f"two meanings of its records. Start a new run (another --name), or {doing} it with a "
                       f"minscope commit of format {found}{legacy}")


def arm_name(method: str, seed: int) -> str:
    return f"{method}-s{seed}"


def config_arms(config: dict) -> list[tuple[str, int]]:
    """(method, seed) of every arm of a run, in the experiment's order (`ToyConfig.arms`),
    from its config.json as a dict: the methods x seeds, then the ablations x their seeds."""
    return ([(m, s) for m in config["methods"] for s in config["seeds"]]
            + [(m, s) for m in config.get("ablations", ()) for s in config.get("ablation_seeds", ())])


def run_arms(run_dir: Path) -> list[tuple[str, int]]:
    """The arms of the run in `run_dir`, read from its config.json."""
    return config_arms(read_json(Path(run_dir) / "config.json"))


class MetricsLog:
    """One arm's append-only JSONL. `trim(k)` drops what comes after the saved step k."""

    def __init__(self, path: Path):
        self.path = path

    def trim(self, from_step: int):
        # the state of step k is saved after its train record: everything later is redone
        truncate_log(self.path, from_step)

    def __call__(self, record: dict):
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


# --------------------------------------------------------------------------- the records' fields
# What the readers of a log (the monitor, the reports, a resume) compute with, by field: a field
# of another type is damage, one message naming the file, the line and the field (`read_log`).
# Fields no reader reads are not checked.
NUMERIC_FIELDS = ("train_reward", "panel_mean", "policy_entropy", "zero_var_frac", "real_users", "unseen", "seen",
                  "panel", "seconds", "rollout_s", "update_s", "eval_s", "policy_loss", "kl", "entropy",
                  "exact_stream_frac", "skipped_steps", "tokens_generated", "tokens_prefilled", "act_entropy",
                  "invalid_acts", "sim_clip_frac", "eval_temperature", "tasks", "sim_a_exploit_value",
                  # P4G's readings (real_eval.READINGS), the pool's diversity (report_results.POOL_KEYS)
                  "readout_decision", "readout_asked", "reward_parsed", "reward_sampled", "readout_coverage",
                  "pairwise_tv", "pairwise_floor", "pairwise_tv_excess", "tv_sim_a", "tv_real", "exploit_value",
                  "cue_rate", "real_cue_rate")
NEEDED_NUMBERS = ("train_reward", "panel_mean", "panel", "real_users")    # a number, never null


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _maybe_number(v) -> bool:
    return v is None or _number(v)


def _text(v) -> bool:
    return isinstance(v, str)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _numbers(v) -> bool:
    return isinstance(v, list) and all(_number(x) for x in v)


def _interval(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(_maybe_number(x) for x in v)


def _number_map(v) -> bool:
    return isinstance(v, dict) and all(_maybe_number(x) for x in v.values())


def _dialogues(v) -> bool:
    return isinstance(v, list) and all(
        isinstance(d, dict) and _text(d.get("text")) and _number(d.get("reward"))
        and all(_text(d[k]) for k in ("with", "persona") if k in d)
        and (d.get("task") is None or isinstance(d["task"], (str, int, float))) for d in v)


def _probe(v) -> bool:
    return isinstance(v, dict) and all(_number_map(m) for m in v.values())


def _by_age(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and k.isdigit() and isinstance(a, dict)
        and all(_number(a.get(x)) for x in ("tokens", "clip_frac", "abs_log_ratio")) for k, a in v.items())


FIELD_TYPES = {"kind": (_text, "a text"), "method": (_text, "a text"), "signal": (_text, "a text"),
               "split": (_text, "a text"), "top_sequence": (_text, "a text"), "detail": (_text, "a text"),
               "step": (_whole, "a whole number"), "seed": (_whole, "a whole number"),
               "dialogues": (_dialogues, "a list of dialogues (text, reward, with)"),
               "transcripts": (lambda v: isinstance(v, list) and all(map(_text, v)), "a list of texts"),
               "probe": (_probe, "a table of numbers per member"), "meter": (_number_map, "a table of numbers"),
               "compute": (_number_map, "a table of numbers"), "compute_total": (_number_map, "a table of numbers"),
               "real_users_rewards": (_numbers, "a list of numbers"),
               "sim_ratio_by_age": (_by_age, "a table of tokens, clip_frac, abs_log_ratio per age")}


def field_problem(rec: dict, key: str) -> str | None:
    """What is wrong with `rec[key]` for the readers (None: nothing)."""
    value = rec[key]
    if key in FIELD_TYPES:
        ok, what = FIELD_TYPES[key]
    elif key.endswith("_ci95"):
        ok, what = _interval, "an interval [lo, hi]"
    elif key in NEEDED_NUMBERS:
        ok, what = _number, "a number"
    elif key in NUMERIC_FIELDS or key.endswith("_se") or rec.get("kind") == "eval":
        ok, what = _maybe_number, "a number"     # an evaluation's other fields: its members' means
    else:
        return None
    if ok(value):
        return None
    shown = repr(value)
    return f"\"{key}\" is {shown if len(shown) <= 60 else shown[:57] + '...'}, not {what}"


def record_problem(rec: dict) -> str | None:
    """What makes a parsed log record unusable (None: nothing): no `kind`, a `step` that is not
    a whole number, a field of the wrong type (`field_problem`), an alarm without its signal."""
    if not isinstance(rec.get("kind"), str):
        return "a record without a \"kind\""
    if "step" not in rec and rec["kind"] in ("train", "eval", "alarm"):
        return "\"step\" is None, not a whole number"
    for key in rec:
        why = field_problem(rec, key)
        if why:
            return why
    if rec["kind"] == "alarm" and not isinstance(rec.get("signal"), str):
        return "an alarm record without its \"signal\""
    return None


def read_log(path: Path, warn=None) -> list[dict]:
    """`files.read_jsonl`, then every record checked (`record_problem`): a damaged record is
    RunFileError naming the file and the line."""
    path = Path(path)
    records = read_jsonl(path) if warn is None else read_jsonl(path, warn=warn)
    lines = None
    for k, rec in enumerate(records):
        why = record_problem(rec)
        if why:
            if lines is None:
                lines = [i + 1 for i, ln in enumerate(path.read_text().splitlines()) if ln.strip()]
            raise RunFileError(f"{path} is damaged: line {lines[k]}: {why}; fix or remove that line")
    return records


def check_saved_arms(run_dir: Path, arms: list[tuple[str, int]]) -> None:
    """Before a resumed run starts any worker: every arm's saved state must load and every
    log must read (a half-written last line, left by a kill, is dropped with a note by the
    arm itself); otherwise one message naming the damaged file (files.RunFileError)."""
    for method, seed in arms:
        arm = Path(run_dir) / "arms" / arm_name(method, seed)
        for path in (arm.with_suffix(".pt"), arm.parent / f"{arm.name}.best.pt"):
            if path.exists():
                load_state(path)
        log = arm.parent / f"{arm.name}.jsonl"
        if log.exists():
            read_log(log, warn=lambda msg: None)     # the note comes when the arm trims it


def check_resume_steps(run_dir: Path, steps: int, saved_step: int) -> None:
    """A real run resumed with `--steps` at or below the step its state was saved after is
    refused before anything is touched: going on would drop the logged steps after `steps`
    (the final evaluation among them), orphan their adapters and rewrite config.json."""
    if not isinstance(saved_step, int) or isinstance(saved_step, bool) or saved_step < 0:
        raise RunFileError(f"{Path(run_dir) / 'state.pt'} is damaged: its step is {saved_step!r}, not a whole "
                           "number; delete it to restart the run from scratch")
    if steps is not None and steps <= saved_step:
        raise SystemExit(f"--resume {run_dir} --steps {steps}: this run has trained {saved_step + 1} steps "
                         f"already, and a resume cannot go back; give --steps {saved_step + 1} or more to "
                         f"continue it, or evaluate an earlier checkpoint with `python eval.py {run_dir} "
                         "--checkpoint STEP`")


def merge_metrics(run_dir: Path, arms: list[tuple[str, int]] | None = None) -> Path:
    """Concatenate the arms' logs into metrics.jsonl, in the order of `arms` (default: the
    run's own, from its config.json)."""
    run_dir = Path(run_dir)
    arms = run_arms(run_dir) if arms is None else arms
    out = run_dir / "metrics.jsonl"
    with out.open("w") as f:
        for method, seed in arms:
            p = run_dir / "arms" / f"{arm_name(method, seed)}.jsonl"
            if p.exists():
                f.write(p.read_text())
    return out
