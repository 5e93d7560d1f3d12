"""A CooperBench task, read from its folder: its name, base commit, test commands and settings.

The official layout is `<repo>_task/task<N>/` with setup.sh or a Dockerfile (the base
commit), runner.sh (the test commands and their timeout) and `feature<K>/tests.patch`. What
the folder does not say, the import root and the tests' dependencies, a `TaskSpec` gives:
MANIFEST holds it for the pure-Python tasks minscope can run without Docker.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_TIMEOUT = 600        # seconds, when runner.sh has no `timeout N` of its own
# runner.sh's `pip install pytest pytest-xdist pytest_mock`, pinned. pytest >= 8.4 matters: it reports
# an exception in a test's thread as an error, which the reference verdicts count.
_PYTEST = ["pytest==9.2.0", "pytest-xdist==3.8.0", "pytest-mock==3.17.0"]


@dataclass(frozen=True)
class TaskSpec:
    """How to run one task's tests without its Docker image.

    import_root: the folder put first on PYTHONPATH ("." = repo root, "src" for src layouts).
    deps: pip requirements of the tests (pinned), installed into a cached virtual environment.
    tests: the test commands, each an argument list after `python -m` (default: read from
        runner.sh). timeout: seconds per test command (default: runner.sh's `timeout N`, else 600).
    python: run the tests with this interpreter instead of a cached venv (it must already have
        the deps, e.g. the running interpreter in tests).
    env: extra environment variables of the test runs, as (name, value) pairs.
    """
    import_root: str = "."
    deps: tuple = ()
    tests: tuple | None = None
    timeout: int | None = None
    python: str | None = None
    env: tuple = ()


# The pure-Python tasks of CooperBench (Python 3.11 in their Dockerfiles; base commits there).
MANIFEST: dict[str, TaskSpec] = {
    "samuelcolvin_dirty_equals_task/task43": TaskSpec(".", tuple(_PYTEST) + ("pytz==2024.2",)),
    "pallets_click_task/task2068": TaskSpec("src", tuple(_PYTEST)),
    "pallets_click_task/task2800": TaskSpec("src", tuple(_PYTEST)),
    "pallets_click_task/task2956": TaskSpec("src", tuple(_PYTEST)),
    "pallets_jinja_task/task1465": TaskSpec("src", tuple(_PYTEST) + ("markupsafe==3.0.2", "trio==0.27.0")),
    "pallets_jinja_task/task1559": TaskSpec("src", tuple(_PYTEST) + ("markupsafe==3.0.2", "trio==0.27.0")),
    "pallets_jinja_task/task1621": TaskSpec("src", tuple(_PYTEST) + ("markupsafe==3.0.2", "trio==0.27.0")),
}


class EvalError(ValueError):
    """A task, repository or setting the evaluator cannot use (the message says why)."""


def task_name(task_dir) -> str:
    """`<repo>_task/task<N>` from a task folder of the official layout."""
    p = Path(task_dir).resolve()
    return f"{p.parent.name}/{p.name}"


def base_commit(task_dir) -> str | None:
    """The base commit of a task: `BASE_COMMIT=` in setup.sh, else `git checkout SHA` in the Dockerfile."""
    task_dir = Path(task_dir)
    for name, pattern in (("setup.sh", r'BASE_COMMIT="?([0-9a-f]{7,40})'),
                          ("Dockerfile", r"git checkout ([0-9a-f]{7,40})")):
        path = task_dir / name
        if path.is_file():
            m = re.search(pattern, path.read_text(errors="replace"))
            if m:
                return m[1]
    return None


_SHELL_STOP = {"2>&1", "|", "||", "&&", ";", ">", ">>", "2>", "&"}


def runner_tests(task_dir) -> tuple[list[list[str]], int | None]:
    """The test commands of runner.sh (argument lists after `python -m`, e.g.
    ["pytest", "tests/test_other.py", "-v"]) and its `timeout N`, if any."""
    path = Path(task_dir) / "runner.sh"
    if not path.is_file():
        return [], None
    commands, timeout = [], None
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("#") or "pytest" not in line or line.startswith(("pip", "uv", "echo")):
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):    # VAR=value prefixes
            words = words[1:]
        if words[:1] == ["timeout"] and len(words) > 2:
            timeout, words = int(float(words[1].rstrip("s"))), words[2:]
        if words[:3] == ["python", "-m", "pytest"] or words[:3] == ["python3", "-m", "pytest"]:
            words = words[2:]
        elif words[:1] != ["pytest"]:
            continue
        cut = next((i for i, w in enumerate(words) if w in _SHELL_STOP), len(words))
        commands.append(words[:cut])
    return commands, timeout


def task_spec(task_dir, spec: TaskSpec | None = None) -> TaskSpec:
    """The settings of a task: `spec`, else MANIFEST; the test commands from runner.sh unless
    given. Unknown task or unreadable runner.sh: EvalError naming what is missing."""
    name = task_name(task_dir)
    if spec is None:
        spec = MANIFEST.get(name)
        if spec is None:
            raise EvalError(f"CooperBench task {name} is not one of the pure-Python tasks minscope can run "
                            f"without Docker ({', '.join(MANIFEST)}): its import root and test dependencies "
                            "are unknown; pass a TaskSpec for it")
    if spec.tests is None or spec.timeout is None:
        commands, timeout = runner_tests(task_dir)
        if spec.tests is None and not commands:
            raise EvalError(f"{Path(task_dir) / 'runner.sh'}: no `python -m pytest ...` line found, so the "
                            "tests of this task are unknown; give TaskSpec(tests=...)")
        spec = replace(spec, tests=spec.tests or tuple(tuple(c) for c in commands),
                       timeout=spec.timeout or timeout or DEFAULT_TIMEOUT)
    return spec
