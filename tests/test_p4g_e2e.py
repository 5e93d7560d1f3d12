"""End to end on Persuasion for Good with real-architecture models: `train.py --env p4g` for
every method, `--panel`, `--resume`, and `eval.py RUN_DIR` on the run.

The models are tiny random Qwen3 models saved to disk the way a downloaded model is, so the
real loading path (`load_model(dir)`: config, weights, tokenizer with chat template) runs.
Rewards are 0 (random models state no donations); these tests check the plumbing.
"""

import argparse
import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eval as eval_cli
import train as train_cli
from minscope.adapters import add_adapters, lora_parameters, save_adapter
from minscope.envs.base import Episode
from minscope.envs.p4g import P4GEnv
from minscope.methods import METHODS
from minscope.models import (
    CHATML_TEMPLATE,
    build_tiny_model,
    build_tokenizer,
    load_model,
)
from minscope.real_args import eval_tasks, parse_panel
from minscope.real_models import build_models
from minscope.real_eval import evaluate_run, p4g_summary
from minscope.runner import TIMING_KEYS

P4G_CSV = Path(__file__).parent / "fixtures" / "p4g" / "csv"
# oracle needs scripted real users (toy only); persona does not apply to P4G (its tasks are personas)
REAL_METHODS = [m for m in METHODS if m not in ("oracle", "persona")]
TINY = ["--groups", "2", "--group-size", "2", "--steps", "1", "--eval-every", "1", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny Qwen3 models saved like downloaded ones: "policy" and "other" (a different
    seed, for the panel). The tokenizer is trained on the P4G prompts so they stay short."""
    env = P4GEnv(P4G_CSV)
    corpus = [m["content"] for t in env.tasks("all")
              for m in env.agent_messages(t) + env.partner_messages(t)]
    tok = build_tokenizer(corpus, vocab_size=800)
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, seed in (("policy", 0), ("other", 1)):
        dirs[name] = root / name
        build_tiny_model(tok, "qwen3", hidden_size=32, seed=seed).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return {k: str(v) for k, v in dirs.items()}


def train(runs, model_dirs, method, *extra, name=None):
    train_cli.main(["--env", "p4g", "--data", str(P4G_CSV), "--policy", model_dirs["policy"],
                    "--method", method, "--runs-dir", str(runs), "--name", name or method, *TINY, *extra])
    return Path(runs) / (name or method)


def records(run_dir, kind):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, model_dirs):
    return train(tmp_path_factory.mktemp("runs"), model_dirs, "single",
                 "--panel", f"unseen:{model_dirs['other']}")


# --------------------------------------------------------------------------- models
def test_a_saved_tiny_model_loads_back_with_its_chat_template(model_dirs):
    model, tok = load_model(model_dirs["policy"])
    assert model.config.model_type == "qwen3"
    assert tok.chat_template == CHATML_TEMPLATE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- train.py
@pytest.mark.parametrize("method", REAL_METHODS)
def test_every_method_trains_a_step_and_evaluates(tmp_path, model_dirs, method):
    panel = f"{model_dirs['other']},unseen:{model_dirs['other']}"
    run_dir = train(tmp_path, model_dirs, method, "--panel", panel)
    (step,) = records(run_dir, "train")
    assert step["step"] == 0 and 0.0 <= step["train_reward"] <= 1.0
    evals = records(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 1]
    assert {"train-simulator", "other", "other-2", "seen", "unseen", "panel_mean"} <= set(evals[-1])
    for step in (0, 1):
        saved = run_dir / f"policy-step{step}" / "policy"
        assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
    assert (run_dir / "simulator-step1" / "simulator" / "adapter_model.safetensors").is_file() == \
        (method in ("cotrain", "population"))


def test_persona_guided_is_refused_on_p4g_before_any_model_loads(tmp_path):
    with pytest.raises(SystemExit, match="N/A on P4G"):
        train(tmp_path, {"policy": str(tmp_path / "no-such-model")}, "persona")


def test_ensemble_trains_against_every_seen_panel_member(tmp_path, model_dirs):
    run_dir = train(tmp_path, model_dirs, "ensemble", "--panel",
                    f"{model_dirs['other']},unseen:{model_dirs['other']}", "--groups", "2")
    (step,) = records(run_dir, "train")
    assert step["served_by"] == {"train-simulator": 1, "other": 1}   # groups rotate; unseen never


def test_saved_config_makes_model_and_data_paths_absolute(single_run):
    config = json.loads((single_run / "config.json").read_text())
    assert Path(config["policy"]).is_absolute() and Path(config["data"]).is_absolute()
    assert config["method"] == "single" and config["steps"] == 1


def test_max_turns_shortens_every_episode_of_training_and_of_eval(tmp_path, model_dirs):
    run_dir = train(tmp_path, model_dirs, "single", "--max-turns", "2")
    assert json.loads((run_dir / "config.json").read_text())["max_turns"] == 2
    (step,) = records(run_dir, "train")      # 2 groups x 2 episodes x 2 turns x 8 tokens at most
    assert 0 < step["tokens_generated"] <= 2 * 2 * 2 * 8
    episodes = evaluate_run(run_dir, episodes=1)["members"]["train-simulator"]["episodes"]
    assert episodes and all([t.role for t in ep.turns] == ["agent", "partner"] for ep in episodes)


def test_pool_draw_hardest_reaches_the_population_and_its_record_is_logged(tmp_path, model_dirs, monkeypatch):
    from minscope.simulators import Population

    draws, weights = [], Population.weights
    monkeypatch.setattr(Population, "weights", lambda self: draws.append(self.draw) or weights(self))
    run_dir = train(tmp_path, model_dirs, "population", "--pool-draw", "hardest")
    assert json.loads((run_dir / "config.json").read_text())["pool_draw"] == "hardest"
    assert draws and set(draws) == {"hardest"}
    (step,) = records(run_dir, "train")
    assert set(step["pool_scores"]) == {"0"} and 0.0 <= step["pool_scores"]["0"] <= 1.0


def test_resume_continues_exactly_where_the_run_stopped(tmp_path, model_dirs):
    whole = train(tmp_path, model_dirs, "population", "--steps", "2", name="whole")
    part = train(tmp_path, model_dirs, "population", "--steps", "1", name="part")
    train_cli.main(["--env", "p4g", "--resume", str(part), "--steps", "2"])
    for kind in ("train", "eval"):
        a, b = records(whole, kind), records(part, kind)
        assert [r["step"] for r in a] == [r["step"] for r in b]       # nothing logged twice
        for ra, rb in zip(a, b):
            for key in TIMING_KEYS:          # wall times differ between any two runs
                ra.pop(key, None), rb.pop(key, None)
            assert ra == rb
    final = {d: load_file(str(d / "policy-step2" / "policy" / "adapter_model.safetensors")) for d in (whole, part)}
    assert all(torch.equal(final[whole][k], final[part][k]) for k in final[whole])


def test_evaluating_more_often_does_not_change_training(tmp_path, model_dirs):
    often = train(tmp_path, model_dirs, "single", "--steps", "2", name="often")            # steps 0, 1, 2
    rarely = train(tmp_path, model_dirs, "single", "--steps", "2", "--eval-every", "2", name="rarely")
    assert len(records(often, "eval")) == 3 and len(records(rarely, "eval")) == 2
    a, b = records(often, "train"), records(rarely, "train")
    for r in a + b:
        for key in TIMING_KEYS:
            r.pop(key, None)
    assert len(a) == 2 and a == b


def test_a_new_run_does_not_overwrite_an_existing_one(single_run, model_dirs):
    with pytest.raises(SystemExit, match="--resume"):
        train(single_run.parent, model_dirs, "single")


def test_missing_data_is_a_clear_error(model_dirs, tmp_path):
    with pytest.raises(SystemExit, match="--data"):
        train_cli.main(["--env", "p4g", "--policy", model_dirs["policy"]])
    # a wrong path: one message (what is missing, where to get it), not a traceback
    with pytest.raises(SystemExit, match="error: Persuasion for Good data not found .*--data"):
        train_cli.main(["--env", "p4g", "--data", str(tmp_path / "nowhere"), "--policy", model_dirs["policy"]])


# --------------------------------------------------------------------------- panel
def test_panel_prefix_marks_unseen_members():
    assert parse_panel("a, unseen:b,seen:c") == [("a", "seen"), ("b", "unseen"), ("c", "seen")]


def test_an_adapter_directory_in_the_panel_is_loaded_onto_the_simulator_base(tmp_path, model_dirs, single_run):
    base, _ = load_model(model_dirs["policy"])
    random_adapter = add_adapters(base, ["policy"], init_lora_weights=False)
    save_adapter(random_adapter, "policy", tmp_path / "sim-adapter")
    args = json.loads((single_run / "config.json").read_text())
    models = build_models(argparse.Namespace(**args), panel_spec=f"unseen:{tmp_path / 'sim-adapter'}")
    speaker, kind = models.panel["sim-adapter"]
    assert kind == "unseen" and speaker.adapter == "panel0" and speaker.model is models.sim_model
    loaded = lora_parameters(models.sim_model, "panel0")
    saved = lora_parameters(random_adapter, "policy")
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k].detach(), saved[k].detach()) for k in saved)


def test_an_empty_test_split_falls_back_to_training_tasks_with_a_warning(tmp_path, capsys):
    # Keep only dialogues whose persuadee falls in the training split.
    train_ids = {t.id for t in P4GEnv(P4G_CSV).tasks("train")}
    with open(P4G_CSV / "full_info.csv", newline="") as f:
        info = list(csv.DictReader(f))
    keep = {r["B2"] for r in info if r["B4"] == "1" and r["B3"] in train_ids}
    for name in ("full_info.csv", "full_dialog.csv"):
        with open(P4G_CSV / name, newline="") as f:
            rows = list(csv.DictReader(f))
        with open(tmp_path / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(r for r in rows if r["B2"] in keep)
    env = P4GEnv(tmp_path)
    assert env.tasks("test") == [] and env.tasks("train")
    tasks, split = eval_tasks(env)
    assert split == "train" and [t.id for t in tasks] == [t.id for t in env.tasks("train")]
    assert "no test tasks" in capsys.readouterr().err


# --------------------------------------------------------------------------- eval.py
def test_eval_writes_a_report_of_the_p4g_run(single_run):
    eval_cli.main([str(single_run), "--episodes", "2", "--transcripts", "1"])
    report = (single_run / "report.md").read_text()
    for heading in ("## Reward per panel member", "## Donations", "## Dialogue", "## Training log",
                    "## Transcripts"):
        assert heading in report
    assert "persuader: " in report and "persuadee: " in report
    summary = json.loads((single_run / "eval.json").read_text())
    n_test = len(P4GEnv(P4G_CSV).tasks("test"))
    assert summary["step"] == 1 and summary["split"] == "test"
    assert set(summary["members"]) == {"train-simulator", "other"}
    assert summary["members"]["other"]["kind"] == "unseen"
    for member in summary["members"].values():
        assert member["reward"]["n"] == 2 * n_test
        assert sum(member["donation_bins"].values()) == 2 * n_test
        assert len(member["reward"]["ci95"]) == 2


def test_eval_plays_the_chosen_checkpoints_adapter(tmp_path, single_run, model_dirs):
    run = tmp_path / "run"
    shutil.copytree(single_run, run)
    base, _ = load_model(model_dirs["policy"])
    torch.manual_seed(1)
    save_adapter(add_adapters(base, ["policy"], init_lora_weights=False), "policy", run / "policy-step1")
    first_turn = lambda checkpoint: [ep.turns[0].text for ep in evaluate_run(   # noqa: E731
        run, episodes=1, checkpoint=checkpoint)["members"]["train-simulator"]["episodes"]]
    assert first_turn("0") != first_turn("latest")     # greedy opening: only the adapter differs


def test_p4g_summary_counts_donations_asks_and_length():
    def ep(donation, asks, turns):
        e = Episode(task=None, group=0, reward=min(donation / 2, 1))
        e.info.update(donation=donation, donation_stated=donation > 0, asks=asks, turns=turns, words=3 * turns)
        return e

    s = p4g_summary([ep(0.0, 0, 10), ep(0.5, 2, 10), ep(2.0, 1, 8)])
    assert s["donation_bins"] == {"$0": 1, "$0.01-0.49": 0, "$0.50-0.99": 1, "$1.00-1.49": 0,
                                  "$1.50-1.99": 0, "$2": 1}
    assert s["reward"]["mean"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert s["asks"] == pytest.approx(1.0) and s["any_ask"] == pytest.approx(2 / 3)
    assert s["turns"] == pytest.approx(28 / 3) and s["donation_stated"] == pytest.approx(2 / 3)
    # amounts between the labels' cents still land in exactly one bin
    odd = p4g_summary([ep(d, 0, 1) for d in (0.495, 0.995, 1.499, 1.999)])["donation_bins"]
    assert list(odd.values()) == [0, 1, 1, 1, 1, 0]


def test_a_copied_run_resumes_in_the_copy_and_leaves_the_original_alone(tmp_path, single_run):
    copy = tmp_path / "copy"
    shutil.copytree(single_run, copy)
    before = (single_run / "metrics.jsonl").read_text()
    train_cli.main(["--resume", str(copy), "--steps", "2"])
    assert [r["step"] for r in records(copy, "train")] == [0, 1]
    assert (single_run / "metrics.jsonl").read_text() == before and not (single_run / "policy-step2").exists()


def test_a_damaged_state_is_one_message_before_any_model_loads(tmp_path, single_run, monkeypatch):
    import minscope.real_models as real_models

    copy = tmp_path / "copy"
    shutil.copytree(single_run, copy)
    (copy / "state.pt").write_bytes((copy / "state.pt").read_bytes()[:100])
    monkeypatch.setattr(real_models, "build_models", lambda *a, **kw: pytest.fail("models loaded"))
    with pytest.raises(SystemExit, match="state.pt is damaged"):
        train_cli.main(["--resume", str(copy), "--steps", "2"])


# --------------------------------------------------------------------------- --p4g-reward expected
def test_the_expected_reward_reads_the_persuadee_through_its_kept_cache(model_dirs):
    """After the dialogue the persuadee is read at two decision points: the readings equal a
    reading of the whole conversation from scratch, while the readouts fed only the
    questions' few tokens; the dialogues are those of a parsed-reward rollout with the same
    seed (the decision is drawn after them). The decision's tokens end the persuadee's own
    stream, sampled (mask 1, their log-probs); the held-out question is not in it."""
    from minscope.envs.p4g import READOUTS
    from minscope.readout import DECISION_TOKENS
    from minscope.rollout import LMSpeaker, rollout
    from minscope.simulators import Frozen

    model, tok = load_model(model_dirs["policy"])
    model = add_adapters(model, ["policy", "simulator"], init_lora_weights=False)   # a persuadee that is not the base
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=1.0, max_new_tokens=6)
    persuadee = Frozen(model, tok, adapter="simulator", temperature=0.7, max_new_tokens=6)
    envs = {r: P4GEnv(P4G_CSV, split="all", max_turns=4, reward=r) for r in ("parsed", "expected")}
    eps = {r: rollout(env, env.tasks()[:2], policy, persuadee, group_size=2, seed=3) for r, env in envs.items()}
    assert [e.transcript() for e in eps["parsed"]] == [e.transcript() for e in eps["expected"]]
    fed = [e.info["tokens"]["partner"]["prefilled"] for e in eps["expected"]]
    without = [e.info["tokens"]["partner"]["prefilled"] for e in eps["parsed"]]
    for ep, a, b, before in zip(eps["expected"], fed, without, eps["parsed"]):
        n = len(before.info["streams"]["partner"].ids)
        assert 0 < a - b < 0.5 * n          # two readouts cost less than half the conversation once
        reads = ep.info["readouts"]
        assert set(reads) == set(READOUTS)
        for r in reads.values():
            assert 0 <= r["amount"] <= r["conditional"] + 1e-12 <= 2 + 1e-12 and 0 <= r["coverage"] <= 1
        assert ep.reward == pytest.approx(reads["decision"]["amount"] / 2) == ep.info["readout_decision"]
        assert ep.info["readout_coverage"] == reads["decision"]["coverage"]
        assert 0 <= ep.info["readout_asked"] <= 1 and "reward_parsed" in ep.info and "reward_sampled" in ep.info
        stream = ep.info["streams"]["partner"]
        assert stream.ids[:n] == before.info["streams"]["partner"].ids      # the dialogue, then the decision
        assert stream.mask[-DECISION_TOKENS:] == [1] * DECISION_TOKENS
        assert all(lp < 0 for lp in stream.logp[-DECISION_TOKENS:])
        assert READOUTS["decision"][0] in stream.text and READOUTS["asked"][0] not in stream.text
        assert stream.text.endswith("[DONATE $" + ep.info["decision_text"])
    for name, (question, prefix) in READOUTS.items():     # from scratch: no cache, the dialogue's streams
        for ep, before in zip(eps["expected"], eps["parsed"]):
            ep.info["streams"]["partner"] = before.info["streams"]["partner"]
        again = persuadee.read_amount(eps["expected"], envs["expected"], question, prefix)
        for ep, r in zip(eps["expected"], again):
            for key in ("amount", "conditional", "coverage"):
                assert r[key] == pytest.approx(ep.info["readouts"][name][key], abs=1e-5), name


def test_a_simulator_update_moves_the_decision_it_is_paid_for(model_dirs):
    """Co-Training's update trains the persuadee's sampled decision: one step with advantage
    +1 on every episode raises the log-probability of the decisions it sampled (their sum: the
    episodes share parameters, so single ones may move either way), and from the same start
    one with -1 lowers it."""
    from minscope.adapters import use_adapter
    from minscope.batch import training_batch
    from minscope.readout import DECISION_TOKENS
    from minscope.rollout import LMSpeaker, rollout
    from minscope.simulators import Trainable
    from minscope.trainer import UpdateConfig, grpo_update, make_optimizer

    model, tok = load_model(model_dirs["policy"])
    model = add_adapters(model, ["policy", "simulator"], init_lora_weights=False)
    policy = LMSpeaker(model, tok, "agent", adapter="policy", temperature=1.0, max_new_tokens=4)
    persuadee = Trainable(model, tok, temperature=1.0, max_new_tokens=4)
    env = P4GEnv(P4G_CSV, split="all", max_turns=2, reward="expected")
    eps = rollout(env, env.tasks()[:2], policy, persuadee, group_size=4, seed=0)
    for ep in eps:        # train the decision tokens only, so that only they can move them
        s = ep.info["streams"]["partner"]
        s.mask = [0] * (len(s.mask) - DECISION_TOKENS) + [1] * DECISION_TOKENS
    batch = training_batch(eps, "partner", tok.pad_token_id)
    ends = (batch.attention_mask.sum(1) - 1).tolist()          # the last target position of each row

    def decision_logp():
        model.eval()
        with torch.no_grad(), use_adapter(model, "simulator"):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        lp = torch.log_softmax(logits.double(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        return torch.stack([lp[r, e - DECISION_TOKENS:e].sum() for r, e in enumerate(ends)])

    start = {n: p.detach().clone() for n, p in model.named_parameters() if "simulator" in n}
    before = decision_logp()
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in start:
                    p.copy_(start[n])
        cfg = UpdateConfig(lr=1e-3)
        adv = torch.full((len(eps),), sign, dtype=torch.float64)
        grpo_update(model, "simulator", make_optimizer(model, "simulator", cfg), eps, "partner", adv, cfg,
                    tok.pad_token_id)
        moved = (decision_logp() - before) * sign
        assert moved.sum() > 0.1, (sign, moved)


def test_a_run_with_the_expected_reward_logs_every_reading(tmp_path, model_dirs, capsys):
    run_dir = train(tmp_path, model_dirs, "population", "--p4g-reward", "expected", "--max-turns", "2")
    (step,) = records(run_dir, "train")
    assert step["train_reward"] == pytest.approx(step["readout_decision"])
    readings = {"readout_decision", "readout_asked", "reward_parsed", "reward_sampled", "readout_coverage"}
    for rec in (step, *records(run_dir, "eval")):
        assert readings | {"readout_decision_conditional", "readout_asked_conditional"} <= set(rec)
        assert rec["readout_decision"] <= rec["readout_decision_conditional"] + 1e-9
    low = [r["readout_coverage"] < 0.9 for r in (step, *records(run_dir, "eval"))]   # said once for each
    assert capsys.readouterr().out.count("warning: readout coverage under 0.9") == sum(low)
    assert ("**Warning**: readout coverage" in (run_dir / "report.md").read_text()) == any(low)
    assert len(step["group_std"]) == 3              # the groups' spreads beside the std floor
    from minscope.envs.p4g import PROBE_MESSAGES
    evals = records(run_dir, "eval")                # the trained persuadee, and its pool once it has one
    assert any(k.startswith("pool, step") for k in evals[-1]["probe"])
    for rec in evals:
        assert "live" in rec["probe"]
        for member in rec["probe"].values():
            assert set(member) == set(PROBE_MESSAGES) and all(0 <= v <= 2 for v in member.values())
    assert "The trained persuadee on the probe set" in (run_dir / "report.md").read_text()
    # the evaluations' table has a column per panel member, never one per reading (before: the
    # conditional amounts and the refusal shares were drawn as if they were members)
    header = next(ln for ln in (run_dir / "report.md").read_text().splitlines() if ln.startswith("| step | train-"))
    assert not any(k in header for k in ("conditional", "refusal", "readout_"))
    res = evaluate_run(run_dir, episodes=1, max_tasks=2)          # eval.py: the same readings per member
    for member in res["members"].values():
        assert set(member["summary"]["readings"]) == readings
        assert member["summary"]["readings"]["readout_decision"] == pytest.approx(member["summary"]["reward"]["mean"])
    with pytest.raises(SystemExit):           # a flag of P4G's only
        train_cli.main(["--env", "numbers", "--policy", model_dirs["policy"], "--p4g-reward", "expected"])
