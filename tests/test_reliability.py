"""Runs that cannot be lost, corrupted or poisoned, and command lines that fail with one
clear message: resuming a moved run, the run lock, Ctrl-C, the model cache, eval.py's
results, non-finite numbers, evaluator errors, and argument checks."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eval as eval_cli
import train as train_cli
from minscope import experiment, files
from minscope.adapters import add_adapters
from minscope.envs.wordgame import Asker, WordGame
from minscope.errors import RunStopped
from minscope.methods import build_method, train_step
from minscope.models import build_tiny_model
from minscope.rollout import LMSpeaker, rollout
from minscope.runfolder import FORMAT_VERSION, format_fields
from minscope.toy_models import ToyModelConfig, ToyModels
from minscope.trainer import MAX_NONFINITE_IN_A_ROW, UpdateConfig, grpo_update

ROOT = Path(__file__).resolve().parents[1]
TINY_MODELS = ToyModelConfig(hidden=32, vocab=640, transcripts=120, vs_examples=40, sim_a_steps=10, vs_steps=10,
                             sim_steps=5, policy_steps=5, aligned_steps=10, batch=8, workers=1)


def tiny_config(name="toy", methods=("single",), seeds=(0,), steps=2, workers=1):
    return experiment.ToyConfig(name=name, methods=methods, seeds=seeds, steps=steps, groups=2, group_size=2,
                                eval_every=2, eval_episodes=1, final_episodes=4, meter_every=0,
                                workers=workers, models=TINY_MODELS, ablations=())


# --------------------------------------------------------------------------- 1. resume where the run is
def saved_run(run_dir, cfg):
    """A run folder as train.py leaves it before the arms start (its fidelity check done)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({**experiment.asdict(cfg), **format_fields()}, default=list))
    (run_dir / "fidelity.json").write_text("{}")
    return run_dir


def test_train_py_resumes_a_moved_toy_run_in_its_own_folder(tmp_path, monkeypatch):
    moved = saved_run(tmp_path / "moved", tiny_config(name="qa3"))
    used = []

    def fake_run(cfg, runs_dir, cache_dir, resume=False, run_dir=None, **kw):
        used.append(Path(run_dir) if run_dir is not None else Path(runs_dir) / cfg.name)
        raise KeyboardInterrupt
    monkeypatch.setattr(experiment, "run", fake_run)
    with pytest.raises(SystemExit):
        train_cli.main(["--resume", str(moved)])
    assert used == [moved]


def test_a_resumed_run_works_in_the_folder_it_is_given(tmp_path, monkeypatch):
    cfg = tiny_config(name="qa3")
    copy = saved_run(tmp_path / "elsewhere" / "copy", cfg)
    seen = []
    monkeypatch.setattr(experiment, "_run", lambda cfg, run_dir, *a: seen.append((run_dir / "lock").exists()) or run_dir)
    assert experiment.run(cfg, tmp_path / "runs", None, resume=True, run_dir=copy) == copy
    assert seen == [True] and not (copy / "lock").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]       # no runs/qa3 made


# --------------------------------------------------------------------------- 3. the run lock
@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_folder_in_use_by_a_live_process_is_refused(tmp_path, live_pid):
    (tmp_path / "lock").write_text(f"{live_pid}\n")
    with pytest.raises(SystemExit, match=f"in use: process {live_pid}"):
        files.RunLock(tmp_path).acquire()
    assert (tmp_path / "lock").read_text() == f"{live_pid}\n"


def test_the_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path, dead_pid):
    (tmp_path / "lock").write_text(f"{dead_pid}\n")
    notes = []
    lock = files.RunLock(tmp_path, warn=notes.append).acquire()
    assert (tmp_path / "lock").read_text().startswith(f"{os.getpid()}\n")
    assert len(notes) == 1 and f"process {dead_pid}, which is no longer running" in notes[0]
    lock.release()
    assert not (tmp_path / "lock").exists()


def test_resuming_a_live_toy_run_changes_nothing(tmp_path, live_pid):
    run_dir = tmp_path / "toy"
    run_dir.mkdir()
    config = {**experiment.asdict(tiny_config()), **format_fields()}
    (run_dir / "config.json").write_text(json.dumps(config, default=list))
    (run_dir / "lock").write_text(f"{live_pid}\n")
    with pytest.raises(SystemExit, match="in use"):
        train_cli.main(["--resume", str(run_dir), "--cache-dir", str(tmp_path / "no-cache")])
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "lock"]
    assert not (tmp_path / "no-cache").exists()


# --------------------------------------------------------------------------- 4. Ctrl-C
def test_ctrl_c_stops_every_worker_at_once_queued_jobs_included(tmp_path):
    import _pool_jobs

    jobs = [(0.5 if i == 0 else 4.0, tmp_path / f"job{i}") for i in range(6)]

    def ctrl_c(result):      # Ctrl-C arrives in the parent after the first job is done
        raise KeyboardInterrupt
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        experiment.run_pool(_pool_jobs.sleep_then_touch, jobs, 2, ctrl_c, initializer=_pool_jobs.ignore_ctrl_c)
    assert time.time() - t0 < 4.0 + 30            # spawning two workers, not six 4 s jobs
    time.sleep(4.5)                                # a worker left running would finish its job now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job0"]


# --------------------------------------------------------------------------- 5. the model cache
@pytest.fixture
def fast_sft(monkeypatch):
    """Tiny models trained for no steps: the cache logic does not depend on the weights."""
    import minscope.toy_models as toy_models

    monkeypatch.setattr(toy_models, "sft", lambda *a, steps, **kw: [0.0])
    return ToyModelConfig(hidden=32, vocab=640, transcripts=20, batch=8, workers=1)


@pytest.mark.parametrize("damage", [lambda entry: (entry / "config.json").write_text(""),
                                    lambda entry: (entry / "model.safetensors").unlink(),
                                    lambda entry: (entry / "model.safetensors").write_bytes(b"\0" * 10)])
def test_a_damaged_cache_entry_is_rebuilt_with_one_line(tmp_path, fast_sft, damage):
    models = ToyModels(tmp_path, fast_sft, progress=False, log=lambda *a: None)
    models.get("sim-b")
    damage(models.dir / "sim-b")
    lines = []
    models = ToyModels(tmp_path, fast_sft, progress=False, log=lines.append)
    assert models.get("sim-b") is not None and (models.dir / "sim-b" / "config.json").stat().st_size > 0
    assert len([ln for ln in lines if "does not load" in ln]) == 1
    assert ToyModels(tmp_path, fast_sft, progress=False, log=lines.append).get("sim-b") is not None
    assert len([ln for ln in lines if "does not load" in ln]) == 1     # rebuilt for good


def test_a_model_build_killed_while_saving_leaves_nothing_cached(tmp_path, monkeypatch, fast_sft):
    from transformers import PreTrainedModel

    cfg = fast_sft
    save = PreTrainedModel.save_pretrained

    def killed(self, path, *a, **kw):
        save(self, path, *a, **kw)
        (Path(path) / "model.safetensors").write_bytes(b"")       # half-written
        raise KeyboardInterrupt
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", killed)
    models = ToyModels(tmp_path, cfg, progress=False, log=lambda *a: None)
    with pytest.raises(KeyboardInterrupt):
        models.get("sim-b")
    assert not (models.dir / "sim-b").exists()


# --------------------------------------------------------------------------- 6. eval.py keeps old results
def test_eval_keeps_the_previous_results_when_it_fails_halfway(tmp_path, monkeypatch):
    cfg = tiny_config(methods=("single", "vs"))
    run_dir = tmp_path / "toy"
    (run_dir / "arms").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({**experiment.asdict(cfg), **format_fields()}, default=list))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0}) + "\n")
    (run_dir / "eval.jsonl").write_text('{"old": 1}\n')
    (run_dir / "arms" / "single-s0.pt").write_bytes(b"")         # truncated by a crash
    monkeypatch.setattr(experiment, "Toy", lambda *a, **kw: object())
    with pytest.raises(SystemExit, match="single-s0.pt is damaged"):
        eval_cli.main([str(run_dir)])
    assert (run_dir / "eval.jsonl").read_text() == '{"old": 1}\n'


# --------------------------------------------------------------------------- 2 and 7. rewards
class Scored(WordGame):
    """The word game with a scoring function of the test's choosing."""

    def __init__(self, score):
        super().__init__()
        self._score = score

    def score(self, episode):
        return self._score(episode)


@pytest.fixture
def policy(tokenizer):
    torch.manual_seed(0)
    model = add_adapters(build_tiny_model(tokenizer, "qwen3", hidden_size=32), ["policy"], init_lora_weights=False)
    return LMSpeaker(model, tokenizer, "agent", adapter="policy", max_new_tokens=3)


def test_an_evaluator_error_scores_0_is_kept_and_counted_and_training_goes_on(policy, tokenizer):
    def score(ep):
        if ep.task == "river":
            raise ValueError("Task task_2 not found")
        return 1.0, {}
    env = Scored(score)
    m = build_method("single", policy, [Asker()], UpdateConfig(lr=1e-3))
    metrics = train_step(m, env, ["apple", "river"], 2, step=0)
    episodes = metrics["_episodes"]
    assert metrics["score_errors"] == 2 and metrics["train_reward"] == 0.5
    assert [ep.reward for ep in episodes if ep.task == "river"] == [0.0, 0.0]
    assert all(ep.info["score_error"] == "ValueError: Task task_2 not found" for ep in episodes if ep.task == "river")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_naming_the_task(policy, bad):
    env = Scored(lambda ep: (bad if ep.task == "stone" else 1.0, {}))
    with pytest.raises(RunStopped, match=f"task 'stone' with a non-finite reward \\({bad}\\)"):
        rollout(env, ["apple", "stone"], policy, Asker(), group_size=2)


def lora_values(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_a_non_finite_gradient_skips_the_step_and_three_in_a_row_stop(policy, tokenizer):
    env = WordGame()
    m = build_method("single", policy, [Asker()], UpdateConfig(lr=1e-2, epochs=1))
    episodes = rollout(env, env.tasks()[:2], policy, Asker(), group_size=2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    param = next(p for n, p in policy.model.named_parameters() if "lora_B" in n and "policy" in n)
    hook = param.register_hook(lambda g: g * float("inf"))
    before = lora_values(policy.model)
    for _ in range(MAX_NONFINITE_IN_A_ROW - 1):
        out = grpo_update(policy.model, "policy", m.policy_opt, episodes, "agent", adv, m.policy_cfg, policy.tokenizer.pad_token_id)
        assert out["skipped_steps"] == 1 and out["grad_norm"] == 0.0
    after = lora_values(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)     # nothing applied, nothing NaN
    with pytest.raises(RunStopped, match="3 optimiser steps in a row"):
        grpo_update(policy.model, "policy", m.policy_opt, episodes, "agent", adv, m.policy_cfg, policy.tokenizer.pad_token_id)
    hook.remove()
    out = grpo_update(policy.model, "policy", m.policy_opt, episodes, "agent", adv, m.policy_cfg, policy.tokenizer.pad_token_id)
    assert out["skipped_steps"] == 0 and all(torch.isfinite(p).all() for p in lora_values(policy.model).values())


def test_a_non_finite_loss_is_skipped_and_counted_in_the_step_metrics(policy, monkeypatch):
    import minscope.methods as methods

    env = WordGame()
    m = build_method("single", policy, [Asker()], UpdateConfig(lr=1e-2, epochs=2))
    monkeypatch.setattr(methods, "group_advantages",
                        lambda r, g, **kw: (torch.full_like(r, float("nan")), torch.zeros(len(r) // g, dtype=torch.bool)))
    before = lora_values(policy.model)
    metrics = train_step(m, env, env.tasks()[:2], 2, step=0)
    assert metrics["skipped_steps"] == 2 and metrics["policy_loss"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in lora_values(policy.model).items())


# --------------------------------------------------------------------------- bad input
def fails_with(capsys, argv, message, cli=train_cli):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["--method", "foo"], "--method is for real-model runs"),
    (["--method", "vs"], "--method is for real-model runs"),
    (["--methods", "foo"], "unknown arm(s) foo"),
    (["--methods", "single,"], "an empty entry"),
    (["--ablations", "cotrain:sideways"], "cannot read 'cotrain:sideways'"),
    (["--ablations", "cotrain:curriculum+group"], "zero advantages"),   # curriculum + group-wise
    (["--seeds", "a"], "--seeds 'a': give whole numbers"),
    (["--seeds", "0,0"], "a seed is repeated"),
    (["--steps", "-1"], "argument --steps: must be 0 or more, not -1"),
    (["--steps", "x"], "argument --steps: expected a whole number, not 'x'"),
    (["--group-size", "0"], "argument --group-size: must be 2 or more, not 0"),
    (["--workers", "0"], "argument --workers: must be 1 or more"),
    (["--lr", "1e-3"], "--lr is for real-model runs"),
    (["--max-turns", "4"], "--max-turns is for real-model runs"),
    (["--pool-draw", "hardest"], "--pool-draw is for real-model runs"),
])
def test_bad_toy_arguments_are_one_message_before_anything_is_created(tmp_path, capsys, argv, message):
    fails_with(capsys, argv + ["--runs-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache")], message)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_toy_group_settings_reach_the_config(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(experiment, "run", lambda cfg, *a, **kw: seen.setdefault("cfg", cfg) and 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train_cli.main(["--quick", "--group-size", "3", "--groups", "5", "--eval-every", "4",
                        "--runs-dir", str(tmp_path)])
    assert (seen["cfg"].group_size, seen["cfg"].groups, seen["cfg"].eval_every) == (3, 5, 4)


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "0"], "must be 2 or more, not 0"),
    (["--group-size", "-1"], "must be 2 or more, not -1"),
    (["--groups", "0"], "argument --groups: must be 1 or more"),
    (["--eval-every", "0"], "argument --eval-every: must be 1 or more"),
    (["--micro-batch", "0"], "argument --micro-batch: must be 1 or more"),
    (["--steps", "-1"], "argument --steps: must be 0 or more"),
    (["--lr", "nan"], "argument --lr: must be a finite number above 0"),
    (["--method", "foo"], "--method 'foo': choose one of"),
    (["--seeds", "1"], "--seeds is for the toy experiment"),
    (["--quick"], "--quick is for the toy experiment"),
    (["--max-turns", "0"], "argument --max-turns: must be 1 or more, not 0"),
    (["--max-turns", "3"], "--max-turns 3: P4G needs an even number"),
    (["--env", "cooperbench", "--max-turns", "4"], "--max-turns is for --env p4g|tau2, not --env cooperbench (cooperbench: --coder-turns)"),
    (["--pool-draw", "hardest"], "--pool-draw is for --method population, not --method single"),
    (["--method", "population", "--pool-draw", "worst"], "argument --pool-draw: invalid choice"),
    # extremes that broke the arithmetic later, with a traceback
    (["--temperature", "1e-300"], "--temperature 1e-300: give 0.01 or more"),
    (["--eval-temperature", "1e-300"], "--eval-temperature 1e-300: give 0 (greedy) or a finite number from 0.01 up"),
    (["--lr", "1e300"], "--lr 1e+300: give at most 1"),
    (["--sim-lr", "5"], "--sim-lr 5: give at most 1"),
    (["--seed", str(10**29)], f"--seed {10**29}: give a whole number from 0 to 4294967295"),
    # --name leaving RUNS_DIR
    (["--name", "../x"], "--name '../x': give a plain folder name"),
    (["--name", "/tmp/x"], "--name '/tmp/x': give a plain folder name"),
    (["--name", ""], "--name '': give a plain folder name"),
    (["--name", ".."], "--name '..': give a plain folder name"),
    (["--domain", "airline"], "--domain is for --env tau2, not --env p4g"),
])
def test_bad_real_arguments_are_one_message_before_any_model_loads(tmp_path, capsys, argv, message):
    fails_with(capsys, ["--env", "p4g", "--data", str(tmp_path), "--policy", str(tmp_path / "no-model"),
                        "--runs-dir", str(tmp_path / "runs")] + argv, message)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("episodes", ["0", "-1"])
def test_eval_refuses_a_non_positive_episode_count(tmp_path, capsys, episodes):
    fails_with(capsys, [str(tmp_path), "--episodes", episodes], "argument --episodes: must be 1 or more",
               cli=eval_cli)


# --------------------------------------------------------------------------- damaged run files
@pytest.fixture
def saved_toy_run(tmp_path):
    """A toy run folder as an interrupted run leaves it: config, one arm's log and state."""
    cfg = tiny_config()
    run_dir = tmp_path / "toy"
    (run_dir / "arms").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({**experiment.asdict(cfg), **format_fields()}, default=list))
    lines = [{"kind": "eval", "method": "single", "seed": 0, "step": 0, "real_users": 0.5},
             {"kind": "train", "method": "single", "seed": 0, "step": 0}]
    (run_dir / "arms" / "single-s0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    files.save_atomic({"step": 0, "policy": {}}, run_dir / "arms" / "single-s0.pt")
    (run_dir / "metrics.jsonl").write_text((run_dir / "arms" / "single-s0.jsonl").read_text())
    return run_dir


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "arms" / "single-s0.pt").write_bytes(b""), "single-s0.pt is damaged"),
    (lambda d: (d / "arms" / "single-s0.pt").write_bytes(
        (d / "arms" / "single-s0.pt").read_bytes()[:50]), "single-s0.pt is damaged"),
    (lambda d: (d / "config.json").write_text('{"name": "toy", '), "config.json is damaged"),
    (lambda d: (d / "config.json").write_text(
        json.dumps({"name": "toy", "models": {}, "colour": 1, "format": FORMAT_VERSION})),
     "is not the config.json of a toy run"),
    (lambda d: (d / "arms" / "single-s0.jsonl").write_text('{"kind": "ev\n{"kind": "train", "step": 0}\n'),
     "single-s0.jsonl is damaged: line 1"),
])
def test_a_damaged_run_file_is_one_message_naming_it(saved_toy_run, capsys, damage, message):
    damage(saved_toy_run)
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--resume", str(saved_toy_run), "--cache-dir", str(saved_toy_run / "no-cache")])
    assert message in str(e.value.code)
    assert not (saved_toy_run / "no-cache").exists()   # refused before any model was built


def test_a_half_written_last_log_line_is_dropped_with_a_note(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "kind": "tr')
    files.truncate_log(path, 5)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert "half-written last line 3" in capsys.readouterr().err


def test_report_only_on_a_damaged_log_is_one_message(saved_toy_run):
    log = saved_toy_run / "metrics.jsonl"
    log.write_text("garbage\n" + log.read_text())
    with pytest.raises(SystemExit, match="metrics.jsonl is damaged: line 1"):
        eval_cli.main([str(saved_toy_run), "--report-only"])


@pytest.mark.parametrize("argv", [["--quick"], ["--methods", "single"], ["--seeds", "4"], ["--name", "x"],
                                  ["--method", "vs"], ["--lr", "0.1"]])
def test_resume_refuses_flags_that_would_change_the_run(saved_toy_run, capsys, argv):
    err = fails_with(capsys, ["--resume", str(saved_toy_run)] + argv, "would change them")
    assert argv[0] in err


def test_resume_of_a_real_run_refuses_a_different_method_and_accepts_the_same_one(tmp_path, capsys):
    run_dir = tmp_path / "p4g-single"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                     "env": "p4g", "method": "single", "lr": 1e-5, "steps": 2}))
    fails_with(capsys, ["--resume", str(run_dir), "--method", "vs"], "--method would change them")
    fails_with(capsys, ["--resume", str(run_dir), "--lr", "0.001"], "--lr would change them")
    args = train_cli.parse_args(["--resume", str(run_dir), "--method", "single", "--steps", "4"])
    assert args.steps == 4


# --------------------------------------------------------------------------- results across processes
def test_best_adaptive_value_is_the_same_in_every_process():
    code = "from minscope.envs.toy_world import World; print(repr(float(World().best_adaptive()[0])))"
    outs = set()
    for seed in ("0", "5"):   # these two orders differed in the last bit
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout)
    assert len(outs) == 1, outs


def test_a_damaged_p4g_file_is_one_error_line_before_any_model_loads(tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(Path(__file__).parent / "fixtures" / "p4g" / "csv", data)
    dialog = data / "full_dialog.csv"
    dialog.write_text(dialog.read_text().replace(",B4,", ",B3,", 1))     # a renamed column
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--env", "p4g", "--data", str(data), "--policy", str(tmp_path / "no-model"),
                        "--runs-dir", str(tmp_path / "runs")])
    assert str(e.value.code).startswith("error: ") and "full_dialog.csv" in str(e.value.code)
    assert "Traceback" not in capsys.readouterr().err and not (tmp_path / "runs").exists()
