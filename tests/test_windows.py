"""What Windows needs of the code, checked on any system: every module imports without the
POSIX-only standard modules (a top-level `import fcntl` stopped every run there), and the run
lock's Windows path (msvcrt) takes, refuses and releases the lock as the POSIX path does."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from minscope import files

ROOT = Path(__file__).resolve().parents[1]

# Standard modules that exist on Linux and macOS but not on Windows.
POSIX_ONLY = ("fcntl", "resource", "pwd", "grp", "termios", "tty", "pty", "syslog")

IMPORT_ALL = """
import importlib, json, pkgutil, sys, warnings
for name in sys.argv[1].split(","):
    sys.modules[name] = None             # `import name` now raises ImportError, as on Windows
warnings.simplefilter("ignore")          # (filelock notes that it falls back to a soft lock)
import minscope
names = [m.name for m in pkgutil.walk_packages(minscope.__path__, "minscope.")] + ["train", "eval"]
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps({"imported": len(names) - len(failed), "failed": failed}))
"""


def import_everything(blocked) -> dict:
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, ",".join(blocked)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_module_imports_without_fcntl():
    result = import_everything(["fcntl"])
    assert result["failed"] == {}
    assert result["imported"] > 40          # the walk found the package (54 modules and the two scripts)


def test_every_module_imports_without_any_posix_only_module():
    assert import_everything(POSIX_ONLY)["failed"] == {}


@pytest.fixture
def windows_lock(monkeypatch):
    """files' Windows path on this system: a stand-in msvcrt that records its byte locks (the
    first try finds the byte taken, as when another process holds it), and the POSIX process
    check in place of the Windows one, which needs kernel32."""
    calls = []
    busy = [True]

    def locking(fd, mode, nbytes):
        if mode == fake.LK_NBLCK and busy[0]:
            busy[0] = False
            calls.append("busy")
            raise OSError(36, "Resource deadlock avoided")
        calls.append({fake.LK_NBLCK: "lock", fake.LK_UNLCK: "unlock"}[mode])

    fake = types.SimpleNamespace(LK_UNLCK=0, LK_LOCK=1, LK_NBLCK=2, locking=locking)
    monkeypatch.setitem(sys.modules, "msvcrt", fake)
    monkeypatch.setattr(files, "WINDOWS", True)
    monkeypatch.setattr(files, "_windows_pid_alive", _posix_alive)
    return calls


def _posix_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_the_windows_lock_takes_refuses_and_releases(tmp_path, windows_lock):
    lock = files.RunLock(tmp_path).acquire()
    assert (tmp_path / "lock").read_text().startswith(f"{os.getpid()}\n") and (tmp_path / "lock.guard").exists()
    assert windows_lock == ["busy", "lock", "unlock"]          # it waited for the byte, then let it go
    lock.release()
    assert not (tmp_path / "lock").exists()
    assert windows_lock[3:] == ["lock", "unlock"]


def test_the_windows_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path, windows_lock):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / "lock").write_text(f"{live.pid}\n")
        with pytest.raises(SystemExit, match=f"in use: process {live.pid}"):
            files.RunLock(tmp_path).acquire()
        assert windows_lock.count("lock") == windows_lock.count("unlock") == 1   # released on the refusal too
        (tmp_path / "lock").write_text(f"{dead.pid}\n")
        notes = []
        lock = files.RunLock(tmp_path, warn=notes.append).acquire()
        assert (tmp_path / "lock").read_text().startswith(f"{os.getpid()}\n")
        assert len(notes) == 1 and f"process {dead.pid}, which is no longer running" in notes[0]
        lock.release()
    finally:
        live.kill()
        live.wait()


@pytest.mark.skipif(os.name != "nt", reason="the Windows process check needs kernel32")
def test_the_windows_process_check(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert files.pid_alive(os.getpid()) and not files.pid_alive(dead.pid)
