"""What stands in for a CooperBench task's Docker image: git, the sandbox, clones, test venvs.

The base tree is cloned (objects copied, so nothing reaches the user's repository) into a
scratch folder that goes at exit and on SIGTERM; git runs with a clean, fixed configuration;
model-written code runs in `minscope.sandbox` (no network, only the tree and a scratch HOME
writable); a task's tests run with a Python whose cached virtual environment holds only
their dependencies, the patched tree first on PYTHONPATH.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path

from .. import sandbox
from .cooperbench_task import EvalError, TaskSpec, base_commit, task_name

OUTPUT_CHARS = 20_000        # test output kept in a result (head + tail); counts use all of it
READ_LIMIT = 8 * 2**20       # bytes of test output read back (a runaway test can print forever)


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
