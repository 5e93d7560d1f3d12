"""Run folders you can trust: a resume never deletes what a run logged, a run folder records
the format it was written in, one trainer per folder whatever pid namespace or host it runs
in, and a record with a field of the wrong type is one message (or a skipped field), never a
traceback."""

import json
from pathlib import Path

import pytest

import train as train_cli
from minscope.models import build_tiny_model


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
