"""Run folders you can trust: a resume never deletes what a run logged, a run folder records
the format it was written in, one trainer per folder whatever pid namespace or host it runs
in, and a record with a field of the wrong type is one message (or a skipped field), never a
traceback."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import eval as eval_cli
import train as train_cli
from minscope import experiment, files, monitor, report
from minscope.models import build_tiny_model
from minscope.runfolder import FORMAT_VERSION, FORMATS

ROOT = Path(__file__).resolve().parents[1]


def tiny_policies(mp, tokenizer):
    """Every model a real run loads is a tiny Llama (`--policy tiny`)."""
    from minscope import real_models

    mp.setattr(real_models, "load_model", lambda path, **kw: (build_tiny_model(
        tokenizer, "llama", hidden_size=32, num_layers=1), tokenizer))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tokenizer):
    """A finished 2-step `--env numbers` run of a tiny policy (a few seconds)."""
    runs = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        tiny_policies(mp, tokenizer)
        train_cli.main(["--env", "numbers", "--policy", "tiny", "--steps", "2", "--groups", "1", "--group-size", "2",
                        "--eval-every", "1", "--max-new-tokens", "4", "--device", "cpu", "--runs-dir", str(runs),
                        "--name", "run"])
    return runs / "run"


def snapshot(run: Path) -> dict:
    """Every file of a run folder with its bytes (the lock and the reports aside)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != "lock"}


def records(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


# --------------------------------------------------------------------------- 1. a resume never goes back
@pytest.mark.parametrize("steps", ["1", "0"])
def test_resume_with_steps_below_the_saved_step_is_refused_and_touches_nothing(finished_run, monkeypatch,
                                                                              tokenizer, steps):
    # before: rc 0 and "done", the step-2 evaluation record deleted, policy-step2/ orphaned,
    # config.json rewritten to the smaller --steps
    tiny_policies(monkeypatch, tokenizer)
    before, n = snapshot(finished_run), len(records(finished_run))
    assert n == 5 and (finished_run / "policy-step2").is_dir()      # train 0, 1; eval 0, 1, 2
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--env", "numbers", "--resume", str(finished_run), "--steps", steps])
    assert f"--steps {steps}: this run has trained 2 steps already, and a resume cannot go back" in str(e.value.code)
    assert len(records(finished_run)) == n
    assert snapshot(finished_run) == before


# --------------------------------------------------------------------------- 2. a run knows its format
def test_a_run_records_its_format_in_config_json(finished_run):
    config = json.loads((finished_run / "config.json").read_text())
    assert config["format"] == FORMAT_VERSION and "reward definitions" in config["format_covers"]


def older(run: Path, tmp_path, format_=None) -> Path:
    """A copy of `run` as code of another format (None: before formats were recorded) left it."""
    copy = tmp_path / "old"
    shutil.copytree(run, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("format_covers")
    if format_ is None:
        config.pop("format")
    else:
        config["format"] = format_
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("format_", [None, FORMAT_VERSION - 1])
@pytest.mark.parametrize("tool", ["resume", "report-only", "eval"])
def test_a_run_of_another_format_is_refused_in_one_line_that_says_what_changed(finished_run, tmp_path, capsys,
                                                                              tool, format_):
    # before: resumed silently under the new reward definitions and prompts, one curve of two meanings
    old = older(finished_run, tmp_path, format_)
    before = snapshot(old)
    call = {"resume": lambda: train_cli.main(["--env", "numbers", "--resume", str(old), "--steps", "4"]),
            "report-only": lambda: eval_cli.main([str(old), "--report-only"]),
            "eval": lambda: eval_cli.main([str(old)])}[tool]
    with pytest.raises(SystemExit) as e:
        call()
    message = str(e.value.code)
    found = format_ or 1
    since = "; ".join(f"format {v}: {FORMATS[v]}" for v in range(found + 1, FORMAT_VERSION + 1))
    assert f"was written in run-folder format {found} ({FORMATS[found]}), this code writes format " \
           f"{FORMAT_VERSION} (changed since: {since})" in message
    assert "Start a new run (another --name)" in message and "\n" not in message
    assert ("add \"format\": " in message) == (format_ is None)
    assert snapshot(old) == before


def test_a_folder_of_a_newer_format_asks_for_a_newer_minscope(finished_run, tmp_path):
    old = older(finished_run, tmp_path, FORMAT_VERSION + 1)
    with pytest.raises(SystemExit, match="by a newer minscope than this one"):
        eval_cli.main([str(old), "--report-only"])


def test_a_toy_run_without_a_format_is_refused_before_any_model_is_built(tmp_path):
    run = tmp_path / "toy"
    (run / "arms").mkdir(parents=True)
    config = experiment.asdict(experiment.ToyConfig(name="toy", methods=("single",), seeds=(0,)))
    (run / "config.json").write_text(json.dumps(config, default=list))
    (run / "arms" / "single-s0.jsonl").write_text(json.dumps({"kind": "train", "method": "single", "seed": 0,
                                                              "step": 0, "train_reward": 0.5}) + "\n")
    with pytest.raises(SystemExit, match="was written in run-folder format 1"):
        train_cli.main(["--resume", str(run), "--cache-dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit, match="was written in run-folder format 1"):
        experiment.run(experiment.load_config(run / "config.json"), resume=True, run_dir=run,
                       cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------- 3. one trainer per folder
@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder: Path, pid: int, flock: int, **ident) -> str:
    me = files.lock_identity()
    text = "\n".join([str(pid)] + [f"{k} {v}" for k, v in {**me, **ident}.items() if k != "pid"]
                     + [f"flock {flock}"]) + "\n"
    (folder / "lock").write_text(text)
    return text


@pytest.mark.parametrize("flock", [0, 1])
def test_a_lock_of_another_pid_namespace_or_host_counts_as_alive(tmp_path, dead_pid, flock):
    # before: the holder's pid, looked up in this namespace (where it is a dead pid), was taken
    # for a dead trainer and its lock taken over: two trainers in one folder
    cases = [dict(pidns="pid:[1]"), dict(host="elsewhere", boot="another-kernel", pidns="pid:[1]")]
    if flock:           # a free flock proves nothing on another kernel; on this one it is checked (below)
        cases = cases[1:]
    for ident in cases:
        text = write_lock(tmp_path, dead_pid, flock, **ident)
        with pytest.raises(SystemExit) as e:
            files.RunLock(tmp_path).acquire()
        message = str(e.value.code)
        assert f"process {dead_pid} holds {tmp_path / 'lock'}, and whether it still runs cannot be checked" in message
        assert f"delete {tmp_path / 'lock'} by hand" in message
        assert ("another pid namespace" if "host" not in ident else "host elsewhere") in message
        assert (tmp_path / "lock").read_text() == text


HOLD = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(files.WINDOWS, reason="flock is POSIX")
def test_a_holder_in_another_namespace_on_this_kernel_is_checked_by_its_flock(tmp_path, dead_pid):
    # a held flock: alive, whatever its pid says here; a free one: gone (the kernel drops it with
    # its process), so the lock is taken over with a note
    text = write_lock(tmp_path, dead_pid, 1, pidns="pid:[1]")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SystemExit, match=f"in use: process {dead_pid} is training in it"):
            files.RunLock(tmp_path).acquire()
        assert (tmp_path / "lock").read_text() == text
    finally:
        holder.kill()
        holder.wait()
    notes = []
    lock = files.RunLock(tmp_path, warn=notes.append).acquire()
    assert len(notes) == 1 and f"process {dead_pid}, which is no longer running" in notes[0]
    assert files.RunLock(tmp_path).record()["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / "lock").exists()


def test_without_proc_the_lock_goes_by_host_flock_and_pid(tmp_path, monkeypatch, dead_pid):
    # macOS has no /proc: no boot id or pid namespace to record; the host and the flock decide
    monkeypatch.setattr(files, "lock_identity", lambda: {"pid": os.getpid(), "host": "mac"})
    (tmp_path / "lock").write_text(f"{dead_pid}\nhost mac\nflock 1\n")
    notes = []
    files.RunLock(tmp_path, warn=notes.append).acquire().release()
    assert len(notes) == 1 and "no longer running" in notes[0]
    (tmp_path / "lock").write_text(f"{dead_pid}\nhost other-mac\nflock 1\n")
    with pytest.raises(SystemExit, match="it ran on host other-mac"):
        files.RunLock(tmp_path).acquire()


UNSHARED = """import sys
from minscope.files import RunLock
try:
    RunLock(sys.argv[1]).acquire()
    print("took it")
except SystemExit as e:
    print(e)
"""


def test_a_trainer_in_another_pid_namespace_is_refused_the_folder_of_a_live_one(tmp_path):
    # the break-it case itself: a second trainer under `unshare --pid --fork --mount-proc`, where
    # this process's pid does not exist (before: it took the lock over and both trained)
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    probe = subprocess.run(unshare + ["true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode:
        pytest.skip("no `unshare --pid` here (the hand-written locks above cover the case)")
    lock = files.RunLock(tmp_path).acquire()
    try:
        other = subprocess.run(unshare + [sys.executable, "-c", UNSHARED, str(tmp_path)], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert f"is in use: process {os.getpid()} is training in it" in other.stdout, other.stdout + other.stderr
        assert files.RunLock(tmp_path).record()["pid"] == os.getpid()
    finally:
        lock.release()


# --------------------------------------------------------------------------- 4. a field of the wrong type
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=6)
P4G_RECORDS = [      # what a P4G run with a trained persuadee logs besides (envs/p4g.py readings, probe)
    {"kind": "eval", "step": 2, "split": "test", "tasks": 1, "persuadee": 0.4, "unseen": 0.4, "unseen_se": 0.1,
     "panel_mean": 0.4, "readout_decision": 0.4, "readout_asked": 0.3, "reward_parsed": 0.2, "readout_coverage": 0.9,
     "probe": {"live": {"ask": 1.2, "refuse": 0.1}, "pool, step 0": {"ask": 0.9, "refuse": None}}},
    {"kind": "train", "step": 1, "train_reward": 0.5, "zero_var_frac": 0.0, "policy_entropy": 1.0, "reward_parsed": 0.1,
     "readout_asked": 0.2, "rollout_s": 1.0, "update_s": 1.0, "seconds": 2.0, "exact_stream_frac": 1.0},
    {"kind": "alarm", "step": 1, "signal": "zero_var", "value": 1.0, "detail": "zero-variance groups 1.00 > 0.8"},
]


def damaged_field_check(run: Path, records: list[dict], tools, examples: int):
    """Any JSON value in any field of any record (or in a new field) -> every tool either
    writes a whole report or stops with one RunFileError naming the file, line and field."""
    fields = [(i, key) for i, rec in enumerate(records) for key in [*rec, "extra"]]

    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.sampled_from(fields), JSON)
    def check(where, value):
        i, key = where
        recs = copy.deepcopy(records)
        recs[i][key] = value
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        for name in ("report.md", "report.html"):
            (run / name).unlink(missing_ok=True)
        for tool in tools:
            try:
                tool(run)
            except files.RunFileError as e:
                message = str(e.code)
                assert f"metrics.jsonl is damaged: line {i + 1}: " in message and f'"{key}"' in message, message
                return
        assert "## Training log" in (run / "report.md").read_text() or "# minscope toy" in (run / "report.md").read_text()
        assert (run / "report.html").read_text().rstrip().endswith("</html>")
    check()


@pytest.fixture
def no_png(monkeypatch):
    """The plots are drawn from the records, not rendered (the property test's time)."""
    import matplotlib.figure

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **kw: None)


def test_any_value_in_any_field_of_a_real_run_log_is_a_report_or_one_message(finished_run, tmp_path, no_png):
    # before: eval.py --report-only ended in a traceback ("Unknown format code 'f' for object of type
    # 'str'", real_tables._f) for a text in a member's mean; so did the monitor and a resume
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    tools = [lambda r: eval_cli.main([str(r), "--report-only"]), lambda r: monitor.main([str(r)])]
    damaged_field_check(run, records(finished_run) + P4G_RECORDS, tools, examples=60)


def test_any_value_in_any_field_of_a_toy_run_log_is_a_report_or_one_message(tmp_path, no_png):
    run = tmp_path / "toy"
    shutil.copytree(Path(__file__).parent / "fixtures" / "toy_run", run)
    reference = experiment.reference_values(8.0)         # (what eval.py --report-only computes first)
    damaged_field_check(run, records(run), [lambda r: report.write_report(r, reference)], examples=25)
