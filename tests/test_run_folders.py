"""Run folders you can trust: a resume never deletes what a run logged, a run folder records
the format it was written in, one trainer per folder whatever pid namespace or host it runs
in, and a record with a field of the wrong type is one message (or a skipped field), never a
traceback."""

import json
import shutil
from pathlib import Path

import pytest

import eval as eval_cli
import train as train_cli
from minscope import experiment
from minscope.models import build_tiny_model
from minscope.runfolder import FORMAT_VERSION, FORMATS


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
    assert f"was written in run-folder format {found} ({FORMATS[found]}), this code writes format " \
           f"{FORMAT_VERSION} (changed since: format {FORMAT_VERSION}: {FORMATS[FORMAT_VERSION]})" in message
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
