"""The CooperBench coders' tools and workspaces (see `cooperbench.py` for the episode).

A workspace is one coder's clone of the base tree in a temporary folder. The file tools act
on it from this process, on resolved paths that must stay inside it (never its .git, never
through a link out of it) and never start with `-` (so no path becomes an option of a
command). Whatever the coder wrote that executes (run_tests, bash, and the regular expression
of search, which runs as `grep -E`) runs in `minscope.sandbox`: no network, only the workspace
writable, time and size limits, no process left behind. Arguments are checked (types, line
ranges) so a malformed call gets an error result, never an exception through the rollout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import sandbox
from ..toolcalls import ToolCall
from .cooperbench_local import clip, clone_base, git, run_limited, test_env, test_python
from .cooperbench_task import TaskSpec, task_name

TOOL_OUTPUT_CHARS = 4000      # tool results (and messages) are cut to this many characters (head + tail)
SEARCH_TIMEOUT = 10           # seconds a search may take
LIST_LIMIT = 300              # entries list_files shows
SEARCH_LIMIT = 50             # matching lines search shows

@dataclass(frozen=True)
class CoopTask:
    """One pair: the coder "agent1" implements feature1, "agent2" feature2."""
    task_dir: str
    repo: str
    feature1: int
    feature2: int

    @property
    def name(self) -> str:
        return task_name(self.task_dir)

    @property
    def id(self) -> str:
        return f"{self.name}:f{self.feature1}+f{self.feature2}"


def _tool(name, description, properties=None, required=()):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties or {}, "required": list(required)}}}


_S = {"type": "string"}
_I = {"type": "integer"}
TOOLS = [
    _tool("list_files", "List files and folders under a path of the repository.",
          {"path": {**_S, "description": "folder relative to the repository root (default '.')"}}),
    _tool("read_file", "Read a file, with line numbers.",
          {"path": _S, "start_line": _I, "end_line": _I}, ["path"]),
    _tool("search", "Search the repository's files for an extended regular expression (grep -E); "
          "prints file:line: text.",
          {"pattern": _S, "path": {**_S, "description": "file or folder (default '.')"}}, ["pattern"]),
    _tool("write_file", "Create or overwrite a file with the given content.",
          {"path": _S, "content": _S}, ["path", "content"]),
    _tool("replace_in_file", "Replace one exact occurrence of `old` by `new` in a file.",
          {"path": _S, "old": _S, "new": _S}, ["path", "old", "new"]),
    _tool("run_tests", "Run the repository's existing tests with pytest (the tests of the features "
          "are hidden).", {"path": {**_S, "description": "test file or folder (default: all tests)"}}),
    _tool("send_message", "Send a message to the other coder; it arrives at their next turn.",
          {"content": _S}, ["content"]),
    _tool("submit", "Submit your work: your changes to the repository are your final patch."),
]
BASH_TOOL = _tool("bash", "Run a bash command in the repository folder (output cut to 4000 characters).",
                  {"command": _S}, ["command"])


def tool_list(tools) -> str:
    """One line per tool, `name(arguments): description`, for the system prompt (a served
    model gets no tool schemas from a chat template)."""
    lines = []
    for t in tools:
        f = t["function"]
        args = ", ".join(f["parameters"]["properties"])
        lines.append(f"- {f['name']}({args}): {f['description']}")
    return "\n".join(lines)


class Workspace:
    """One coder's clone of the base tree, in a temporary folder (resolved: see cooperbench_local.temp_root)."""

    def __init__(self, task: CoopTask, spec: TaskSpec, root: Path, unsafe: bool = False):
        self.dir = Path(tempfile.mkdtemp(prefix="coder-", dir=root)).resolve()
        self.path, self.base = clone_base(task.repo, task.task_dir, self.dir / "repo")
        self.home = self.dir / "home"
        self.home.mkdir()
        self.spec, self.unsafe = spec, unsafe

    def resolve(self, rel) -> Path:
        """A path inside the workspace (never its .git); ValueError otherwise."""
        rel = str(rel or ".")
        path = (self.path / rel).resolve()
        if path != self.path and self.path not in path.parents:
            raise ValueError(f"{rel}: outside the repository")
        if ".git" in path.relative_to(self.path).parts:
            raise ValueError(f"{rel}: the .git folder is not part of the task")
        return path

    def run(self, argv, timeout: float, writable: bool = True) -> tuple[int | None, str, float]:
        """Model-written code in the sandbox: tests and bash with the workspace writable (its
        .git read-only) and the test interpreter visible; with `writable=False` (search) the
        workspace only readable and no interpreter."""
        python = test_python(self.spec) if writable else None
        if writable:
            rw, ro = (self.path, self.home), sandbox.python_dirs(python)
        else:
            rw, ro = (), [self.path]
        return run_limited(argv, self.path, test_env(self.path, self.spec, self.home, python), timeout,
                           writable=rw, readable=ro, readonly_inside=(self.path / ".git",), unsafe=self.unsafe)

    def patch(self) -> str:
        """Everything this coder changed, new files included."""
        git(["add", "-A"], self.path)
        return git(["diff", "--cached", self.base], self.path).stdout

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class ToolError(ValueError):
    """A tool call the tool cannot run (the message goes back to the model)."""


def _text(a: dict, key: str, default=None) -> str:
    """Argument `key` as a string (a missing one: `default`, or an error if there is none)."""
    value = a.get(key, default)
    if value is None:
        raise ToolError(f"the argument `{key}` is required")
    if not isinstance(value, str):
        raise ToolError(f"`{key}` must be a string, not {type(value).__name__}")
    return value


def _line(a: dict, key: str) -> int | None:
    """Argument `key` as a line number (0..10^9; 0 reads as 1 for a start), or None when absent."""
    value = a.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10**9:
        raise ToolError(f"`{key}` must be a line number (a whole number from 1), not {json.dumps(value)[:50]}")
    return value


def _rel(ws: Workspace, a: dict, key: str, default: str) -> tuple[Path, str]:
    """A workspace path argument, resolved, and its spelling relative to the root as given to
    a command ("./x": never taken for an option)."""
    raw = _text(a, key, default)
    if raw.lstrip().startswith("-"):
        raise ToolError(f"{key} {raw[:100]!r}: a path must not start with '-'")
    path = ws.resolve(raw)
    rel = str(path.relative_to(ws.path))
    return path, "." if rel == "." else "./" + rel


def _lines(path: Path, start=None, end=None) -> str:
    text = path.read_text(errors="replace").splitlines()
    start = start or 1
    end = len(text) if end is None else min(len(text), end)
    return "\n".join(f"{i:5d}  {text[i - 1]}" for i in range(start, end + 1)) or "(no lines in that range)"


def _search(ws: Workspace, a: dict, timeout: float) -> str:
    """`grep -E` run in the sandbox (read-only, with a timeout): a regex of the model never runs
    in this process; grep does not follow links inside the folder and the target is in the tree."""
    pattern = _text(a, "pattern")
    if not pattern or "\n" in pattern or "\0" in pattern:
        raise ToolError("`pattern` must be a non-empty one-line regular expression")
    _, target = _rel(ws, a, "path", ".")
    rc, out, _ = ws.run(["grep", "-rnHIE", "--exclude-dir=.git", "--color=never", "-m", str(SEARCH_LIMIT),
                         "-e", pattern, "--", target], min(timeout, SEARCH_TIMEOUT), writable=False)
    if rc is None:
        return f"Error: the search took over {min(timeout, SEARCH_TIMEOUT):g} s; use a simpler pattern"
    if rc == 2:
        raise ToolError(f"grep: {out.strip()[-300:]}")
    hits = []
    for line in out.splitlines()[:SEARCH_LIMIT]:
        name, _, rest = line.partition(":")
        number, _, text = rest.partition(":")
        hits.append(f"{name.removeprefix('./')}:{number}: {text.strip()[:200]}")
    return "\n".join(hits) or "no matches"


def run_tool(ws: Workspace, call: ToolCall, timeout: float, bash: bool) -> tuple[str, bool]:
    """Execute one file or test tool in `ws`; returns (result text, error?). A malformed call
    (wrong types, ranges, paths) gets an error message, never an exception."""
    a, name = call.arguments, call.name
    if not isinstance(a, dict):
        return f"Error: the arguments of {name} must be an object", True
    try:
        if name == "list_files":
            top, _ = _rel(ws, a, "path", ".")
            if not top.is_dir():
                return f"Error: {a.get('path')} is not a folder", True
            entries = []
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames[:] = sorted(d for d in dirnames if d != ".git")
                rel = Path(dirpath).relative_to(ws.path)
                entries += [f"{rel / d}/" for d in dirnames] + [str(rel / f) for f in sorted(filenames)]
                if len(entries) > LIST_LIMIT:
                    break
            shown = [e.removeprefix("./") for e in entries[:LIST_LIMIT]]
            more = f"\n[... {len(entries) - LIST_LIMIT} more]" if len(entries) > LIST_LIMIT else ""
            return "\n".join(shown) + more, False
        if name == "read_file":
            path, _ = _rel(ws, a, "path", None)
            start, end = _line(a, "start_line"), _line(a, "end_line")
            if not path.is_file():
                return f"Error: no file {a['path']}", True
            return _lines(path, start, end), False
        if name == "search":
            return _search(ws, a, timeout), False
        if name == "write_file":
            path, _ = _rel(ws, a, "path", None)
            content = _text(a, "content")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            return f"wrote {a['path']} ({len(content.splitlines())} lines)", False
        if name == "replace_in_file":
            path, _ = _rel(ws, a, "path", None)
            old, new = _text(a, "old"), _text(a, "new")
            if not path.is_file():
                return f"Error: no file {a['path']}", True
            text = path.read_text()
            count = text.count(old) if old else 0
            if count != 1:
                return (f"Error: `old` occurs {count} times in {a['path']}; it must occur exactly once "
                        "(include more surrounding lines)"), True
            path.write_text(text.replace(old, new, 1))
            return f"replaced 1 occurrence in {a['path']}", False
        if name == "run_tests":
            raw = _text(a, "path", "tests") or "tests"
            file, _, node = raw.partition("::")           # a test id: path::name
            _, target = _rel(ws, {"path": file}, "path", "tests")
            rc, out, _ = ws.run([test_python(ws.spec), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--",
                                 target + (f"::{node}" if node else "")], timeout)
            status = "timed out" if rc is None else f"exit code {rc}"
            return f"{status}\n{clip(out, TOOL_OUTPUT_CHARS)}", rc != 0
        if name == "bash" and bash:
            rc, out, _ = ws.run(["bash", "-c", _text(a, "command")], timeout)
            return json.dumps({"returncode": rc if rc is not None else -9,     # (room for the JSON around it)
                               "output": clip(out, TOOL_OUTPUT_CHARS - 200)}, ensure_ascii=False), rc != 0
    except (ValueError, TypeError, OverflowError, OSError, UnicodeError, re.error) as e:
        return f"Error: {e}", True
    return f"Error: unknown tool {name!r}", True
