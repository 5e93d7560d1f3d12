"""CooperBench (github.com/cooperbench/CooperBench, MIT) as a minscope environment.

Two coders, one repository: each gets one feature of a pair (`feature.md`) and its own
temporary clone of the repository at the task's base commit. They act only through tools
(`<tool_call>` blocks, parsed by `minscope.toolcalls`), may message each other, and submit.
Their two patches are then merged as the official evaluator merges them and both features'
hidden tests run on the merged tree (`cooperbench_eval.evaluate_pair`, no Docker). The reward
is binary and shared: both features pass.

    agent1 (the policy, "agent")          agent2 (the partner coder, "partner")
      │ tool calls ─► its workspace          │ tool calls ─► its workspace
      │ ◄─ results (env turns to agent1)     │ ◄─ results (env turns to agent2)
      │ send_message ───────────────────────►│ "[Message from agent1]: ..." at its next turn
      └ submit / out of turns                └ submit / out of turns
    score: patch_i = `git add -A && git diff --cached BASE` of each workspace (new files
           included) ─► evaluate_pair ─► reward = both_passed; per-feature results in info

The coders never see each other's turns, only the messages sent. A turn without a tool call
gets a format-error result. Turns alternate between the coders; a coder that submitted or
used its `max_turns` (50, as in the paper) is skipped, and the episode ends when both are done.

Tools: list_files, read_file, search, write_file, replace_in_file, run_tests (the
repository's existing tests; the features' tests stay hidden), send_message, submit. With
`bash=True` also `bash` (a command in the workspace, as the reference agent's one tool).
Whatever of a coder's executes (run_tests, bash, the regex of search; later the evaluation)
runs in `minscope.sandbox` (bubblewrap: no network, nothing outside the workspace writable or
even visible but the system and the test interpreter, resource limits, no process left
behind). Without bwrap the environment refuses to start unless `unsafe_no_sandbox`. Tool
arguments are checked (a malformed call gets an error result, never an exception), paths
stay inside the workspace and never look like options, and every result is clipped.

Data: a CooperBench `dataset/` folder (official layout) and a folder of base repositories,
one per task: `<repo>_task<N>.tar.gz` or `<repo>_task<N>.<anything>.tar.gz` (a `git archive` of
the base tree), or a git clone named `<repo>_task<N>`, `<repo>` or after the upstream repository
(e.g. `click`) holding the base commit. Only the pure-Python tasks listed in
`cooperbench_task.MANIFEST` run without Docker.

    python train.py --env cooperbench --data CooperBench/dataset --repos repos \
        --tasks pallets_click_task/task2068 --policy Qwen/Qwen3-1.7B --simulator Qwen/Qwen3-1.7B \
        --method population-selfplay
    python eval.py runs/cooperbench-population-selfplay --trials 4

Methods (the paper's Table 2): Base = any method with `--steps 0`; cross-play = `single` (the
partner coder is the frozen --simulator); cross-play ensemble = `ensemble` (the seen --panel
members); self-play = `selfplay` (one update on both coders' turns, the partner's with the same
shared reward); population self-play = `population-selfplay` (the partner is drawn from a pool
of the policy's past adapters).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from collections import OrderedDict
from pathlib import Path

from .. import sandbox
from ..toolcalls import ToolCall, parse_tool_calls
from .base import Environment, Episode, Step, Turn
from .cooperbench_eval import evaluate_pair
from .cooperbench_local import clip, temp_root
from .cooperbench_task import EvalError, base_commit, task_name, task_spec
from .cooperbench_tools import BASH_TOOL, TOOL_OUTPUT_CHARS, TOOLS, CoopTask, Workspace, run_tool, tool_list  # noqa: F401

SCORE_CACHE = 4096            # pair verdicts remembered (per process)
_SCORES: OrderedDict = OrderedDict()   # (task, repo, features, spec, patch hashes) -> evaluate_pair result


# --------------------------------------------------------------------------- tasks
def features(task_dir) -> list[int]:
    """The feature numbers of a task folder (feature<k>/ with a feature.md)."""
    out = []
    for p in Path(task_dir).iterdir():
        m = re.fullmatch(r"feature(\d+)", p.name)
        if m and (p / "feature.md").is_file():
            out.append(int(m[1]))
    return sorted(out)


def find_task_dirs(data, names=None) -> list[Path]:
    """Task folders `<repo>_task/task<N>` under a dataset folder; `names` picks some (None or
    ["all"]: every task found)."""
    data = Path(data)
    if not data.is_dir():
        raise FileNotFoundError(f"CooperBench dataset folder {data} not found (the `dataset/` folder of a "
                                "CooperBench checkout: github.com/cooperbench/CooperBench)")
    found = {f"{t.parent.name}/{t.name}": t for t in sorted(data.glob("*_task/task*")) if t.is_dir()}
    if not names or list(names) == ["all"]:
        if not found:
            raise FileNotFoundError(f"{data} holds no task folders (<repo>_task/task<N>/)")
        return list(found.values())
    missing = [n for n in names if n not in found]
    if missing:
        raise FileNotFoundError(f"{data}: no task {', '.join(missing)}; tasks there: "
                                f"{', '.join(found) or 'none'}")
    return [found[n] for n in names]


def upstream_name(task_dir) -> str | None:
    """The upstream repository's name from the Dockerfile's or setup.sh's `git clone URL`."""
    for name in ("Dockerfile", "setup.sh"):
        path = Path(task_dir) / name
        if path.is_file():
            m = re.search(r"git clone\s+(\S+)", path.read_text(errors="replace"))
            if m:
                return m[1].rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
    return None


def find_repo(repos, task_dir) -> Path:
    """The base repository of a task in the folder `repos` (see the module docstring)."""
    repos, task_dir = Path(repos), Path(task_dir)
    stem = f"{task_dir.parent.name}_{task_dir.name}"          # e.g. pallets_click_task_task2068
    tried = []
    for pattern in (f"{stem}.*tar.gz", f"{stem}.*tgz"):      # e.g. <stem>.tar.gz, <stem>.base.tar.gz
        hits = sorted(repos.glob(pattern))
        tried.append(str(repos / pattern))
        if hits:
            return hits[0]
    for name in (stem, task_dir.parent.name, upstream_name(task_dir)):
        if name:
            tried.append(str(repos / name))
            if (repos / name / ".git").exists():
                return repos / name
    raise FileNotFoundError(f"no base repository for {task_name(task_dir)}; looked for {', '.join(tried)} "
                            f"(a `git archive` tarball of the base commit {base_commit(task_dir)}, or a clone)")


def read_subset(path) -> dict[str, list[tuple[int, int]] | None]:
    """An official subset file (`dataset/subsets/*.json`): task name -> its pairs (None: all)."""
    try:
        spec = json.loads(Path(path).read_text())
        out = {}
        for t in spec["tasks"]:
            pairs = t.get("pairs")
            out[f"{t['repo']}/task{t['task_id']}"] = [tuple(sorted(map(int, p))) for p in pairs] if pairs else None
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise FileNotFoundError(f"{path}: cannot read it as a CooperBench subset file ({e})") from None


# --------------------------------------------------------------------------- the prompt
SYSTEM = """You are {me}, a software engineer. You and another engineer, {other}, work at the same \
time on the same repository, each in your own copy of it (the current folder is its root). You \
implement one feature and {other} implements another. When you are both done, your two sets of \
changes are merged with git and the hidden tests of BOTH features run on the merged code: you \
succeed only if both pass. You will often need to edit the same files, so tell {other} which \
files and lines you are changing (send_message) to avoid conflicting edits. Do not edit the tests.
Act only through tools: every reply must call at least one tool, written as \
<tool_call>{{"name": "<tool>", "arguments": {{...}}}}</tool_call>. Messages from {other} arrive \
as tool results starting with "[Message from {other}]". When your feature is implemented, call \
submit. You have {turns} turns. Tools:
{tools}"""


# --------------------------------------------------------------------------- the environment
ROLES = ("agent", "partner")


class CooperBenchEnv(Environment):
    """Pairs of CooperBench features, played by two coders (see module docstring).

    data: the dataset folder; repos: the folder of base repositories; tasks: task names
    (`<repo>_task/task<N>`, default all in `data`); subset / test_subset: official subset files
    choosing the training / held-out pairs (held-out pairs are never training pairs; without
    test_subset there is no test split);
    max_turns: generated turns per coder; bash: also offer the `bash` tool;
    specs: TaskSpec per task name, for tasks outside `cooperbench_task.MANIFEST`;
    tool_timeout: seconds for run_tests and bash;
    unsafe_no_sandbox: where bwrap is missing, run the coders' code with this user's rights
    instead of refusing (EvalError) to start.
    """

    name = "cooperbench"
    agent_name = "agent1"
    partner_name = "agent2"
    symmetric = True
    default_simulator_reward = "shared"

    def __init__(self, data, repos, tasks=None, subset=None, test_subset=None, max_turns: int = 50,
                 bash: bool = False, specs: dict | None = None, tool_timeout: float = 120,
                 unsafe_no_sandbox: bool = False):
        self.max_turns, self.bash, self.tool_timeout = max_turns, bash, tool_timeout
        self.unsafe = unsafe_no_sandbox
        try:
            sandbox.check(unsafe_no_sandbox)
        except sandbox.SandboxUnavailable as e:
            raise EvalError(str(e)) from None
        if unsafe_no_sandbox and sandbox.unavailable():
            print(f"warning: {sandbox.unavailable()}: the coders' tests{' and bash commands' * bash} "
                  "and the final evaluation run with your rights (--unsafe-no-sandbox)", file=sys.stderr)
        self.task_dirs = find_task_dirs(data, tasks)
        self.specs = {}
        self.repos = {}
        for t in self.task_dirs:
            name = task_name(t)
            self.specs[name] = task_spec(t, (specs or {}).get(name))   # unknown task: EvalError
            self.repos[name] = find_repo(repos, t)
        test = self._pairs(test_subset) if test_subset else []
        held_out = set(test)
        self.splits = {"train": [t for t in self._pairs(subset) if t not in held_out], "test": test}
        self.no_test_reason = "no --test-subset was given"      # (runner.eval_tasks' warning)
        self._root: Path | None = None
        self._tools = TOOLS + ([BASH_TOOL] if bash else [])

    def _pairs(self, subset) -> list[CoopTask]:
        chosen = read_subset(subset) if subset else None
        out = []
        for t in self.task_dirs:
            name = task_name(t)
            if chosen is not None and name not in chosen:
                continue
            pairs = (chosen or {}).get(name) or list(itertools.combinations(features(t), 2))
            out += [CoopTask(str(t), str(self.repos[name]), a, b) for a, b in pairs]
        return out

    def tasks(self, split: str = "train") -> list[CoopTask]:
        if split not in self.splits:
            raise ValueError(f"cooperbench has no split {split!r}; use train or test")
        return list(self.splits[split])

    # ------------------------------------------------------------------ what each coder sees
    def coder(self, role: str) -> tuple[str, str]:
        """(own name, other's name) of a role."""
        return (self.agent_name, self.partner_name) if role == "agent" else (self.partner_name, self.agent_name)

    def feature_of(self, task: CoopTask, role: str) -> int:
        return task.feature1 if role == "agent" else task.feature2

    def _messages(self, task: CoopTask, role: str) -> list[dict]:
        me, other = self.coder(role)
        text = (Path(task.task_dir) / f"feature{self.feature_of(task, role)}" / "feature.md").read_text()
        system = SYSTEM.format(me=me, other=other, turns=self.max_turns, tools=tool_list(self._tools))
        return [{"role": "system", "content": system},
                {"role": "user", "content": f"Your feature:\n\n{text.strip()}"}]

    def agent_messages(self, task) -> list[dict]:
        return self._messages(task, "agent")

    def partner_messages(self, task) -> list[dict]:
        return self._messages(task, "partner")

    def agent_tools(self, task) -> list[dict]:
        return self._tools

    def partner_tools(self, task) -> list[dict]:
        return self._tools

    def first_speaker(self, task) -> str:
        return "agent"

    # ------------------------------------------------------------------ the turn loop
    def _state(self, episode: Episode) -> dict:
        return episode.info.setdefault("coop", {r: {"turns": 0, "submitted": False, "messages": 0,
                                                    "tool_calls": 0, "tool_errors": 0} for r in ROLES})

    def _done(self, state: dict, role: str) -> bool:
        return state[role]["submitted"] or state[role]["turns"] >= self.max_turns

    def workspace(self, episode: Episode, role: str) -> Workspace:
        spaces = episode.info.setdefault("workspaces", {})
        if role not in spaces:
            if self._root is None or not self._root.exists():
                self._root = temp_root("minscope-coders-")      # (removed at exit and on SIGTERM)
            spaces[role] = Workspace(episode.task, self.specs[episode.task.name], self._root, self.unsafe)
        return spaces[role]

    def after_turn(self, episode: Episode) -> Step:
        turn = episode.turns[-1]
        role = turn.role
        other = "partner" if role == "agent" else "agent"
        me, other_name = self.coder(role)
        state = self._state(episode)
        turn.public = False                    # coders see each other only through messages
        parsed = parse_tool_calls(turn.text)
        inject, names = [], []
        if not parsed.calls:
            inject.append(Turn("env", "Error: no tool call found. Every reply must call a tool, written as "
                               '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>; call submit '
                               "when you are done.", to=role, meta={"tool_name": None, "error": True}))
            state[role]["tool_errors"] += 1
        for call in parsed.calls:
            if not isinstance(call, ToolCall):
                text, error, name = call.message, True, None
            else:
                name = call.name
                state[role]["tool_calls"] += 1
                if name == "send_message":
                    content = str(call.arguments.get("content", call.arguments.get("message", ""))).strip()
                    if not content:
                        text, error = "Error: send_message needs a non-empty `content`", True
                    elif self._done(state, other):
                        text, error = f"{other_name} has already finished; the message was not delivered", True
                    else:
                        state[role]["messages"] += 1
                        inject.append(Turn("env", clip(f"[Message from {me}]: {content}", TOOL_OUTPUT_CHARS), to=other,
                                           meta={"tool_name": "message", "from": role}))
                        text, error = f"message sent to {other_name}", False
                elif name == "submit":
                    state[role]["submitted"] = True
                    text, error = "submitted", False
                else:
                    text, error = run_tool(self.workspace(episode, role), call, self.tool_timeout, self.bash)
            state[role]["tool_errors"] += error
            names.append(name)
            inject.append(Turn("env", clip(text, TOOL_OUTPUT_CHARS), to=role, meta={"tool_name": name, "error": error}))
            if state[role]["submitted"]:
                break                          # nothing after submit runs
        turn.meta["tool_calls"] = names
        state[role]["turns"] += 1
        # The caller's results come first, then any message to the other coder.
        inject.sort(key=lambda t: t.to != role)
        if not self._done(state, other):
            return Step(other, inject)
        return Step(None if self._done(state, role) else role, inject)

    def step_metrics(self, episodes: list[Episode]) -> dict:
        """Means over a training step's episodes for metrics.jsonl: each feature's pass rate,
        and per coder the messages sent, turns used and how often it submitted."""
        coop = [ep.info["cooperbench"] for ep in episodes if "cooperbench" in ep.info]
        if not coop:
            return {}
        n = len(coop)
        out = {"feature1_pass": sum(c["feature1_passed"] for c in coop) / n,
               "feature2_pass": sum(c["feature2_passed"] for c in coop) / n}
        for key in ("messages", "turns", "submitted"):
            for name in (self.agent_name, self.partner_name):
                out[f"{key}_{name}"] = sum(float(c[key][name]) for c in coop) / n
        return out

    # ------------------------------------------------------------------ reward
    def evaluate(self, task: CoopTask, patch1: str, patch2: str) -> dict:
        """evaluate_pair, remembered for the process: many episodes submit the same patches
        (often none at all), and the verdict depends on nothing else."""
        spec = self.specs[task.name]
        key = (task.task_dir, task.repo, task.feature1, task.feature2, spec,
               hashlib.sha1(patch1.encode()).hexdigest(), hashlib.sha1(patch2.encode()).hexdigest())
        if key not in _SCORES:
            _SCORES[key] = evaluate_pair(task.task_dir, task.repo, task.feature1, task.feature2,
                                         patch1, patch2, spec=spec, unsafe_no_sandbox=self.unsafe)
            if len(_SCORES) > SCORE_CACHE:
                _SCORES.popitem(last=False)
        _SCORES.move_to_end(key)
        return _SCORES[key]

    def score(self, episode: Episode) -> tuple[float, dict]:
        spaces = episode.info.pop("workspaces", {})
        try:
            patches = {r: spaces[r].patch() if r in spaces else "" for r in ROLES}
        finally:
            for ws in spaces.values():
                ws.remove()
        result = self.evaluate(episode.task, patches["agent"], patches["partner"])
        state = self._state(episode)
        coop = {"both_passed": result["both_passed"],
                "feature1_passed": bool(result["feature1"]["passed"]),
                "feature2_passed": bool(result["feature2"]["passed"]),
                "merge": result["merge"]["status"], "merge_strategy": result["merge"]["strategy"],
                "apply_status": result["apply_status"],
                "patch_lines": {self.coder(r)[0]: len(patches[r].splitlines()) for r in ROLES},
                **{key: {self.coder(r)[0]: state[r][k] for r in ROLES}
                   for key, k in (("turns", "turns"), ("messages", "messages"), ("submitted", "submitted"),
                                  ("tool_calls", "tool_calls"), ("tool_errors", "tool_errors"))}}
        return float(result["both_passed"]), {"cooperbench": coop, "patches": patches}
