"""Files that an interruption cannot leave half-written, and the checks that read them back.

Writes: a temporary file next to the target, then a rename over the target (`os.replace` is
atomic on one file system). Every piece of run state that `--resume` reads back goes through
these functions. Reads: a damaged file stops the run with one message naming the file
(`RunFileError`), except the one damage an interruption does leave behind, a half-written
last line of an append-only JSONL log, which is dropped with a note.

`RunLock` keeps two processes from training in one run folder at once (POSIX: `fcntl.flock`;
Windows: `msvcrt.locking`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch


class RunFileError(SystemExit):
    """A run's file cannot be read back: the message names it (no traceback)."""


def _replace(path, write) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def save_atomic(obj, path: Path) -> None:
    """torch.save, atomically."""
    _replace(path, lambda tmp: torch.save(obj, tmp))


def write_text_atomic(path: Path, text: str) -> None:
    """Path.write_text, atomically."""
    _replace(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def note(msg: str) -> None:
    print(f"note: {msg}", file=sys.stderr)


def read_jsonl(path: Path, warn=note) -> list[dict]:
    """The records of a JSONL log. A last line that does not parse is what a kill during a
    write leaves: it is dropped, with a note. Any other bad line means the file is damaged:
    RunFileError naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path}: cannot read it ({e})") from None
    numbered = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
    out = []
    for k, (lineno, ln) in enumerate(numbered):
        try:
            try:
                rec = json.loads(ln)
            except RecursionError:
                raise ValueError("nested too deeply") from None
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if k == len(numbered) - 1:
                warn(f"{path}: dropping its half-written last line {lineno} (left by an interrupted write)")
                break
            raise RunFileError(f"{path} is damaged: line {lineno} is not a JSON record ({e}); "
                               "fix or remove that line") from None
        out.append(rec)
    return out


def read_json(path: Path) -> dict:
    """A JSON object (config.json, best.json), or RunFileError naming the file."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise RunFileError(f"{path} is damaged: not readable JSON (nested too deeply)") from None
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RunFileError(f"{path} is damaged: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise RunFileError(f"{path} is damaged: expected a JSON object, found {type(obj).__name__}")
    return obj


def load_state(path: Path, needs=("step",)) -> dict:
    """torch.load of a saved state, or RunFileError naming the file (empty, truncated, or
    not a state written by train.py). Loaded onto the CPU (a state saved on a GPU resumes where
    torch sees none): the adapters and optimizers copy it onto their own device."""
    path = Path(path)
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:   # torch raises RuntimeError, EOFError, UnpicklingError, ... by damage
        why = (str(e).strip().splitlines() or [""])[0][:100]
        raise RunFileError(f"{path} is damaged ({type(e).__name__}: {why}); it cannot be resumed. "
                           "Delete it to restart that part of the run from scratch") from None
    missing = [k for k in needs if not isinstance(state, dict) or k not in state]
    if missing:
        raise RunFileError(f"{path} is not a state saved by train.py (no {', '.join(missing)})")
    return state


def truncate_log(path: Path, last_step: int) -> None:
    """Keep the lines of a JSONL metrics log up to step `last_step`: a resumed run redoes
    the steps after its saved state, and must not log them twice."""
    path = Path(path)
    if path.exists():
        kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


# --------------------------------------------------------------------------- run lock
WINDOWS = os.name == "nt"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything; on Windows,
    where os.kill(pid, 0) would terminate the process, the process is opened and asked)."""
    if pid <= 0:
        return False
    if WINDOWS:
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # exists, owned by someone else
        return True
    return True


def _windows_pid_alive(pid: int) -> bool:
    import ctypes
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    kernel32.OpenProcess.restype = wintypes.HANDLE
    kernel32.OpenProcess.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.DWORD)
    kernel32.GetExitCodeProcess.argtypes = (wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD))
    kernel32.CloseHandle.argtypes = (wintypes.HANDLE,)
    handle = kernel32.OpenProcess(0x1000, False, pid)     # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.get_last_error() == 5                # ERROR_ACCESS_DENIED: it exists, someone else's
    try:
        code = wintypes.DWORD()
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == 259                           # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


class RunLock:
    """`RUN_DIR/lock` holds the pid of the process training in RUN_DIR. A second process is
    refused while that pid is alive; a lock whose process is gone (killed, crashed) is taken
    over with a note. The lock is removed by `release()` or when the process exits.

    Taking it is atomic: the pid is written to a private file first, which is then hard-linked
    to `lock` (a link never replaces an existing file), so no process ever reads an empty
    lock. Checking a holder and taking over a dead one's lock happen under an `flock` of the
    run folder itself, which the kernel releases when its process dies: two processes that both
    find a stale lock cannot both remove it and both take it. (Windows, which cannot lock a
    folder: a `msvcrt.locking` byte lock of `RUN_DIR/lock.guard`, also dropped with its process.)"""

    def __init__(self, run_dir, warn=note):
        self.path = Path(run_dir) / "lock"
        self.warn = warn
        self.held = False

    def holder(self) -> int | None:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None      # gone, or an empty file left by an older minscope killed while taking it

    def _link(self) -> bool:
        """Make `lock` hold this pid, if no lock exists; False if one does."""
        tmp = self.path.with_name(f"lock.{os.getpid()}.tmp")
        tmp.write_text(f"{os.getpid()}\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def acquire(self) -> "RunLock":
        with _folder_lock(self.path.parent):
            if not self._link():
                pid = self.holder()
                if pid == os.getpid():           # this process holds it already
                    self.held = True
                    return self
                if pid is not None and pid_alive(pid):
                    raise RunFileError(
                        f"{self.path.parent} is in use: process {pid} is training in it (see {self.path}). "
                        f"Wait for it to finish or stop it; if process {pid} is not a run of this "
                        f"folder, delete {self.path}")
                self.warn(f"{self.path}: taking over the lock of process {pid}, which is no longer "
                          "running (an interrupted or killed run)")
                self.path.unlink(missing_ok=True)
                if not self._link():             # only a process without the folder lock could be here
                    raise RunFileError(f"{self.path}: could not take the lock (another process keeps taking it)")
        self.held = True
        atexit.register(self.release)
        return self

    def release(self) -> None:
        if self.held:
            with _folder_lock(self.path.parent):
                if self.holder() == os.getpid():
                    self.path.unlink(missing_ok=True)
        self.held = False
        atexit.unregister(self.release)

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive `flock` of `folder` (its directory file), held for the block: the kernel
    drops it when the process exits, so a killed holder never leaves it stale. Windows: see
    `_windows_folder_lock`."""
    if WINDOWS:
        with _windows_folder_lock(folder):
            yield
        return
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)            # closing the descriptor releases the flock


@contextlib.contextmanager
def _windows_folder_lock(folder: Path):
    """Windows opens no folder as a file: the lock is on the first byte of `folder/lock.guard`
    (`msvcrt.locking`, which Windows drops when the process exits). LK_NBLCK is tried until it
    succeeds, as flock waits; LK_LOCK would give up after 10 seconds."""
    import msvcrt

    fd = os.open(Path(folder) / "lock.guard", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
                break
            except OSError:
                time.sleep(0.01)
        try:
            yield
        finally:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)
