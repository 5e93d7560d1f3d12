"""CooperBench's official evaluation, run locally without Docker.

CooperBench (github.com/cooperbench/CooperBench, MIT) grades a feature by running the task's
`runner.sh` in the task's Docker image, and a pair of coders by merging their two patches
(`src/cooperbench/eval/sandbox.py::test_merged`) and running both features' tests on the
merged tree. This module does the same steps with git and a subprocess:

  evaluate_feature (runner.sh): a temporary clone at the base commit; the patch applied with
      `git apply --ignore-whitespace --ignore-space-change`, falling back to `git apply
      --3way`; the feature's tests.patch applied the same way; the test command of runner.sh
      (e.g. `python -m pytest tests/test_other.py -v`). Passed = exit code 0 and more than 0
      tests passed, the counts read from pytest's summary as the official parser reads them.
  evaluate_pair (test_merged): test-file hunks stripped from both patches; branch agent1 gets
      patch 1 and agent2 patch 2 (`git apply || git apply --3way`, committed even when empty);
      on agent2 `git merge agent1 --no-commit --no-ff`; on a conflict `* merge=union` goes into
      .gitattributes (not staged) and the merge is redone; `git diff BASE HEAD` is the merged
      patch, and each feature's runner.sh runs on a fresh tree with it. Success = both pass.

The test commands run model-written code, so they run in `minscope.sandbox` (bubblewrap: no
network, only the tree and a scratch HOME writable, the tree's .git read-only); clones copy
their objects (`--no-hardlinks`), so nothing reaches the user's repository; the scratch folder
goes at exit and on SIGTERM.

Instead of `pip install -e .` in the image, the patched tree goes first on PYTHONPATH (the repo
root, or `src/`) of a Python whose virtual environment holds only the task's test dependencies
(built once per dependency set and cached, so later runs are offline). That is what makes a
task runnable here: its tests must need nothing but pure-Python packages from pip. MANIFEST
lists the 7 such tasks of CooperBench (import root, dependencies, timeout); the test command
itself is read from the task's runner.sh. Any other task needs a `TaskSpec` of your own.

Deliberate differences from the official code: an empty patch ("") means "no change" and runs
the tests on the base tree (runner.sh without a feature patch; the official `run_patch_test`
calls an empty agent patch an error, which fails too); `pip install` is not run; the union
merge's fallback is the one of the CooperBench version this was written against (44b4a7a;
later versions dropped it).

One file, though long: it mirrors the official evaluation (patch, merge, run the tests, read
the verdict) step by step so that it can be compared with it side by side.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .. import sandbox

OUTPUT_CHARS = 20_000        # test output kept in a result (head + tail); counts use all of it
READ_LIMIT = 8 * 2**20       # bytes of test output read back (a runaway test can print forever)
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


# --------------------------------------------------------------------------- the task
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


# --------------------------------------------------------------------------- processes
def _run(cmd, cwd, env=None, timeout=120, check=False) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                         errors="replace")
    if check and out.returncode != 0:
        raise EvalError(f"{' '.join(map(str, cmd))} failed in {cwd}: {(out.stderr or out.stdout).strip()[-500:]}")
    return out


def git_env(home) -> dict:
    """A clean environment for git: no user or system config, a fixed identity and dates."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
            "GIT_AUTHOR_NAME": "CooperBench Eval", "GIT_AUTHOR_EMAIL": "eval@cooperbench.local",
            "GIT_COMMITTER_NAME": "CooperBench Eval", "GIT_COMMITTER_EMAIL": "eval@cooperbench.local",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z"}


def git(args, cwd, check=False) -> subprocess.CompletedProcess:
    return _run(["git", *args], cwd, env=git_env(cwd), check=check)


def clip(text: str, limit: int = OUTPUT_CHARS) -> str:
    """`text` cut to `limit` characters: its head and tail, with a note of what was cut."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def run_limited(cmd, cwd, env, timeout, writable=(), readable=(), readonly_inside=(),
                unsafe=False) -> tuple[int | None, str, float]:
    """Run model-written code: `cmd` in `cwd` inside the sandbox (`minscope.sandbox.run`: no
    network, only `writable` writable, a timeout that kills every process it started, at most
    READ_LIMIT bytes of output read back). Returns (exit code or None on timeout, output, seconds).
    unsafe: where bwrap is missing, run it unsandboxed instead of raising SandboxUnavailable."""
    return sandbox.run(cmd, cwd, env, timeout, writable=writable, readable=readable,
                       readonly_inside=readonly_inside, unsafe=unsafe, read_limit=READ_LIMIT)


# --------------------------------------------------------------------------- scratch space
_ROOT: Path | None = None
_TEMP_ROOTS: list[Path] = []


def _remove_temp_roots(signum, frame):
    """SIGTERM (what torchrun and job schedulers send) skips atexit: remove the temporary
    folders, then die of the signal as before."""
    for path in _TEMP_ROOTS:
        shutil.rmtree(path, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def temp_root(prefix: str) -> Path:
    """A new temporary folder (its resolved path: a symlinked TMPDIR, as on macOS, gives one
    name for it everywhere), removed at exit and on SIGTERM."""
    path = Path(tempfile.mkdtemp(prefix=prefix)).resolve()
    _TEMP_ROOTS.append(path)
    atexit.register(shutil.rmtree, path, True)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _remove_temp_roots)
    return path


def scratch_root() -> Path:
    """This process's temporary folder (base trees, evaluation clones); removed at exit."""
    global _ROOT
    if _ROOT is None or not _ROOT.exists():
        _ROOT = temp_root("minscope-cooperbench-")
    return _ROOT


def cache_dir() -> Path:
    """Where test environments are cached: $MINSCOPE_CACHE/cooperbench, else ~/.cache/minscope/cooperbench."""
    root = os.environ.get("MINSCOPE_CACHE") or Path.home() / ".cache" / "minscope"
    return Path(root) / "cooperbench"


# --------------------------------------------------------------------------- the base tree
_BASES: dict = {}


def base_repo(repo, task_dir=None) -> Path:
    """A git repository (in the scratch folder, made once per process) whose branch
    `minscope-base` is the task's base tree. `repo`: a git clone holding the base commit
    (read, never written), or a `.tar.gz` of the base tree (`git archive` output; one top
    folder is stripped), which is unpacked and committed."""
    repo = Path(repo).expanduser().resolve()
    commit = base_commit(task_dir) if task_dir is not None else None
    key = (str(repo), commit)
    if key in _BASES and _BASES[key].exists():
        return _BASES[key]
    dest = Path(tempfile.mkdtemp(prefix="base-", dir=scratch_root()))
    if repo.is_file() and repo.name.endswith((".tar.gz", ".tgz", ".tar")):
        tree = dest / "tree"
        with tarfile.open(repo) as tar:
            tar.extractall(tree, filter="data")
        entries = list(tree.iterdir())
        top = entries[0] if len(entries) == 1 and entries[0].is_dir() else tree
        git(["init", "-q", "-b", "minscope-base", str(top)], dest, check=True)
        git(["add", "-A"], top, check=True)
        git(["commit", "-q", "--no-verify", "-m", "base"], top, check=True)
        _BASES[key] = top
        return top
    if not (repo / ".git").exists() and not (repo / "HEAD").is_file():
        raise EvalError(f"{repo}: neither a git clone nor a .tar.gz of the base tree")
    at = commit or "HEAD"
    if git(["cat-file", "-e", f"{at}^{{commit}}"], repo).returncode != 0:
        raise EvalError(f"{repo} does not hold the base commit {at} of {task_name(task_dir)}: "
                        f"fetch it (git -C {repo} fetch origin {at})")
    # --no-hardlinks: a copy of the objects, so nothing done to the clone can reach the user's repository
    git(["clone", "-q", "--no-hardlinks", "--no-checkout", str(repo), str(dest / "tree")], dest, check=True)
    git(["checkout", "-q", "-B", "minscope-base", at], dest / "tree", check=True)
    _BASES[key] = dest / "tree"
    return dest / "tree"


def clone_base(repo, task_dir, into) -> tuple[Path, str]:
    """A fresh working clone of the base tree at `into`; returns (path, base sha)."""
    src = base_repo(repo, task_dir)
    git(["clone", "-q", "--no-hardlinks", str(src), str(into)], Path(into).parent, check=True)
    sha = git(["rev-parse", "HEAD"], into, check=True).stdout.strip()
    return Path(into), sha


# --------------------------------------------------------------------------- test environments
def test_python(spec: TaskSpec) -> str:
    """The interpreter that runs a task's tests: spec.python, else a cached virtual environment
    holding exactly spec.deps (built on first use, with pip; offline afterwards)."""
    if spec.python:     # its folder's links resolved (the sandbox binds real paths), not the file's:
        return str(Path(spec.python).absolute().parent.resolve() / Path(spec.python).name)  # a venv's python is a link
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    key = hashlib.sha1("\n".join([version, *sorted(spec.deps)]).encode()).hexdigest()[:12]
    venv = Path(cache_dir()).resolve() / "venvs" / f"py{version}-{key}"
    python = venv / "bin" / "python"
    if (venv / "minscope-ok").is_file() and python.exists():
        return str(python)
    venv.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=venv.name + ".", dir=venv.parent))
    print(f"cooperbench: building the test environment {venv} ({', '.join(spec.deps) or 'no packages'})",
          file=sys.stderr)
    try:
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", str(tmp)] + ([] if spec.deps else ["--without-pip"]), tmp.parent,
             timeout=300, check=True)
        if spec.deps:
            out = _run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *spec.deps], tmp.parent, timeout=900)
            if out.returncode != 0:
                raise EvalError(f"pip could not install the test dependencies {list(spec.deps)}: "
                                f"{(out.stderr or out.stdout).strip()[-800:]}")
        (tmp / "minscope-ok").write_text("\n".join(spec.deps) + "\n")
        # `python -m` finds the venv from the interpreter's location, so a renamed venv works
        # (only its console scripts' shebangs would not, and none is used)
        shutil.rmtree(venv, ignore_errors=True)
        try:
            os.rename(tmp, venv)
        except OSError:
            if not (venv / "minscope-ok").is_file():   # (another process finished first: use its)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(python)


def test_env(tree: Path, spec: TaskSpec, home: Path, python=None) -> dict:
    """The environment of a test run: the patched tree first on PYTHONPATH, nothing inherited
    but PATH (the test interpreter's folder first, as `python` is the image's in Docker: tests
    run `python -c ...` as a command, and in the sandbox a PATH entry like a pyenv shim folder
    does not exist), HOME inside the scratch folder. TMPDIR stays the system's (/tmp; in the
    sandbox its private /tmp): some tests pass temporary file names to commands that read them
    as arguments (click's sed editor tests), so their verdicts depend on what those names look like."""
    path = os.environ.get("PATH", "/usr/bin:/bin")
    if python:
        path = f"{Path(python).parent}{os.pathsep}{path}"
    return {"PATH": path, "HOME": str(home),
            "LANG": "C.UTF-8", "PYTHONPATH": str((tree / spec.import_root).resolve()),
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8", **dict(spec.env)}


# --------------------------------------------------------------------------- patches
def sanitize_patch(patch: str | None) -> str:
    """As the official `_load_patch`: blank -> "", shell-escaped quotes fixed, a final newline."""
    if not patch or not patch.strip():
        return ""
    patch = patch.replace("'\\''", "'")
    return patch if patch.endswith("\n") else patch + "\n"


TEST_PATH_MARKS = ("/test_", "/tests/", "_test.py", "/test/", "tests.py")


def strip_test_files(patch: str) -> str:
    """Drop every file block of `patch` whose `diff --git` line names a test file (the
    official filter: the path contains /test_, /tests/, _test.py, /test/ or tests.py)."""
    if not patch:
        return patch
    kept, skip = [], False
    for line in patch.split("\n"):
        if line.startswith("diff --git"):
            skip = any(mark in line for mark in TEST_PATH_MARKS)
        if not skip:
            kept.append(line)
    out = "\n".join(kept)
    return out + "\n" if out and not out.endswith("\n") else out


def parse_counts(output: str) -> tuple[int, int]:
    """(passed, failed) as the official parser reads pytest output: the first "N passed",
    "N failed" and "N error" in the text (errors count as failed)."""
    passed = re.search(r"(\d+) passed", output)
    failed = re.search(r"(\d+) failed", output)
    errors = re.search(r"(\d+) error", output)
    return (int(passed[1]) if passed else 0,
            (int(failed[1]) if failed else 0) + (int(errors[1]) if errors else 0))


def runner_apply(tree: Path, patch_file: Path) -> tuple[bool, str]:
    """runner.sh's apply: whitespace-tolerant `git apply`, falling back to `git apply --3way`."""
    first = git(["apply", "--ignore-whitespace", "--ignore-space-change", str(patch_file)], tree)
    if first.returncode == 0:
        return True, ""
    second = git(["apply", "--3way", str(patch_file)], tree)
    return second.returncode == 0, (first.stderr + second.stderr).strip()


def run_runner(tree: Path, spec: TaskSpec, tests_patch: Path, feature_patch: Path | None, home: Path,
               unsafe: bool = False) -> dict:
    """runner.sh on `tree` (already at the base): reset and clean, the feature patch (when
    given: a file, possibly empty, as the official merged patch), the tests patch, the test
    commands, these in the sandbox (only `tree` and `home` writable, `tree/.git` not).
    Returns passed, rc, tests_passed, tests_failed, stage, test_seconds, output."""
    git(["reset", "-q", "--hard", "HEAD"], tree)
    git(["clean", "-q", "-fdx"], tree)
    result = {"passed": False, "rc": 1, "tests_passed": 0, "tests_failed": 0, "stage": None,
              "test_seconds": 0.0, "output": ""}
    for stage, patch in (("apply_feature", feature_patch), ("apply_tests", tests_patch)):
        if patch is None:
            continue
        ok, err = runner_apply(tree, patch)
        if not ok:                             # set -e: runner.sh stops with exit code 1
            result.update(stage=stage, output=clip(err))
            return result
    python, outputs, rc, seconds = test_python(spec), [], 0, 0.0
    for command in spec.tests:
        code, text, took = run_limited([python, "-m", *command], tree, test_env(tree, spec, home, python), spec.timeout,
                                       writable=(tree, home), readable=sandbox.python_dirs(python),
                                       readonly_inside=(tree / ".git",), unsafe=unsafe)
        outputs.append(text)
        seconds += took
        if code is None:
            result["stage"] = "timeout"
            rc = 124                           # what `timeout` returns
            break
        rc = code
        if rc != 0:                            # set -e: the first failing command ends runner.sh
            break
    output = "\n".join(outputs)
    passed, failed = parse_counts(output)
    result.update(passed=rc == 0 and passed > 0, rc=rc, tests_passed=passed, tests_failed=failed,
                  test_seconds=round(seconds, 2), output=clip(output))
    return result


# --------------------------------------------------------------------------- the public API
def _feature_dir(task_dir, feature) -> Path:
    path = Path(task_dir) / f"feature{int(feature)}"
    if not (path / "tests.patch").is_file():
        raise EvalError(f"{path / 'tests.patch'} not found: is {task_dir} a CooperBench task folder "
                        f"with a feature {feature}?")
    return path


def evaluate_feature(task_dir, repo, feature, patch: str, spec: TaskSpec | None = None,
                     keep_output: bool = True, unsafe_no_sandbox: bool = False) -> dict:
    """One feature's tests on the base tree with `patch` applied (runner.sh semantics).

    `repo`: a git clone holding the base commit, or a .tar.gz of the base tree. `patch`: the
    patch text; "" = no change. Test-file blocks are dropped from the patch first (as the
    official run_patch_test does); a non-empty patch with nothing else is an error (passed
    False). Returns passed, rc, tests_passed, tests_failed, stage (None, apply_feature,
    apply_tests, timeout), test_seconds, wall_seconds, output, error. The tests run in the
    sandbox; without bwrap, sandbox.SandboxUnavailable unless unsafe_no_sandbox.
    """
    start = time.perf_counter()
    sandbox.check(unsafe_no_sandbox)
    spec = task_spec(task_dir, spec)
    tests_patch = _feature_dir(task_dir, feature) / "tests.patch"
    patch = sanitize_patch(patch)
    filtered = sanitize_patch(strip_test_files(patch))
    if patch and not filtered:
        return {"passed": False, "rc": None, "tests_passed": 0, "tests_failed": 0, "stage": "apply_feature",
                "test_seconds": 0.0, "wall_seconds": round(time.perf_counter() - start, 2), "output": "",
                "error": "Agent patch is empty (it only changed test files)"}
    work = Path(tempfile.mkdtemp(prefix="feature-", dir=scratch_root()))
    try:
        tree, _ = clone_base(repo, task_dir, work / "repo")
        feature_patch = None
        if filtered:
            feature_patch = work / "feature.patch"
            feature_patch.write_text(filtered)
        tests = work / "tests.patch"
        tests.write_text(tests_patch.read_text())
        home = work / "home"
        home.mkdir()
        result = run_runner(tree, spec, tests, feature_patch, home, unsafe_no_sandbox)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not keep_output:
        result.pop("output")
    result.update(wall_seconds=round(time.perf_counter() - start, 2), error=None)
    return result


def _apply_branch(tree: Path, name: str, base: str, patch_file: Path, patch: str) -> str:
    """A branch from `base` with the patch applied (`git apply || git apply --3way`) and
    committed even if empty: "applied", "skipped" (empty patch) or "failed"."""
    git(["checkout", "-q", "-b", name, base], tree, check=True)
    status = "skipped"
    if patch:
        ok = git(["apply", str(patch_file)], tree).returncode == 0 or \
            git(["apply", "--3way", str(patch_file)], tree).returncode == 0
        status = "applied" if ok else "failed"
    git(["add", "-A"], tree)
    git(["commit", "-q", "--no-verify", "--allow-empty", "-m", f"{name} changes"], tree)
    return status


def merge_patches(tree: Path, base: str, patch1: str, patch2: str, work: Path) -> tuple[dict, dict, str]:
    """test_merged's merge: returns (apply_status, merge, merged patch text)."""
    (work / "patch1.patch").write_text(patch1)
    (work / "patch2.patch").write_text(patch2)
    apply_status = {"agent1": _apply_branch(tree, "agent1", base, work / "patch1.patch", patch1),
                    "agent2": _apply_branch(tree, "agent2", base, work / "patch2.patch", patch2)}
    git(["checkout", "-q", "agent2"], tree, check=True)
    if git(["merge", "agent1", "--no-commit", "--no-ff"], tree).returncode == 0:
        status, strategy = "clean", "naive"
    else:
        git(["merge", "--abort"], tree)
        git(["reset", "-q", "--hard", "HEAD"], tree)
        attributes = tree / ".gitattributes"
        before = attributes.read_bytes() if attributes.exists() else None
        with attributes.open("a") as f:
            f.write("* merge=union\n")
        ok = git(["merge", "agent1", "--no-commit", "--no-ff"], tree).returncode == 0
        if before is None:
            attributes.unlink(missing_ok=True)
        else:
            attributes.write_bytes(before)
        status, strategy = "conflicts", "union" if ok else "union-failed"
        if not ok:
            git(["merge", "--abort"], tree)
            return apply_status, {"status": status, "strategy": strategy, "diff_lines": 0, "diff": ""}, ""
    git(["commit", "-q", "--no-verify", "--allow-empty", "-m", "merge"], tree)
    diff = git(["diff", base, "HEAD"], tree).stdout
    return apply_status, {"status": status, "strategy": strategy, "diff_lines": len(diff.splitlines()),
                          "diff": clip(diff, 5000)}, diff


def evaluate_pair(task_dir, repo, feature1, feature2, patch1: str, patch2: str,
                  spec: TaskSpec | None = None, keep_output: bool = False, unsafe_no_sandbox: bool = False) -> dict:
    """Two coders' patches merged as the official `test_merged` merges them, then each
    feature's tests on the merged tree. Coder 1 (patch1) implemented feature1.

    Returns apply_status ({"agent1", "agent2"}: applied | skipped | failed), merge ({"status":
    "clean" | "conflicts", "strategy": "naive" | "union" | "union-failed", "diff_lines",
    "diff"}), feature1 and feature2 (each as `evaluate_feature` reports), both_passed,
    wall_seconds, error. A union merge that still conflicts fails both features. The tests run
    in the sandbox; without bwrap, sandbox.SandboxUnavailable unless unsafe_no_sandbox.
    """
    start = time.perf_counter()
    sandbox.check(unsafe_no_sandbox)
    spec = task_spec(task_dir, spec)
    tests = [_feature_dir(task_dir, f) / "tests.patch" for f in (feature1, feature2)]
    p1, p2 = (sanitize_patch(strip_test_files(sanitize_patch(p))) for p in (patch1, patch2))
    work = Path(tempfile.mkdtemp(prefix="pair-", dir=scratch_root()))
    failed = {"passed": False, "rc": None, "tests_passed": 0, "tests_failed": 0, "stage": "merge",
              "test_seconds": 0.0, "output": ""}
    try:
        tree, base = clone_base(repo, task_dir, work / "repo")
        apply_status, merge, merged = merge_patches(tree, base, p1, p2, work)
        if merge["strategy"] == "union-failed":
            results = [dict(failed), dict(failed)]
        else:
            (work / "merged.patch").write_text(merged)
            home = work / "home"
            home.mkdir()
            results = []
            for i, test_patch in enumerate(tests):
                git(["checkout", "-q", "--force", base], tree)
                (work / f"tests{i + 1}.patch").write_text(test_patch.read_text())
                results.append(run_runner(tree, spec, work / f"tests{i + 1}.patch", work / "merged.patch", home,
                                          unsafe_no_sandbox))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not keep_output:
        for r in results:
            r.pop("output", None)
    return {"apply_status": apply_status, "merge": merge, "feature1": results[0], "feature2": results[1],
            "both_passed": bool(results[0]["passed"] and results[1]["passed"]),
            "wall_seconds": round(time.perf_counter() - start, 2), "error": None}
