"""A careless or hostile user of the run folders and their tools: what must not be lost or
silently wrong (a live run under `minscope.monitor --write`, a real run named like a toy one,
LoRA settings, text that is not valid UTF-8, NaN seeds, crafted transcripts), and command
lines that must stop with one line, not a traceback. Each test failed on the code before its
fix (the test's comment says how)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minscope import monitor
from minscope.runfolder import FORMAT_VERSION

ROOT = Path(__file__).resolve().parents[1]


def records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# --------------------------------------------------------------------------- monitor --write on a live run
TRAINER = """
import json, sys
from pathlib import Path
from minscope.files import RunLock
run = Path(sys.argv[1])
RunLock(run).acquire()
with (run / "metrics.jsonl").open("a") as log:          # as runner.run_real: one handle, kept open
    for step in range(2):
        log.write(json.dumps({"kind": "train", "step": step, "train_reward": 0.5, "zero_var_frac": 0.9}) + "\\n")
        log.flush()
        print("wrote", step, flush=True)
        sys.stdin.readline()                            # the test's go-ahead for the next step
"""


def real_run_folder(run: Path) -> Path:
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "method": "single", "steps": 2}))
    (run / "metrics.jsonl").write_text("")
    return run


def test_monitor_write_on_a_live_run_is_refused_and_no_record_is_lost(tmp_path):
    # before: --write replaced metrics.jsonl under the trainer, whose second record went to the
    # deleted file (1 record of 2 left) and config.json was rewritten during the run
    run = real_run_folder(tmp_path / "run")
    config = (run / "config.json").read_text()
    child = subprocess.Popen([sys.executable, "-c", TRAINER, str(run)], cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().startswith("wrote 0")
        with pytest.raises(SystemExit) as e:
            monitor.main([str(run), "--set", "window_steps=1", "--set", "zero_var=0.5", "--write"])
        assert "in use: process" in str(e.value.code) and "\n" not in str(e.value.code)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().startswith("wrote 1")
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
    finally:
        child.kill()
    assert [r["step"] for r in records(run / "metrics.jsonl")] == [0, 1]
    assert (run / "config.json").read_text() == config
    # once the trainer is gone, --write goes ahead (and leaves no lock behind)
    monitor.main([str(run), "--set", "window_steps=1", "--set", "zero_var=0.5", "--write"])
    assert [r["kind"] for r in records(run / "metrics.jsonl")] == ["train", "alarm", "train"]
    assert json.loads((run / "config.json").read_text())["monitor"]["zero_var"] == 0.5
    assert not (run / "lock").exists()


# --------------------------------------------------------------------------- a real run named like a toy one
def test_a_real_run_named_like_an_existing_toy_run_is_refused_before_anything_is_written(tmp_path):
    # before: run_real refused only a folder with state.pt, so it rewrote the toy's config.json
    import train as train_cli

    toy = tmp_path / "toy"
    (toy / "arms").mkdir(parents=True)
    (toy / "config.json").write_text(json.dumps({"name": "toy", "models": {}, "methods": ["single"]}))
    before = {p: p.read_bytes() for p in toy.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--env", "numbers", "--policy", str(tmp_path / "no-model"), "--runs-dir", str(tmp_path),
                        "--name", "toy", "--steps", "1"])
    assert "already exists and holds a toy run: pick another --name" in str(e.value.code)
    assert {p: p.read_bytes() for p in toy.rglob("*") if p.is_file()} == before


# --------------------------------------------------------------------------- LoRA settings with a scripted partner
def scripted_args(**over):
    import argparse

    return argparse.Namespace(**{**dict(policy="tiny", load_in_4bit=False, device="cpu", temperature=0.7,
                                        max_new_tokens=4, lora_r=4, lora_alpha=7), **over})


@pytest.fixture
def tiny_loader(monkeypatch, tokenizer):
    from minscope import real_models
    from minscope.models import build_tiny_model

    monkeypatch.setattr(real_models, "load_model", lambda path, **kw: (build_tiny_model(
        tokenizer, "llama", hidden_size=32, num_layers=1), tokenizer))
    return real_models


def test_lora_settings_reach_the_policy_adapter_with_a_scripted_partner(tiny_loader):
    # before: --env numbers|wordgame built the policy adapter with r = 8, alpha = 16 whatever was asked
    from minscope.envs.numbers import Numbers

    models = tiny_loader.build_models(scripted_args(), partner=Numbers().scripted_partner())
    config = models.policy_model.peft_config["policy"]
    assert (config.r, config.lora_alpha) == (4, 7)


def test_a_lora_rank_above_the_model_width_is_one_line(tiny_loader):
    # before: a rank of 10**9 was accepted (and ignored, or allocated, depending on the environment)
    from minscope.envs.numbers import Numbers

    with pytest.raises(SystemExit, match=r"--lora-r 1000000000: above the model's hidden size \(32\)"):
        tiny_loader.build_models(scripted_args(lora_r=10**9), partner=Numbers().scripted_partner())


# --------------------------------------------------------------------------- reports: any text, written whole
def test_report_only_with_a_lone_surrogate_in_the_log_writes_a_whole_report(tmp_path):
    # before: UnicodeEncodeError, and report.html left at 0 bytes
    import eval as eval_cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "method": "single", "steps": 1, "policy": "x"}))
    dialogue = {"with": "asker", "task": "7", "reward": 0.0, "text": "say \ud800 a number"}
    recs = [{"kind": "train", "step": 0, "train_reward": 0.5, "dialogues": [dialogue]},
            {"kind": "eval", "step": 0, "panel_mean": 0.5, "asker": 0.5, "dialogues": [dialogue]}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    eval_cli.main([str(run), "--report-only"])
    page = (run / "report.html").read_bytes().decode("utf-8")          # strict: valid UTF-8
    assert page.endswith("</body></html>\n") and "say \ufffd a number" in page
    (run / "report.md").read_bytes().decode("utf-8")


def _any_text():
    from hypothesis import strategies as st

    char = st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr), st.sampled_from("`|#![]()\n*<>&"))
    return st.lists(char, max_size=40).map("".join)


def test_any_text_makes_a_whole_valid_utf8_report_html(tmp_path):
    """bench/studies/fuzz_parsers.py's idea for the report writer: any str (lone surrogates, markdown
    and HTML syntax included) in the title, the markdown and the dialogues gives a complete
    page that decodes as UTF-8, and no temporary file is left beside it."""
    from hypothesis import HealthCheck, given, settings

    from minscope.report_html import write_html

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(title=_any_text(), md=_any_text(), heading=_any_text(), caption=_any_text(), text=_any_text())
    def check(title, md, heading, caption, text):
        path = write_html(tmp_path, title, md, [(heading, [(caption, text)])])
        page = path.read_bytes().decode("utf-8")
        assert page.startswith("<!doctype html>") and page.endswith("</body></html>\n")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
    check()


def test_a_report_write_that_fails_midway_keeps_the_previous_report(tmp_path, monkeypatch):
    # before: report.html was written in place, so a failure (here: a full disk after half the
    # page) left a partial page
    from minscope.report_html import write_html

    write_html(tmp_path, "old", "# the previous report")
    old = (tmp_path / "report.html").read_bytes()

    def disk_full(self, data, *a, **kw):
        with open(self, "wb") as f:
            f.write((data.encode() if isinstance(data, str) else data)[: len(data) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_bytes", disk_full)
    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError):
        write_html(tmp_path, "new", "# the new report\n" + "text\n" * 100)
    assert (tmp_path / "report.html").read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


# --------------------------------------------------------------------------- monitor thresholds, crafted transcripts
@pytest.mark.parametrize("setting, message", [
    ("zero_var=nan", "zero_var must be a finite number, not nan"),
    ("entropy_frac=inf", "entropy_frac must be a finite number, not inf"),
    ("window=0", "window must be 2 or more, not 0"),
    ("window_steps=0", "window_steps must be 1 or more, not 0"),
    ("window=2.5", "window takes a whole number, not '2.5'"),
    ("fall_z=high", "fall_z takes a number, not 'high'"),
])
def test_monitor_set_refuses_a_threshold_that_would_silence_or_break_the_alarms(tmp_path, capsys, setting, message):
    # before: NaN/inf/0 were written into config.json with --write (NaN compares false: an alarm
    # that never fires), a window of 0 raised IndexError, a word a ValueError traceback
    run = real_run_folder(tmp_path / "run")
    config = (run / "config.json").read_text()
    with pytest.raises(SystemExit) as e:
        monitor.main([str(run), "--set", setting, "--write"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--set {setting}: {message}" in err and "Traceback" not in err
    assert (run / "config.json").read_text() == config


def test_a_damaged_monitor_block_in_config_json_is_one_message_naming_it(tmp_path):
    # before: TypeError (an unknown key) from MonitorConfig(**...)
    run = real_run_folder(tmp_path / "run")
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "monitor": {"colour": 1}}))
    with pytest.raises(SystemExit, match=r"config.json is damaged: \"monitor\": unknown threshold 'colour'"):
        monitor.main([str(run)])
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "monitor": {"zero_var": "high"}}))
    with pytest.raises(SystemExit, match=r"\"monitor\": zero_var takes a number, not 'high'"):
        monitor.main([str(run)])


PNG = b"\x89PNG\r\n\x1a\n" + b"secret pixels" * 10


def test_a_toy_transcript_cannot_close_the_report_code_block_nor_embed_a_file_outside_the_run(tmp_path):
    # before: the toy report's ``` fence was closed by a transcript's ```, whose next lines became
    # markdown: a heading, and an image read from any path on disk into report.html
    import base64

    from minscope import report

    (tmp_path / "secret.png").write_bytes(PNG)
    run = tmp_path / "run"
    run.mkdir()
    text = "persuader: hi\n```\n# Injected heading\n![leak](../secret.png)\n![leak](" + str(tmp_path / "secret.png") + ")"
    recs = []
    for step, real in ((0, 0.3), (10, 0.4)):
        recs.append({"kind": "eval", "method": "single", "seed": 0, "step": step, "real_users": real, "panel": 0.5,
                     "real_users_rewards": [real] * 4, "unseen": 0.5, "seen": 0.5,
                     "dialogues": [{"with": "real_users", "persona": "p", "reward": 1.0, "text": text}]})
        recs.append({"kind": "train", "method": "single", "seed": 0, "step": step, "train_reward": 0.5,
                     "policy_entropy": 0.4, "zero_var_frac": 0.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    report.write_report(run, {"random": 0.1, "best_fixed": 0.2, "best_adaptive": 0.3})
    page = (run / "report.html").read_text()
    assert "<h1>Injected heading</h1>" not in page and "# Injected heading" in page
    assert base64.b64encode(PNG).decode()[:20] not in page


@pytest.mark.parametrize("name", ["../secret.png", "SECRET_ABSOLUTE", "link.png"])
def test_report_images_come_only_from_inside_the_run_folder(tmp_path, name):
    import base64

    from minscope.report_html import markdown_html

    (tmp_path / "secret.png").write_bytes(PNG)
    run = tmp_path / "run"
    run.mkdir()
    (run / "link.png").symlink_to(tmp_path / "secret.png")
    own = b"\x89PNG\r\n\x1a\n" + b"the run's own curves"
    (run / "curves.png").write_bytes(own)
    name = name.replace("SECRET_ABSOLUTE", str(tmp_path / "secret.png"))
    page = markdown_html(f"![x]({name})\n![curves](curves.png)", run)
    assert base64.b64encode(PNG).decode() not in page and "not found in the run folder" in page
    assert base64.b64encode(own).decode() in page                  # the run's own image is inlined


# --------------------------------------------------------------------------- one line, not a traceback
def test_a_device_the_machine_lacks_is_one_line_before_any_folder_or_model(tmp_path, monkeypatch):
    # before: the model loaded and config.json was written, then torch raised
    import torch

    import train as train_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    for device in ("cuda", "mps"):
        with pytest.raises(SystemExit, match=f"--device {device}: .* use --device cpu"):
            train_cli.main(["--env", "numbers", "--policy", str(tmp_path / "no-model"), "--runs-dir",
                            str(tmp_path / "runs"), "--device", device])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [["--env", "numbers", "--policy", "x"], []])
def test_runs_dir_naming_a_file_is_one_line(tmp_path, capsys, argv):
    import train as train_cli

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        train_cli.main([*argv, "--runs-dir", str(tmp_path / "file")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "that is a file, not a folder" in err and "Traceback" not in err
    assert (tmp_path / "file").read_text() == ""


def test_a_turn_longer_than_the_model_context_is_one_line(tiny_loader):
    # before: --max-new-tokens 1000000000 tried to allocate its cache (768 GB with smollm2)
    from minscope.envs.numbers import Numbers

    with pytest.raises(SystemExit, match=r"--max-new-tokens 1000000000: above the model's context length \(\d+ tokens\)"):
        tiny_loader.build_models(scripted_args(max_new_tokens=10**9), partner=Numbers().scripted_partner())


# --------------------------------------------------------------------------- damaged but parseable run files
GOOD = json.dumps({"kind": "train", "step": 0, "train_reward": 0.5, "zero_var_frac": 0.0})
DAMAGED_LINES = [
    (json.dumps({"kind": "train", "step": 1, "train_reward": "high"}), "line 2: \"train_reward\" is 'high', not a number"),
    (json.dumps({"step": 1, "train_reward": 0.5}), "line 2: a record without a \"kind\""),
    (json.dumps({"kind": "eval", "step": "one"}), "line 2: \"step\" is 'one', not a whole number"),
    ("[" * 100_000 + "]" * 100_000, "line 2 is not a JSON record (nested too deeply)"),
]


def damaged_real_run(tmp_path, line):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "method": "single", "policy": "x", "steps": 2}))
    (run / "metrics.jsonl").write_text("\n".join([GOOD, line, GOOD]) + "\n")
    return run


@pytest.mark.parametrize("tool", ["monitor", "report-only", "resume"])
@pytest.mark.parametrize("line, message", DAMAGED_LINES, ids=["text", "no-kind", "step", "deep"])
def test_a_damaged_but_parseable_log_is_one_message_naming_file_and_line(tmp_path, tool, line, message):
    # before: TypeError / KeyError / RecursionError tracebacks (the report, the monitor, a resume)
    import eval as eval_cli
    import train as train_cli

    run = damaged_real_run(tmp_path, line)
    call = {"monitor": lambda: monitor.main([str(run)]),
            "report-only": lambda: eval_cli.main([str(run), "--report-only"]),
            "resume": lambda: train_cli.main(["--env", "numbers", "--resume", str(run)])}[tool]
    with pytest.raises(SystemExit) as e:
        call()
    assert f"metrics.jsonl is damaged: {message}" in str(e.value.code)


@pytest.mark.parametrize("tool", ["report-only", "resume"])
def test_a_setting_of_the_wrong_kind_in_config_json_is_one_message_naming_it(tmp_path, tool):
    import eval as eval_cli
    import train as train_cli

    run = damaged_real_run(tmp_path, GOOD)
    (run / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                 "env": "numbers", "method": "single", "policy": "x", "steps": 2,
                                                 "groups": "many"}))
    with pytest.raises(SystemExit, match=r"config.json is damaged: 'groups' is 'many', not a whole number"):
        if tool == "resume":
            train_cli.main(["--env", "numbers", "--resume", str(run)])
        else:
            eval_cli.main([str(run), "--report-only"])


def test_notebooks_execute_help_prints_the_usage_and_touches_no_notebook():
    # before: "--help" was taken for a notebook name: FileNotFoundError traceback
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")}
    run = subprocess.run([sys.executable, str(ROOT / "notebooks" / "execute.py"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "Re-execute notebooks in place" in run.stdout and "Traceback" not in run.stderr
    assert {p: p.stat().st_mtime_ns for p in (ROOT / "notebooks").glob("*.ipynb")} == before


def test_notebooks_execute_without_a_jupyter_kernel_is_one_line(monkeypatch):
    # before: jupyter_client's NoSuchKernel traceback from inside nbclient
    import importlib.util

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    spec = importlib.util.spec_from_file_location("execute_notebooks", ROOT / "notebooks" / "execute.py")
    execute = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(execute)

    class NoKernel:                       # what nbclient does without the kernel (and nothing else)
        def __init__(self, *a, **kw):
            pass

        def execute(self):
            raise NoSuchKernel("python3")
    monkeypatch.setattr(KernelSpecManager, "find_kernel_specs", lambda self: {})
    monkeypatch.setattr(execute, "NotebookClient", NoKernel)
    monkeypatch.setattr(execute.nbformat, "write", lambda *a, **kw: pytest.fail("a notebook was written"))
    with pytest.raises(SystemExit, match="no Jupyter kernel named python3: install one with"):
        execute.main(["01_simulator_collapse"])


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.unlink(), "cannot read it"),
    (lambda t: t.write_text("## Other\n\n| method | per seed |\n|---|---|\n| Base | .2 .2 |\n"), "no line starts with '## Runs'"),
    (lambda t: t.write_text("## Runs\n\n| method | mean |\n|---|---|\n| Base | .2 |\n"), "has no \"per seed\" column"),
    (lambda t: t.write_text("## Runs\n\nno table here\n"), "no table after '## Runs'"),
])
def test_seed_intervals_with_a_missing_file_heading_or_column_is_one_line(tmp_path, damage, message):
    # before: FileNotFoundError, StopIteration or ValueError tracebacks
    table = tmp_path / "t.md"
    table.write_text("")
    damage(table)
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "seed_intervals.py"), str(table), "## Runs"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("best", ['{"step": ', '{"step": "3"}', "[]"])
def test_checkpoint_best_with_a_damaged_best_json_is_one_message(tmp_path, best):
    # before: JSONDecodeError / KeyError tracebacks, or a string step compared with the saved ones
    from minscope.real_eval import pick_checkpoint

    (tmp_path / "policy-step3" / "policy").mkdir(parents=True)
    (tmp_path / "policy-step3" / "policy" / "adapter_config.json").write_text("{}")
    (tmp_path / "best.json").write_text(best)
    with pytest.raises(SystemExit, match="best.json is damaged"):
        pick_checkpoint(tmp_path, "best")


def test_a_scripted_partner_run_records_no_domain_and_prints_no_divergence_note(capsys):
    # before: config.json said "domain": "retail" for --env numbers, and the run printed the
    # "divergence alarm is off" note, which means nothing without a panel of simulators
    import train as train_cli
    from minscope.envs.numbers import Numbers
    from minscope.real_args import check_args

    args = train_cli.parse_args(["--env", "numbers", "--policy", "smollm2"])
    assert args.domain is None
    check_args(args, Numbers())
    assert "divergence alarm" not in capsys.readouterr().err
    assert train_cli.parse_args(["--env", "tau2", "--policy", "x"]).domain == "retail"


def test_report_dialogues_name_their_task_and_say_why_a_numbers_answer_scored_as_it_did():
    from minscope.envs.base import Episode, Turn, task_label
    from minscope.envs.numbers import Numbers
    from minscope.runner import dialogue

    env = Numbers()
    task = env.tasks()[0]
    ep = Episode(task=task, group=0, turns=[Turn("partner", task), Turn("agent", "50, or indeed 51")])
    ep.reward = env.score(ep)[0]
    d = dialogue(env, ep, "asker")
    assert d["task"] == task_label(task) == task and d["reward"] == 0.0
    assert "50" in d["note"] and "not above" in d["note"]
    assert "no number" in env.reward_note(Episode(task=task, group=0, turns=[Turn("agent", "fifty-one")]))
    assert task_label("x" * 100).endswith("…") and len(task_label("x" * 100)) == 40

    class WithId:
        id = 7
    assert task_label(WithId()) == "7"
