"""Files that an interruption cannot leave half-written, and the checks that read them back.

Writes: a temporary file next to the target, then a rename over the target (`os.replace` is
atomic on one file system). Every piece of run state that `--resume` reads back goes through
these functions. Reads: a damaged file stops the run with one message naming the file
(`RunFileError`), except the one damage an interruption does leave behind, a half-written
last line of an append-only JSONL log, which is dropped with a note.

`RunLock` keeps two processes from training in one run folder at once, also from two pid
namespaces (containers) or hosts (POSIX: `fcntl.flock`; Windows: `msvcrt.locking`).
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


def lock_identity() -> dict:
    """Who takes a run lock: the pid, the host name, the kernel's boot id (the same in every
    container of one kernel, new at every boot) and the pid namespace (the pid means something
    only inside it). Where there is no /proc (macOS, Windows) the last two are missing."""
    import socket

    ident = {"pid": os.getpid(), "host": socket.gethostname()}
    with contextlib.suppress(OSError):
        ident["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    with contextlib.suppress(OSError, AttributeError):
        ident["pidns"] = os.readlink("/proc/self/ns/pid")
    return ident


def _life_flock(fd: int, exclusive: bool) -> bool | None:
    """A non-blocking `flock` of the open file `fd`: True when taken, False when another open
    file holds it, None where there is none (Windows; a file system without flock)."""
    if WINDOWS:
        return None
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:          # ENOLCK, EOPNOTSUPP: this file system keeps no flocks
        return None


class RunLock:
    """`RUN_DIR/lock` names the process training in RUN_DIR: its pid on the first line, then its
    host, boot id and pid namespace (`lock_identity`), and whether it holds the lock file's
    `flock` for its whole life. A second process is refused while that holder may be alive; the
    lock of one that is certainly gone (killed, crashed) is taken over with a note. The lock is
    removed by `release()` or when the process exits.

    Is the holder alive? The kernel drops an `flock` with its process, and one kernel sees every
    flock of its files, whatever pid namespace (container) took it: a held flock means alive, a
    free one means gone when the holder ran on this kernel (the same boot id). A holder on another
    kernel (another host: NFS shares files between hosts, but not reliably their locks) or, without
    a flock, in another pid namespace cannot be checked, so it counts as alive: the refusal says
    how to clear the lock by hand. Without a flock (Windows, or a file system that keeps none) a
    holder of this host and namespace is checked by its pid; so is a bare-pid lock left by an
    older minscope.

    Taking it is atomic: the identity is written to a private file first, flocked, then
    hard-linked to `lock` (a link never replaces an existing file), so no process ever reads an
    empty lock. Checking a holder and taking over a dead one's lock happen under an `flock` of the
    run folder itself, which the kernel releases when its process dies: two processes that both
    find a stale lock cannot both remove it and both take it. (Windows, which cannot lock a
    folder: a `msvcrt.locking` byte lock of `RUN_DIR/lock.guard`, also dropped with its process.)"""

    def __init__(self, run_dir, warn=note):
        self.path = Path(run_dir) / "lock"
        self.warn = warn
        self.held = False
        self.me = lock_identity()
        self._fd = None                 # the open lock file whose flock this process holds

    def record(self) -> dict | None:
        """The holder's identity as `lock` records it (None: no lock, or an unreadable one)."""
        try:
            lines = self.path.read_text().splitlines()
            rec = {"pid": int(lines[0].split()[0])}
        except (OSError, ValueError, IndexError, UnicodeDecodeError):
            return None      # gone, or an empty file left by an older minscope killed while taking it
        for line in lines[1:]:
            key, _, value = line.partition(" ")
            rec[key] = value
        return rec

    def holder(self) -> int | None:
        rec = self.record()
        return rec and rec["pid"]

    def _mine(self, rec) -> bool:
        return rec is not None and all(rec.get(k) == str(v) if k != "pid" else rec[k] == v
                                       for k, v in self.me.items())

    def _link(self) -> bool:
        """Make `lock` hold this process's identity, if no lock exists; False if one does."""
        tmp = self.path.with_name(f"lock.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        flocked = _life_flock(fd, exclusive=True)
        os.write(fd, ("\n".join([str(self.me["pid"])] + [f"{k} {v}" for k, v in self.me.items() if k != "pid"]
                                + [f"flock {int(bool(flocked))}"]) + "\n").encode())
        if not flocked:                 # nothing to hold open (and Windows removes no open file)
            os.close(fd)
            fd = None
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            if fd is not None:
                os.close(fd)
            return False
        finally:
            tmp.unlink(missing_ok=True)
        self._fd = fd                   # held open (and flocked) until release or exit
        return True

    def _alive(self, rec) -> str | None:
        """Why the holder `rec` may still be training (None: it is certainly gone)."""
        pid, host = rec["pid"], rec.get("host")
        if rec.get("flock") == "1":
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    free = _life_flock(fd, exclusive=False)
                finally:
                    os.close(fd)
                if free is False:
                    return "alive"              # it holds its flock: it runs
                same_kernel = rec.get("boot") == self.me.get("boot") and (
                    rec.get("boot") is not None or host == self.me["host"])
                if free and same_kernel:
                    return None                 # this kernel would hold its flock for it
        if host is not None and (host != self.me["host"] or rec.get("boot") != self.me.get("boot")):
            return f"unknown: it ran on host {host}" + (" (another kernel: another machine, or before a reboot)"
                                                        if host == self.me["host"] else "")
        if rec.get("pidns") is not None and rec["pidns"] != self.me.get("pidns"):
            return f"unknown: it ran in another pid namespace ({rec['pidns']}: another container)"
        return "alive" if pid_alive(pid) else None

    def acquire(self) -> "RunLock":
        with _folder_lock(self.path.parent):
            if not self._link():
                rec = self.record()
                if self._mine(rec):               # this process holds it already
                    self.held = True
                    return self
                why = self._alive(rec) if rec is not None else None
                pid = rec and rec["pid"]
                if why == "alive":
                    raise RunFileError(
                        f"{self.path.parent} is in use: process {pid} is training in it (see {self.path}). "
                        f"Wait for it to finish or stop it; if process {pid} is not a run of this "
                        f"folder, delete {self.path}")
                if why is not None:
                    raise RunFileError(
                        f"{self.path.parent} is in use: process {pid} holds {self.path}, and whether it still "
                        f"runs cannot be checked from here ({why.partition(': ')[2]}). If no process is "
                        f"training in this folder any more, delete {self.path} by hand and try again")
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
                if self._mine(self.record()):
                    self.path.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)          # closing it releases its flock
            self._fd = None
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
