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

What a task is (its folder, runner.sh, MANIFEST) is read in cooperbench_task.py, and what
stands in for its Docker image (clones of the base tree, the test environments, the sandboxed
runs, the scratch folder) is cooperbench_local.py; this file is the evaluation's steps.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

from .. import sandbox
from .cooperbench_local import clip, clone_base, git, run_limited, scratch_root, test_env, test_python
from .cooperbench_task import EvalError, TaskSpec, task_spec


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
