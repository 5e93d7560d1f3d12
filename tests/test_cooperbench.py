"""CooperBench without Docker: the official evaluation (runner.sh, test_merged) on a tiny task
in the official layout, the two-coder episode through the rollout engine, and (with
MINSCOPE_COOPERBENCH_DATA set) the reference verdicts of two real tasks.

The fixture task: a repository with calc.py and tests/test_calc.py; feature 1 adds sub() and
feature 2 adds mul() at the same place in calc.py (a plain merge conflicts, the union merge
keeps both), feature 3 adds a new file greet.py. Its tests run with the running interpreter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minscope import sandbox
from minscope.envs import cooperbench_eval as ev
from minscope.envs import cooperbench_local as cb_local
from minscope.envs import cooperbench_task as cb_task
from minscope.envs.base import Episode, Turn
from minscope.envs.cooperbench import CooperBenchEnv, read_subset
from minscope.rollout import rollout
from minscope.stream import view_messages
from minscope.toolcalls import format_tool_call

NAME = "toy_calc_task/task1"
# (plugins of this interpreter, e.g. hypothesis, would add seconds to every test run)
SPEC = cb_task.TaskSpec(".", python=sys.executable, env=(("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1"),))
BASE_CALC = '"""A tiny calculator."""\n\n\ndef add(a, b):\n    return a + b\n\n# more operations go here\n'
BASE_TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
GOLD = {  # feature -> (source files, test files)
    1: ({"calc.py": BASE_CALC.replace("a + b\n", "a + b\n\n\ndef sub(a, b):\n    return a - b\n")},
        {"tests/test_calc.py": BASE_TEST + "\n\ndef test_sub():\n    from calc import sub\n    assert sub(5, 3) == 2\n"}),
    2: ({"calc.py": BASE_CALC.replace("a + b\n", "a + b\n\n\ndef mul(a, b):\n    return a * b\n")},
        {"tests/test_calc.py": BASE_TEST + "\n\ndef test_mul():\n    from calc import mul\n    assert mul(4, 3) == 12\n"}),
    3: ({"greet.py": 'def greet(name):\n    return f"hello {name}"\n'},
        {"tests/test_greet.py": 'from greet import greet\n\n\ndef test_greet():\n    assert greet("bo") == "hello bo"\n'}),
}
FEATURE_TEXT = {1: "Add sub(a, b) to calc.py: returns a - b.", 2: "Add mul(a, b) to calc.py: returns a * b.",
                3: "Add greet.py with greet(name) returning 'hello <name>'."}
RUNNER = """#!/bin/bash
set -e
TEST_PATCH="$1"
FEATURE_PATCH="$2"
cd /workspace/repo
git reset --hard HEAD
git clean -fdx
if [[ -n "$FEATURE_PATCH" ]]; then
    git apply --ignore-whitespace --ignore-space-change "/patches/$FEATURE_PATCH" || git apply --3way "/patches/$FEATURE_PATCH"
fi
git apply --ignore-whitespace --ignore-space-change "/patches/$TEST_PATCH" || git apply --3way "/patches/$TEST_PATCH"
pip install -e ".[test]" || pip install -e .
pip install pytest pytest-xdist pytest_mock
python -m pytest tests -v
"""


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, env=cb_local.git_env(cwd), capture_output=True, text=True,
                          check=True).stdout


def diff_of(repo: Path, files: dict) -> str:
    """The patch that writes `files` on the repository's HEAD (new files included)."""
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    patch = git(repo, "diff", "--cached", "HEAD")
    git(repo, "reset", "-q", "--hard", "HEAD")
    git(repo, "clean", "-qfdx")
    return patch


def make_task(root: Path) -> tuple[Path, Path]:
    """A base repository (a git clone) and a three-feature task in the official layout."""
    repo = root / "repos" / "toy_calc"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(BASE_CALC)
    (repo / "tests" / "test_calc.py").write_text(BASE_TEST)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    sha = git(repo, "rev-parse", "HEAD").strip()
    task = root / "dataset" / "toy_calc_task" / "task1"
    task.mkdir(parents=True)
    (task / "runner.sh").write_text(RUNNER)
    (task / "setup.sh").write_text(f'REPO_NAME="toy-calc"\nBASE_COMMIT="{sha}"\n')
    (task / "Dockerfile").write_text(f"RUN git clone https://example.invalid/toy_calc.git repo && git checkout {sha}\n")
    for f, (source, tests) in GOLD.items():
        d = task / f"feature{f}"
        d.mkdir()
        (d / "feature.md").write_text(FEATURE_TEXT[f] + "\n")
        (d / "feature.patch").write_text(diff_of(repo, source))
        (d / "tests.patch").write_text(diff_of(repo, tests))
    return task, repo


def need_bwrap():
    """Model-written code runs only in the sandbox: without bwrap these tests fail in CI (which
    installs it) and are skipped, saying why, elsewhere."""
    reason = sandbox.unavailable()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must test the sandbox for real: {reason}")
    if reason:
        pytest.skip(f"no sandbox on this machine ({reason}); install bubblewrap to run these tests")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    need_bwrap()
    return make_task(tmp_path_factory.mktemp("cooperbench"))


def gold(task, f):
    return (task / f"feature{f}" / "feature.patch").read_text()


# --------------------------------------------------------------------------- the evaluator
def test_the_manifest_and_runner_sh_give_the_test_settings(toy, tmp_path):
    task, _ = toy
    assert cb_task.runner_tests(task) == ([["pytest", "tests", "-v"]], None)
    (tmp_path / "runner.sh").write_text("pip install pytest\nPYTHONPATH=src timeout 300 python -m pytest "
                                        "tests/test_a.py -v 2>&1 | tee log\n")
    assert cb_task.runner_tests(tmp_path) == ([["pytest", "tests/test_a.py", "-v"]], 300)
    spec = cb_task.task_spec(task, SPEC)
    assert spec.tests == (("pytest", "tests", "-v"),) and spec.timeout == cb_task.DEFAULT_TIMEOUT
    with pytest.raises(cb_task.EvalError, match="toy_calc_task/task1 is not one of the pure-Python tasks"):
        cb_task.task_spec(task)
    assert cb_task.MANIFEST["pallets_click_task/task2068"].import_root == "src"


def test_each_feature_fails_without_its_gold_patch_and_passes_with_it(toy):
    task, repo = toy
    for f in (1, 2, 3):
        without = ev.evaluate_feature(task, repo, f, "", spec=SPEC)
        with_gold = ev.evaluate_feature(task, repo, f, gold(task, f), spec=SPEC)
        assert not without["passed"] and without["rc"] != 0
        assert with_gold["passed"] and with_gold["rc"] == 0 and with_gold["tests_failed"] == 0
        assert with_gold["tests_passed"] == (2 if f < 3 else 2)
    assert ev.evaluate_feature(task, repo, 1, "", spec=SPEC)[("tests_passed")] == 1   # test_add still passes


def test_gold_pairs_pass_after_a_clean_or_a_union_merge(toy):
    task, repo = toy
    r = ev.evaluate_pair(task, repo, 1, 2, gold(task, 1), gold(task, 2), spec=SPEC)
    assert r["merge"]["status"] == "conflicts" and r["merge"]["strategy"] == "union"   # same lines edited
    assert r["both_passed"] and r["feature1"]["passed"] and r["feature2"]["passed"]
    assert r["apply_status"] == {"agent1": "applied", "agent2": "applied"}
    for f1, f2 in ((1, 3), (2, 3)):                  # different files: a plain merge
        r = ev.evaluate_pair(task, repo, f1, f2, gold(task, f1), gold(task, f2), spec=SPEC)
        assert r["merge"] == {**r["merge"], "status": "clean", "strategy": "naive"} and r["both_passed"]


def test_wrong_empty_and_test_editing_patches_are_graded_as_the_official_evaluator(toy, tmp_path):
    task, repo = toy
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    wrong = diff_of(clone, {"calc.py": BASE_CALC + "\n\ndef sub(a, b):\n    return a + b\n"})
    r = ev.evaluate_feature(task, repo, 1, wrong, spec=SPEC)
    assert not r["passed"] and (r["tests_passed"], r["tests_failed"]) == (1, 1) and r["stage"] is None
    # a patch that does not apply: runner.sh stops before the tests
    r = ev.evaluate_feature(task, repo, 1, gold(task, 1).replace("return a + b", "return a ++ b"), spec=SPEC)
    assert not r["passed"] and r["stage"] == "apply_feature" and r["tests_passed"] == 0
    # test-file blocks are dropped: gold + gutting the tests grades as gold; tests alone is no patch
    gutted = diff_of(clone, {**GOLD[1][0], "tests/test_calc.py": "def test_nothing():\n    pass\n"})
    assert ev.strip_test_files(gutted) == gold(task, 1)
    r = ev.evaluate_feature(task, repo, 1, gutted, spec=SPEC)
    assert r["passed"] and r["tests_passed"] == 2
    tests_only = diff_of(clone, {"tests/test_calc.py": "def test_nothing():\n    pass\n"})
    r = ev.evaluate_feature(task, repo, 1, tests_only, spec=SPEC)
    assert not r["passed"] and "empty" in r["error"]
    # two empty patches merge into an empty patch, which runner.sh cannot apply: both fail
    r = ev.evaluate_pair(task, repo, 1, 3, "", "", spec=SPEC)
    assert r["apply_status"] == {"agent1": "skipped", "agent2": "skipped"} and r["merge"]["status"] == "clean"
    assert not r["both_passed"] and r["feature1"]["stage"] == "apply_feature"
    # one coder's work alone: its feature passes, the other's does not
    r = ev.evaluate_pair(task, repo, 1, 3, gutted, "", spec=SPEC)
    assert r["feature1"]["passed"] and not r["feature2"]["passed"] and not r["both_passed"]


def test_a_tarball_of_the_base_tree_works_like_the_clone(toy, tmp_path):
    task, repo = toy
    tarball = tmp_path / "toy_calc_task_task1.base.tar.gz"
    subprocess.run(["git", "archive", "--prefix=repo/", "-o", str(tarball), "HEAD"], cwd=repo, check=True)
    from minscope.envs.cooperbench import find_repo

    assert find_repo(tmp_path, task) == tarball and find_repo(repo.parent, task) == repo   # (named after upstream)
    r = ev.evaluate_pair(task, tarball, 1, 2, gold(task, 1), gold(task, 2), spec=SPEC)
    assert r["both_passed"] and r["merge"]["strategy"] == "union"
    assert not list(Path(repo).glob("agent*")) and git(repo, "branch").strip() in ("* master", "* main")


def test_an_empty_venv_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MINSCOPE_CACHE", str(tmp_path))
    python = cb_local.test_python(cb_task.TaskSpec(".", deps=()))
    assert Path(python).exists() and (Path(python).parent.parent / "minscope-ok").is_file()
    assert cb_local.test_python(cb_task.TaskSpec(".", deps=())) == python


# --------------------------------------------------------------------------- the episode
def env_for(task: Path, **kw) -> CooperBenchEnv:
    return CooperBenchEnv(task.parent.parent, task.parent.parent.parent / "repos", tasks=[NAME],
                          specs={NAME: SPEC}, **kw)


def test_tasks_are_the_feature_pairs_and_a_subset_file_picks_some(toy, tmp_path):
    task, _ = toy
    env = env_for(task)
    assert [(t.feature1, t.feature2) for t in env.tasks("train")] == [(1, 2), (1, 3), (2, 3)]
    assert env.tasks("test") == []
    subset = tmp_path / "mine.json"
    subset.write_text(json.dumps({"tasks": [{"repo": "toy_calc_task", "task_id": 1, "pairs": [[3, 1]]}]}))
    assert read_subset(subset) == {NAME: [(1, 3)]}
    held = env_for(task, test_subset=subset)
    assert [t.id for t in held.tasks("test")] == [f"{NAME}:f1+f3"]
    assert [t.id for t in held.tasks("train")] == [f"{NAME}:f1+f2", f"{NAME}:f2+f3"]
    with pytest.raises(FileNotFoundError, match="no task nope_task/task9"):
        CooperBenchEnv(task.parent.parent, task.parent.parent.parent / "repos", tasks=["nope_task/task9"])


class Script:
    """A scripted coder: per episode, a list of turns (each a list of tool calls)."""

    def __init__(self, role, plan):
        self.role, self.plan, self.seen = role, plan, []

    def respond(self, episodes, env):
        out = []
        for ep in episodes:
            view = view_messages(env, ep, self.role)
            self.seen.append(view)
            done = sum(t.role == self.role for t in ep.turns)
            calls = self.plan(ep.task)[done] if done < len(self.plan(ep.task)) else [("submit", {})]
            out.append(Turn(self.role, "\n".join(format_tool_call(n, a) for n, a in calls)))
        return out


def gold_plan(feature, other):
    def plan(task):
        f = task.feature1 if feature == 1 else task.feature2
        writes = [("write_file", {"path": p, "content": c}) for p, c in GOLD[f][0].items()]
        return [[("read_file", {"path": "calc.py"}),
                 ("send_message", {"content": f"I am adding feature {f}; {other}, keep your edits apart."})],
                writes + [("run_tests", {})],
                [("submit", {})]]
    return plan


def test_scripted_coders_writing_the_gold_changes_get_reward_1_through_the_engine(toy):
    task, _ = toy
    env = env_for(task, max_turns=5)
    a, b = Script("agent", gold_plan(1, "agent2")), Script("partner", gold_plan(2, "agent1"))
    (ep,) = rollout(env, [t for t in env.tasks("train") if (t.feature1, t.feature2) == (1, 2)], a, b)
    assert ep.reward == 1.0
    coop = ep.info["cooperbench"]
    assert coop["both_passed"] and coop["feature1_passed"] and coop["feature2_passed"]
    assert coop["merge"] == "conflicts" and coop["merge_strategy"] == "union"
    assert coop["messages"] == {"agent1": 1, "agent2": 1} and coop["turns"] == {"agent1": 3, "agent2": 3}
    assert coop["submitted"] == {"agent1": True, "agent2": True} and coop["tool_errors"] == {"agent1": 0, "agent2": 0}
    assert "def sub" in ep.info["patches"]["agent"] and "def mul" in ep.info["patches"]["partner"]
    # agent2's first view: its own feature, then agent1's message as a tool result; never agent1's turns
    first = b.seen[0]
    assert first[1]["content"].endswith(FEATURE_TEXT[2]) and "mul" not in first[0]["content"]
    assert first[-1] == {"role": "tool", "content": "[Message from agent1]: I am adding feature 1; agent2, keep your edits apart."}
    assert all("write_file" not in m["content"] for v in b.seen for m in v if m["role"] == "user")
    # agent1 sees its own tool results (file content) and agent2's message, not agent2's results
    last = a.seen[-1]
    tools = [m["content"] for m in last if m["role"] == "tool"]
    assert any("def add" in t for t in tools) and "[Message from agent2]: I am adding feature 2; agent1, keep your edits apart." in tools
    assert sum("exit code 0" in t for t in tools) == 1                 # its run_tests, not agent2's
    assert not list(env._root.iterdir())                              # workspaces removed after scoring


def test_format_errors_turn_limits_and_a_silent_partner(toy):
    task, _ = toy
    env = env_for(task, max_turns=2)

    class Chatty:
        def __init__(self, role):
            self.role = role

        def respond(self, episodes, env):
            return [Turn(self.role, "I will just talk.") for _ in episodes]

    (ep,) = rollout(env, env.tasks("train")[:1], Chatty("agent"), Chatty("partner"))
    assert ep.reward == 0.0 and [t.role for t in ep.turns].count("agent") == 2
    coop = ep.info["cooperbench"]
    assert coop["turns"] == {"agent1": 2, "agent2": 2} and coop["submitted"] == {"agent1": False, "agent2": False}
    assert coop["tool_errors"] == {"agent1": 2, "agent2": 2}
    errors = [t for t in ep.turns if t.role == "env"]
    assert all("no tool call found" in t.text for t in errors) and {t.to for t in errors} == {"agent", "partner"}


def test_tools_stay_inside_the_workspace(toy):
    task, _ = toy
    env = env_for(task, max_turns=1)
    ep = Episode(task=env.tasks("train")[0], group=0)
    calls = [("read_file", {"path": "../../etc/passwd"}), ("write_file", {"path": ".git/config", "content": "x"}),
             ("replace_in_file", {"path": "calc.py", "old": "a", "new": "b"}), ("search", {"pattern": "def add"}),
             ("list_files", {}), ("bash", {"command": "ls"})]
    ep.turns.append(Turn("agent", "\n".join(format_tool_call(n, a) for n, a in calls)))
    step = env.after_turn(ep)
    results = [t.text for t in step.inject]
    assert "outside the repository" in results[0] and ".git folder" in results[1]
    assert "occurs" in results[2] and results[3] == "calc.py:4: def add(a, b):"
    assert "tests/test_calc.py" in results[4] and "unknown tool 'bash'" in results[5]
    assert step.next_speaker == "partner"
    env.score(ep)
    env = env_for(task, max_turns=1, bash=True)
    ep = Episode(task=env.tasks("train")[0], group=0)
    ep.turns.append(Turn("agent", format_tool_call("bash", {"command": "echo $HOME; pwd; echo data > new.txt"})))
    (result,) = env.after_turn(ep).inject
    out = json.loads(result.text)
    home, cwd = out["output"].split()
    assert out["returncode"] == 0 and home != str(Path.home()) and cwd.endswith("repo")
    _, info = env.score(ep)
    assert "+data" in info["patches"]["agent"] and "new.txt" in info["patches"]["agent"]   # new files count


# --------------------------------------------------------------------------- real models, every method
TINY = ["--groups", "1", "--group-size", "2", "--steps", "1", "--eval-every", "1", "--max-new-tokens", "8",
        "--coder-turns", "2", "--no-grad-checkpointing"]
METHOD_RUNS = {"base": ("single", "--steps", "0"), "cross-play": ("single",), "cross-play-ensemble": ("ensemble",),
               "self-play": ("selfplay",), "population-self-play": ("population-selfplay",)}


@pytest.fixture(scope="module")
def coop_runs(toy, tmp_path_factory):
    """`train.py --env cooperbench` with a tiny random Qwen3 (real Qwen3 chat template, which
    lists the tools) for every method of the paper's Table 2 on the fixture task."""
    import train as train_cli
    from minscope.models import build_tiny_model
    from test_chat_templates import make_tokenizer

    task, _ = toy
    env = env_for(task)
    t = env.tasks("train")[0]
    corpus = [m["content"] for r in ("agent", "partner") for m in env._messages(t, r)] + [json.dumps(env.agent_tools(t))]
    tok = make_tokenizer("qwen3", corpus, vocab_size=600)
    model_dir = tmp_path_factory.mktemp("coop-model") / "qwen3"
    build_tiny_model(tok, "qwen3", hidden_size=32, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    runs = tmp_path_factory.mktemp("coop-runs")
    mp = pytest.MonkeyPatch()
    mp.setitem(cb_task.MANIFEST, NAME, SPEC)          # the fixture task, as if it were in the manifest
    data = ["--data", str(task.parent.parent), "--repos", str(task.parent.parent.parent / "repos"), "--tasks", NAME]
    try:
        for label, (method, *extra) in METHOD_RUNS.items():
            panel = ["--panel", str(model_dir)] if method == "ensemble" else []
            argv = ["--env", "cooperbench", *data, "--policy", str(model_dir), "--method", method,
                    "--runs-dir", str(runs), "--name", label, *TINY, *panel, *extra]
            train_cli.main(argv)
        yield runs, mp
    finally:
        mp.undo()


def test_every_method_runs_on_cooperbench_with_a_tiny_real_model(coop_runs):
    runs, _ = coop_runs
    for label in METHOD_RUNS:
        recs = [json.loads(x) for x in (runs / label / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in recs if r["kind"] == "train"]
        assert len(steps) == (0 if label == "base" else 1), label
        for r in steps:
            assert r["train_reward"] == 0.0 and r["score_errors"] == 0 and r["exact_stream_frac"] == 1.0
            assert r["feature1_pass"] == 0.0 and 0 < r["turns_agent1"] <= 2 and "messages_agent2" in r
        assert [r["step"] for r in recs if r["kind"] == "eval"] == ([0] if label == "base" else [0, 1])
    pop = [json.loads(x) for x in (runs / "population-self-play" / "metrics.jsonl").read_text().splitlines()]
    assert pop[1]["pool_size"] == 1


def test_eval_reports_success_pass_hat_k_per_feature_messages_and_turns(coop_runs):
    import eval as eval_cli

    runs, _ = coop_runs
    run_dir = runs / "self-play"
    eval_cli.main([str(run_dir), "--trials", "2", "--max-tasks", "1", "--transcripts", "1"])
    report = (run_dir / "report.md").read_text()
    assert "## Success per panel member" in report and "pass^2" in report and "feature 1 passes" in report
    member = json.loads((run_dir / "eval.json").read_text())["members"]["train-simulator"]
    assert member["success"]["n"] == 2 and member["tasks"] == 1 and member["feature1_pass"] == 0.0
    assert set(member["turns"]) == {"agent1", "agent2"} and all(0 < v <= 2 for v in member["turns"].values())
    assert set(member["messages"]) == {"agent1", "agent2"} and member["score_errors"] == 0


# --------------------------------------------------------------------------- the reference verdicts
DATA = os.environ.get("MINSCOPE_COOPERBENCH_DATA")
SAMPLES = {"dirty_equals_43": ("samuelcolvin_dirty_equals_task/task43", 9, 36, 21),
           "click_2068": ("pallets_click_task/task2068", 12, 66, 8)}


@pytest.mark.skipif(not DATA, reason="slow (about 10 min, builds venvs with pip): set MINSCOPE_COOPERBENCH_DATA "
                    "to a folder with dataset/, repos/ and reference/ as in the CooperBench sample")
@pytest.mark.parametrize("key", list(SAMPLES))
def test_the_reference_verdicts_of_two_real_tasks_are_reproduced(key):
    need_bwrap()
    root = Path(DATA)
    name, n_features, n_pairs, n_both = SAMPLES[key]
    task = root / "dataset" / name
    repo = next((root / "repos").glob(name.replace("/", "_") + "*.tar.gz"))
    singles = [json.loads(x) for x in (root / "reference" / f"{key}.single.jsonl").read_text().splitlines()]
    for rec in singles:
        f, ref = rec["feature"], rec["r"]
        r = ev.evaluate_feature(task, repo, f, gold(task, f) if rec["patch"] == "gold" else "")
        assert (r["passed"], r["tests_passed"], r["tests_failed"]) == (ref["passed"], ref["tests_passed"],
                                                                       ref["tests_failed"]), rec
    assert len(singles) == 2 * n_features
    pairs = [json.loads(x) for x in (root / "reference" / f"{key}.pairs.jsonl").read_text().splitlines()]
    both = 0
    for rec in pairs:
        f1, f2, ref = rec["f1"], rec["f2"], rec["r"]
        r = ev.evaluate_pair(task, repo, f1, f2, gold(task, f1), gold(task, f2))
        assert (r["merge"]["status"], r["merge"]["strategy"]) == (ref["merge"]["status"], ref["merge"]["strategy"])
        for k in ("feature1", "feature2"):
            assert (r[k]["passed"], r[k]["tests_passed"], r[k]["tests_failed"]) == \
                (ref[k]["passed"], ref[k]["tests_passed"], ref[k]["tests_failed"]), rec
        both += r["both_passed"]
    assert (len(pairs), both) == (n_pairs, n_both)
