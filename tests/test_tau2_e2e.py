"""End to end on tau2-bench (mock domain) with real-architecture models: `train.py --env tau2`
runs a training step, `eval.py RUN_DIR --trials K` reports success and pass^k.

Tiny random Qwen3 models saved to disk; their chat template lists the tools (Qwen/Hermes
style), so the agent sees the official tool schemas. They never solve a task, so these
tests check the plumbing; pass^k itself is checked on scripted episodes.
"""

import json

import pytest

import eval as eval_cli
import train as train_cli
from minscope.envs.base import Episode, Turn
from minscope.models import build_tiny_model, build_tokenizer, load_model
from minscope.real_eval import tau2_summary

TINY = ["--groups", "2", "--group-size", "2", "--steps", "1", "--eval-every", "1", "--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def tau2_run(tmp_path_factory):
    """One `single` step on tau2 mock. The tokenizer is trained on the domain's prompts and
    tool schemas so that the long system prompts stay a few hundred tokens."""
    pytest.importorskip("tau2", reason="tau2-bench not installed (see requirements-tau2.txt)")
    from minscope.envs.tau2 import Tau2Env

    env = Tau2Env("mock")
    task = env.tasks("train")[0]
    corpus = [env.agent_messages(task)[0]["content"], env.partner_messages(task)[0]["content"],
              json.dumps(env.agent_tools(task))]
    tok = build_tokenizer(corpus, vocab_size=1000)
    model_dir = tmp_path_factory.mktemp("models") / "policy"
    build_tiny_model(tok, "qwen3", hidden_size=32).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    runs = tmp_path_factory.mktemp("runs")
    train_cli.main(["--env", "tau2", "--domain", "mock", "--policy", str(model_dir), "--method", "single",
                    "--runs-dir", str(runs), "--name", "mock", *TINY])
    return runs / "mock", model_dir


def records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


def test_the_chat_template_of_a_saved_tiny_model_lists_the_tools(tau2_run):
    from minscope.envs.tau2 import Tau2Env

    _, tok = load_model(str(tau2_run[1]))
    env = Tau2Env("mock")
    tools = env.agent_tools(env.tasks("train")[0])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert "<tools>" in text and all(t["function"]["name"] in text for t in tools)


def test_a_single_step_trains_and_evaluates_on_tau2_mock(tau2_run):
    run_dir = tau2_run[0]
    (step,) = records(run_dir, "train")
    assert step["step"] == 0 and 0.0 <= step["train_reward"] <= 1.0
    assert [r["step"] for r in records(run_dir, "eval")] == [0, 1]
    assert (run_dir / "policy-step1" / "policy" / "adapter_model.safetensors").is_file()


def test_eval_reports_success_per_domain_and_pass_hat_k(tau2_run):
    run_dir = tau2_run[0]
    eval_cli.main([str(run_dir), "--trials", "2", "--max-tasks", "2", "--transcripts", "1"])
    report = (run_dir / "report.md").read_text()
    assert "## Success per panel member" in report and "| mock |" in report
    assert "pass^1" in report and "pass^2" in report and "pass^3" not in report
    member = json.loads((run_dir / "eval.json").read_text())["members"]["train-simulator"]
    assert member["tasks"] == 2 and member["success"]["n"] == 4
    assert set(member["pass_hat_k"]) == {"1", "2"}
    assert sum(member["endings"].values()) == 4


def test_persona_guided_trains_on_tau2_with_the_built_in_bank_or_a_file(tau2_run, tmp_path):
    from minscope.envs.tau2 import Tau2Env

    bank = Tau2Env("mock").persona_bank()
    assert len(bank) == 10 and all(p and "\n\n" not in p for p in bank)
    (tmp_path / "mine.txt").write_text("Speaks only in questions.\n\nAlways in a hurry.\n")
    train_cli.main(["--env", "tau2", "--domain", "mock", "--policy", str(tau2_run[1]), "--method", "persona",
                    "--personas", str(tmp_path / "mine.txt"), "--runs-dir", str(tmp_path), "--name", "p", *TINY])
    (step,) = records(tmp_path / "p", "train")
    assert 0.0 <= step["train_reward"] <= 1.0
    with pytest.raises(SystemExit, match="no such file"):
        train_cli.main(["--env", "tau2", "--domain", "mock", "--policy", str(tau2_run[1]), "--method", "persona",
                        "--personas", str(tmp_path / "missing.txt"), "--runs-dir", str(tmp_path), "--name", "q", *TINY])


def test_tau2_summary_groups_trials_by_task_for_pass_hat_k():
    def ep(group, success):
        e = Episode(task=None, group=group, reward=float(success))
        e.info["tau2_termination"] = "user_stop"
        e.turns = [Turn("partner", "hi"), Turn("agent", "ok")]
        return e

    # task 0: 2 of 2 trials succeed; task 1: 1 of 2.
    s = tau2_summary([ep(0, 1), ep(0, 1), ep(1, 1), ep(1, 0)], trials=2)
    assert s["tasks"] == 2 and s["success"]["mean"] == pytest.approx(0.75)
    assert s["pass_hat_k"][1] == pytest.approx((1 + 0.5) / 2)
    assert s["pass_hat_k"][2] == pytest.approx((1 + 0) / 2)
    assert s["endings"] == {"user_stop": 4}
