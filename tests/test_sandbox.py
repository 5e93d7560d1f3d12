"""The sandbox of model-written code (minscope/sandbox.py) and the CooperBench tools under
hostile input: each `test_case_N_...` is case N of the attack list the sandbox was built
against (option-like paths, model tests writing outside, shared git objects, malformed
arguments, catastrophic regexes, links out of the tree, output floods, background
processes, a symlinked TMPDIR, SIGTERM). One fixture task and one workspace serve them all.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_cooperbench import NAME, SPEC, env_for, gold, make_task, need_bwrap

from minscope import sandbox
from minscope.envs import cooperbench as cb
from minscope.envs import cooperbench_eval as ev
from minscope.envs import cooperbench_local as cb_local
from minscope.envs import cooperbench_task as cb_task
from minscope.envs.base import Episode, Turn
from minscope.toolcalls import ToolCall, format_tool_call

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_task(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="module")
def env(toy):
    need_bwrap()
    return env_for(toy[0], max_turns=50, bash=True)


@pytest.fixture(scope="module")
def ep(env):
    episode = Episode(task=env.tasks("train")[0], group=0)
    yield episode
    for ws in episode.info.get("workspaces", {}).values():
        ws.remove()


@pytest.fixture(scope="module")
def ws(env, ep):
    return env.workspace(ep, "agent")


@pytest.fixture
def outside():
    """A folder outside every workspace, holding a secret and a file that must stay as it is."""
    with tempfile.TemporaryDirectory(prefix="outside-") as d:
        d = Path(d).resolve()
        (d / "secret.txt").write_text("SECRET-TOKEN\n")
        (d / "keep").mkdir()
        (d / "keep" / "data.txt").write_text("keep me\n")
        yield d


def tool(ws, name, timeout=60, **args):
    return cb.run_tool(ws, ToolCall(name, args), timeout, True)


def write_test(ws, name, body):
    """A model-written test file in the workspace."""
    text, error = tool(ws, "write_file", path=f"tests/{name}", content=body)
    assert not error, text


def no_process_with(marker: str) -> bool:
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and marker.encode() in (p / "cmdline").read_bytes():
                os.kill(int(p.name), 9)           # (a survivor, on code that lets them live)
                return False
        except OSError:
            continue
    return True


# --------------------------------------------------------------------------- the sandbox itself
def test_the_sandbox_shows_only_the_system_the_interpreter_and_the_workspace(tmp_path, outside):
    need_bwrap()
    work = tmp_path / "work"
    work.mkdir()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    probe = f"""
import os, socket, pathlib
home = pathlib.Path({str(Path.home())!r})
print("home", sorted(os.listdir(home)) if home.exists() else None)
print("outside", os.path.exists({str(outside / 'secret.txt')!r}))
for target in ("/usr/minscope-x", "/minscope-x", "{work}/.git/x"):
    try:
        open(target, "w"); print("wrote", target)
    except OSError as e:
        print("refused", target, e.errno)
open("{work}/ok.txt", "w").write("ok")
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2); print("connected")
except OSError as e:
    print("no network", e.errno)
print("caps", [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")])
print("pid", os.getpid())
"""
    (work / ".git").mkdir()
    rc, out, _ = sandbox.run([PY, "-c", probe], work, {"PATH": "/usr/bin:/bin"}, 30, writable=[work],
                             readable=sandbox.python_dirs(PY), readonly_inside=[work / ".git"])
    server.close()
    assert rc == 0, out
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    visible = [str(d) for d in sandbox.python_dirs(PY)]
    home = eval(lines["home"])        # only the folders leading to the interpreter, nothing else of the home
    assert home is None or all(any(v.startswith(str(Path.home() / h)) for v in visible) for h in home)
    assert lines["outside"] == "False" and lines["no"].startswith("network") and "connected" not in lines
    assert out.count("refused") == 3 and (work / "ok.txt").read_text() == "ok"
    assert lines["caps"] == "['0000000000000000']" and lines["pid"] != str(os.getpid())


def test_memory_and_process_limits_stop_a_hog_and_a_fork_bomb(tmp_path):
    need_bwrap()
    small = sandbox.Limits(memory_bytes=2**30, processes=40)
    hog = "try:\n    b = bytearray(2 * 2**30)\n    print('allocated')\nexcept MemoryError:\n    print('MemoryError')"
    rc, out, _ = sandbox.run([PY, "-c", hog], tmp_path, {}, 30, readable=sandbox.python_dirs(PY), limits=small)
    assert out.strip() == "MemoryError", out
    if not sandbox.processes_capped():
        pytest.skip("root here and no pids cgroup can be made: the process count is not capped "
                    "(a fork bomb runs until the timeout)")
    bomb = ("import os, time\nn = 0\ntry:\n    while n < 500:\n        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped', n)\n")
    rc, out, took = sandbox.run([PY, "-c", bomb], tmp_path, {}, 60, readable=sandbox.python_dirs(PY), limits=small)
    assert rc == 0 and out.startswith("stopped") and int(out.split()[1]) < 50, out
    assert rc is not None                     # it ended by itself, long before the timeout


def test_without_bwrap_the_env_refuses_unless_told_it_is_unsafe(toy, monkeypatch):
    monkeypatch.setattr(sandbox, "unavailable", lambda: "bwrap (bubblewrap) is not installed")
    with pytest.raises(cb_task.EvalError, match="cannot run model-written code safely.*--unsafe-no-sandbox"):
        env_for(toy[0])
    with pytest.raises(sandbox.SandboxUnavailable):
        ev.evaluate_feature(toy[0], toy[1], 1, "", spec=SPEC)
    # train.py --env cooperbench: one line naming the flag; with --unsafe-no-sandbox it starts
    import train
    from minscope.real_args import make_env

    argv = ["--env", "cooperbench", "--data", str(toy[0].parent.parent), "--repos", str(toy[1].parent),
            "--tasks", NAME]
    monkeypatch.setitem(cb_task.MANIFEST, NAME, SPEC)
    with pytest.raises(SystemExit, match="error: cannot run model-written code safely"):
        make_env(train.build_parser().parse_args(argv))
    assert make_env(train.build_parser().parse_args(argv + ["--unsafe-no-sandbox"])).unsafe
    unsafe = env_for(toy[0], unsafe_no_sandbox=True)
    episode = Episode(task=unsafe.tasks("train")[0], group=0)
    ws = unsafe.workspace(episode, "agent")
    try:
        text, error = tool(ws, "run_tests")
        assert not error and "1 passed" in text            # run, unsandboxed, as asked
        r = ev.evaluate_feature(toy[0], toy[1], 1, gold(toy[0], 1), spec=SPEC, unsafe_no_sandbox=True)
        assert r["passed"]
    finally:
        ws.remove()


# --------------------------------------------------------------------------- the attack list
def test_case_1_option_like_paths_never_reach_pytest(ws, outside):
    for arg in (f"--junitxml={outside / 'report.xml'}", f"--basetemp={outside / 'keep'}", "-p pdb", " -x"):
        text, error = tool(ws, "run_tests", path=arg)
        assert error and "must not start with '-'" in text, text
    for name in ("read_file", "list_files", "search"):
        text, error = tool(ws, name, path="--help", pattern="x")
        assert error and "must not start with '-'" in text
    text, error = tool(ws, "run_tests", path="tests/test_calc.py::test_add")    # a test id still works
    assert not error and "1 passed" in text
    assert not (outside / "report.xml").exists() and (outside / "keep" / "data.txt").read_text() == "keep me\n"


ESCAPE_TEST = """
import os, pathlib, socket
def test_escape():
    results = {{}}
    for target in ({outside_file!r}, {home_file!r}, "/usr/pwned.txt"):
        try:
            pathlib.Path(target).write_text("pwned")
            results[target] = "written"
        except OSError as e:
            results[target] = e.errno
    try:
        results["secret"] = open({secret!r}).read()
    except OSError as e:
        results["secret"] = e.errno
    raise AssertionError(f"RESULTS {{results}}")     # (a failure, so that pytest shows them)
"""


def test_case_2_model_code_cannot_write_or_read_outside_the_workspace(toy, ws, outside):
    home_file = Path.home() / f"minscope-pwned-{os.getpid()}.txt"
    body = ESCAPE_TEST.format(outside_file=str(outside / "pwned.txt"), home_file=str(home_file),
                              secret=str(outside / "secret.txt"))
    write_test(ws, "test_escape.py", body)
    text, _ = tool(ws, "run_tests", path="tests/test_escape.py")
    (verdict,) = [line for line in text.splitlines() if line.startswith("E ") and "RESULTS" in line]
    assert "SECRET-TOKEN" not in text and "written" not in verdict, verdict
    assert not (outside / "pwned.txt").exists() and not home_file.exists() and not Path("/usr/pwned.txt").exists()
    # the final evaluation runs merged model code the same way: here code that writes at import
    task, repo = toy
    clone = Path(tempfile.mkdtemp())
    try:
        subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
        evil = ("import pathlib\nfor t in (%r, %r):\n    try:\n        pathlib.Path(t).write_text('pwned')\n"
                "    except OSError:\n        pass\n" % (str(outside / "eval.txt"), str(home_file)))
        from test_cooperbench import GOLD, diff_of

        patch = diff_of(clone, {"calc.py": evil + GOLD[1][0]["calc.py"]})
    finally:
        subprocess.run(["rm", "-rf", str(clone)])
    r = ev.evaluate_feature(task, repo, 1, patch, spec=SPEC)
    assert r["passed"] and not (outside / "eval.txt").exists() and not home_file.exists()


CORRUPT_TEST = """
import os, pathlib
def test_corrupt():
    n = 0
    for root in (pathlib.Path(".git/objects"), pathlib.Path("../../../../.git/objects")):
        for p in root.rglob("*") if root.exists() else []:
            if p.is_file():
                try:
                    os.chmod(p, 0o644)
                    p.write_bytes(b"garbage")
                    n += 1
                except OSError:
                    pass
    assert n == 0, f"CORRUPTED {n}"
"""


def test_case_3_model_tests_cannot_corrupt_the_users_repository(toy, ws):
    _, repo = toy
    write_test(ws, "test_corrupt.py", CORRUPT_TEST)
    text, _ = tool(ws, "run_tests", path="tests/test_corrupt.py")
    assert "1 passed" in text, text
    fsck = subprocess.run(["git", "fsck", "--strict"], cwd=repo, capture_output=True, text=True)
    assert fsck.returncode == 0, fsck.stderr
    objects = [p for p in (repo / ".git" / "objects").rglob("*") if p.is_file()]
    assert objects and all(p.stat().st_nlink == 1 for p in objects)      # no object is shared
    assert cb_local.git(["fsck"], ws.path).returncode == 0 and "test_corrupt.py" in ws.patch()


def test_case_4_malformed_arguments_get_an_error_message_not_an_exception(env, ep):
    calls = ['{"name": "read_file", "arguments": {"path": "calc.py", "start_line": [1]}}',
             '{"name": "read_file", "arguments": {"path": "calc.py", "start_line": {"a": 1}}}',
             '{"name": "read_file", "arguments": {"path": "calc.py", "start_line": 1e999}}',
             '{"name": "read_file", "arguments": {"path": "calc.py", "end_line": -3}}',
             '{"name": "read_file", "arguments": {"path": "calc.py", "end_line": true}}',
             '{"name": "read_file", "arguments": {"path": 5}}',
             '{"name": "read_file", "arguments": {"path": "calc\\u0000.py"}}',
             '{"name": "read_file", "arguments": {}}',
             '{"name": "write_file", "arguments": {"path": "x.py", "content": {"a": 1}}}',
             '{"name": "replace_in_file", "arguments": {"path": "calc.py", "old": ["a"], "new": "b"}}',
             '{"name": "search", "arguments": {"pattern": ["def"]}}',
             '{"name": "search", "arguments": {"pattern": "("}}',
             '{"name": "list_files", "arguments": {"path": {"a": 1}}}',
             '{"name": "run_tests", "arguments": {"path": 1e999}}',
             '{"name": "bash", "arguments": {"command": ["ls"]}}',
             '{"name": "read_file", "arguments": {"path": "%s"}}' % ("a/" * 3000)]
    ep.turns.append(Turn("agent", "\n".join(f"<tool_call>{c}</tool_call>" for c in calls)))
    step = env.after_turn(ep)
    results = [t for t in step.inject if t.to == "agent"]
    assert len(results) == len(calls)
    assert all(t.meta["error"] and t.text.startswith("Error") for t in results), [t.text for t in results]
    text, error = tool(ep.info["workspaces"]["agent"], "read_file", path="calc.py", start_line="4", end_line=4)
    assert not error and text == "    4  def add(a, b):"


def test_case_5_the_models_regex_never_runs_in_this_process_and_is_linear(ws, monkeypatch):
    (ws.path / "slow.txt").write_text("a" * 5000 + "!\n" + "aaa\n")

    def refuse(*args, **kwargs):
        raise AssertionError("a model's regex compiled in the trainer process")

    monkeypatch.setattr(re, "compile", refuse)
    monkeypatch.setattr(re, "search", refuse)
    text, error = tool(ws, "search", pattern="(a+)+$", path="slow.txt")       # exponential for backtracking
    assert not error and text == "slow.txt:2: aaa", text
    (ws.path / "slow.txt").unlink()


def test_case_6_search_never_follows_links_out_of_the_tree(ws, outside):
    (ws.path / "leak_dir").symlink_to(outside)
    (ws.path / "leak_file.txt").symlink_to(outside / "secret.txt")
    try:
        text, error = tool(ws, "search", pattern="SECRET")
        assert text == "no matches", text
        for path in ("leak_dir", "leak_file.txt"):
            text, error = tool(ws, "search", pattern="SECRET", path=path)
            assert error and "outside the repository" in text
    finally:
        (ws.path / "leak_dir").unlink()
        (ws.path / "leak_file.txt").unlink()


def test_case_7_output_floods_stop_at_the_file_size_limit(ws, tmp_path):
    write_test(ws, "test_flood.py", "import sys\ndef test_flood():\n    while True:\n        sys.stdout.write('y' * 65536)\n")
    text, error = tool(ws, "run_tests", timeout=60, path="tests/test_flood.py")
    assert error and "timed out" not in text and len(text) <= cb.TOOL_OUTPUT_CHARS + 100
    (ws.path / "tests" / "test_flood.py").unlink()
    out = json.loads(tool(ws, "bash", command="yes > big.txt; ls -l big.txt")[0])
    assert "File size limit exceeded" in out["output"]
    assert (ws.path / "big.txt").stat().st_size <= sandbox.Limits().file_bytes
    (ws.path / "big.txt").unlink()
    rc, out, _ = sandbox.run(["yes"], tmp_path, {}, 60, limits=sandbox.Limits(file_bytes=2**20))
    assert rc is not None and rc != 0 and len(out) <= 2**20      # the captured output too


def test_case_8_background_processes_die_with_the_call(ws):
    out = json.loads(tool(ws, "bash", command="(setsid sleep 987.61 &); nohup sleep 987.62 >/dev/null 2>&1 & "
                               "disown; echo started")[0])
    assert out["returncode"] == 0 and "started" in out["output"]
    write_test(ws, "test_bg.py", "import subprocess, time\ndef test_bg():\n"
               "    subprocess.Popen(['setsid', 'sleep', '987.63'], start_new_session=True)\n    time.sleep(60)\n")
    text, error = tool(ws, "run_tests", timeout=3, path="tests/test_bg.py")
    assert text.startswith("timed out")
    (ws.path / "tests" / "test_bg.py").unlink()
    time.sleep(0.2)
    assert no_process_with("987.6"), "a background process outlived its tool call"


def test_case_9_a_symlinked_tmpdir_works_and_every_result_is_clipped(toy, tmp_path, monkeypatch):
    need_bwrap()
    real = tmp_path / "real-tmp"
    real.mkdir()
    (tmp_path / "link-tmp").symlink_to(real)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "link-tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(cb_local, "_ROOT", None)
    env = env_for(toy[0])
    episode = Episode(task=env.tasks("train")[0], group=0)
    ws = env.workspace(episode, "agent")
    try:
        for name, args in (("list_files", {}), ("search", {"pattern": "def add"}), ("run_tests", {})):
            text, error = tool(ws, name, **args)
            assert not error, (name, text)
        assert real in ws.path.parents                                     # (the one name it has)
        (ws.path / "huge.py").write_text(("x" * 99 + "\n") * 25_000)       # 2.5 M characters
        episode.turns.append(Turn("agent", format_tool_call("read_file", {"path": "huge.py"})))
        (result,) = env.after_turn(episode).inject
        assert not result.meta["error"] and len(result.text) <= cb.TOOL_OUTPUT_CHARS + 100
        assert "characters cut" in result.text
    finally:
        ws.remove()


SIGTERM_CHILD = """
import sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from minscope.envs.base import Episode
from test_cooperbench import env_for
from pathlib import Path
env = env_for(Path({task!r}))
ws = env.workspace(Episode(task=env.tasks("train")[0], group=0), "agent")
print(ws.dir, flush=True)
time.sleep(120)
"""


def test_case_10_sigterm_removes_the_temporary_clones(toy):
    need_bwrap()
    code = SIGTERM_CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), task=str(toy[0]))
    child = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        workspace = Path(child.stdout.readline().strip())
        assert workspace.is_dir() and workspace.parent.name.startswith("minscope-coders-")
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == -signal.SIGTERM      # it still dies of the signal
    finally:
        child.kill()
        child.wait()
    assert not workspace.parent.exists()
