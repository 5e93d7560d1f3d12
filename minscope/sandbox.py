"""Where model-written code runs: a bubblewrap (`bwrap`) sandbox with resource limits.

CooperBench coders write code and tests that minscope then executes (their `run_tests`, the
optional `bash` tool, and the final evaluation of their merged patches). That code is
untrusted, so it runs here and never with the user's rights:

  * no network (`--unshare-all`: network, PID, IPC, UTS, cgroup and user namespaces);
  * only the system folders (/usr, /bin, /lib*, a few files of /etc), the test interpreter's
    folders and the workspace are visible; all read-only except the workspace (and, inside
    it, its .git stays read-only) and a private /tmp (a size-limited tmpfs). The user's home,
    SSH keys, API key files and other repositories are simply not there;
  * no capabilities (`--cap-drop ALL`), a new session (no terminal injection), a PID
    namespace and `--die-with-parent`: when the command ends or is killed, every process it
    started (`setsid ... &`, `nohup ... &`) dies with it;
  * resource limits set before bwrap starts (`prlimit`; inherited by everything inside): file size
    (which also caps the captured output on disk), CPU seconds, address space and processes.
    Linux does not apply RLIMIT_NPROC to root; as root the process count is capped with a
    pids cgroup when one can be made, otherwise a fork bomb runs until the wall-clock timeout.

Without bwrap (macOS, or a Linux without it) `run` refuses (SandboxUnavailable) unless the
caller passes unsafe=True, which runs the command directly with only the resource limits.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# only what programs need to start and find libraries, users and certificates
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/localtime", "/etc/mime.types",
                "/etc/ssl", "/etc/ca-certificates")
UNSAFE_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap), or pass "
               "--unsafe-no-sandbox to run model-written code with your own rights")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or does not work here, and the caller did not accept running unsandboxed."""


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits (each process inside gets the same rlimits)."""
    file_bytes: int = 64 * 2**20       # largest file a process may write (the output log included)
    memory_bytes: int = 4 * 2**30      # address space per process
    processes: int = 256               # tasks at once (threads count)
    tmp_bytes: int = 256 * 2**20       # the private /tmp


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the sandbox cannot be used here (None: it can). Probed once per process."""
    path = shutil.which("bwrap")
    if path is None:
        return "bwrap (bubblewrap) is not installed"
    try:
        with tempfile.TemporaryDirectory(prefix="minscope-probe-") as d:   # the very flags run() uses
            probe = subprocess.run([path, *bwrap_args(["true"], d, writable=[d])[1:]],
                                   capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap does not start ({e})"
    if probe.returncode != 0:
        return f"bwrap does not work here: {probe.stderr.strip()[-300:]}"
    return None


def check(unsafe: bool = False):
    """Raise SandboxUnavailable (one line, with the fix) unless the sandbox works or `unsafe`."""
    reason = unavailable()
    if reason and not unsafe:
        raise SandboxUnavailable(f"cannot run model-written code safely: {reason}; {UNSAFE_HINT}")


def python_dirs(python) -> list[Path]:
    """The folders an interpreter needs: its installation and, for a virtual environment, the
    venv itself (found from pyvenv.cfg) and the base installation it points to."""
    exe = Path(python)
    dirs = [exe.resolve().parent.parent]
    venv = exe.parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        dirs.append(venv.resolve())
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                dirs.append(Path(value.strip()).resolve().parent)
    return list(dict.fromkeys(dirs))


def bwrap_args(argv, cwd, writable=(), readable=(), readonly_inside=(), limits: Limits = Limits()) -> list[str]:
    """The bwrap command line that runs `argv` in `cwd` (see the module docstring)."""
    args = ["bwrap", "--unshare-all", "--cap-drop", "ALL", "--die-with-parent", "--new-session",
            "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--perms", "1777",
            "--tmpfs", "/tmp"]
    for d in SYSTEM_DIRS + SYSTEM_FILES:
        if os.path.lexists(d):
            # /bin, /lib... are links to /usr/... on merged-/usr systems: keep them links
            args += ["--symlink", os.readlink(d), d] if os.path.islink(d) and d in SYSTEM_DIRS \
                else ["--ro-bind", d, d]
    readable, writable = ([str(Path(d).resolve()) for d in ds] for ds in (readable, writable))
    cwd = str(Path(cwd).resolve())
    if not any(cwd == d or cwd.startswith(d.rstrip("/") + "/") for d in [*writable, *readable]):
        readable.insert(0, cwd)                # (a folder of its own: visible, read-only)
    for d in readable:                         # (later binds cover earlier ones: readable first)
        if d not in SYSTEM_DIRS and not d.startswith(tuple(p + "/" for p in SYSTEM_DIRS)):
            args += ["--ro-bind", d, d]
    for d in writable:
        args += ["--bind", d, d]
    for d in readonly_inside:
        if Path(d).exists():
            d = str(Path(d).resolve())
            args += ["--ro-bind", d, d]
    argv = [str(a) for a in argv]
    if argv and os.path.isabs(argv[0]):        # only real paths are bound: resolve links in its folder
        argv[0] = str(Path(argv[0]).parent.resolve() / Path(argv[0]).name)   # (a venv's python stays a link)
    # the sandbox's own root (where bwrap made the mount points) read-only too
    return args + ["--remount-ro", "/", "--chdir", cwd, "--", *argv]


def _tasks_of(uid: int) -> int:
    """Tasks (threads) this user runs now: RLIMIT_NPROC counts all of them."""
    n = 0
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and p.stat().st_uid == uid:
                n += len(os.listdir(p / "task"))
        except OSError:
            continue
    return n


def _pids_cgroup(limit: int) -> Path | None:
    """As root (whom RLIMIT_NPROC does not bind), a fresh pids cgroup capped at `limit`, where
    this system lets us make one (cgroup v1 `pids` hierarchy or v2 with the pids controller)."""
    if os.geteuid() != 0:
        return None
    for base in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        try:
            v2 = (base / "cgroup.subtree_control").exists()
            if v2 and "pids" not in (base / "cgroup.subtree_control").read_text().split():
                continue
            group = base / f"minscope-{uuid.uuid4().hex[:12]}"
            group.mkdir()
        except OSError:
            continue
        try:
            if (group / "pids.max").is_file():         # (a real cgroup makes it; a plain folder does not)
                (group / "pids.max").write_text(str(limit))
                return group
        except OSError:
            pass
        group.rmdir()
    return None


def processes_capped() -> bool:
    """Whether Limits.processes binds here: always for a user; for root only through a pids cgroup."""
    if os.geteuid() != 0:
        return True
    group = _pids_cgroup(1)
    if group is not None:
        _remove_cgroup(group)
    return group is not None


def _limited(cmd: list[str], limits: Limits, cpu_seconds: int, group: Path | None):
    """`cmd` behind the resource limits: (command, preexec function or None). The limits are
    set by `prlimit` and the cgroup joined by `sh` just before they exec, so no Python code
    runs in the forked child (preexec_fn is unsafe in a process with threads); without prlimit
    (macOS) a preexec function sets them instead."""
    import resource       # POSIX only: imported when a command runs, so the module imports on Windows

    nproc = _tasks_of(os.getuid()) + limits.processes      # (the count is per user, not per run)
    wanted = [(resource.RLIMIT_FSIZE, "fsize", limits.file_bytes), (resource.RLIMIT_AS, "as", limits.memory_bytes),
              (resource.RLIMIT_CPU, "cpu", cpu_seconds), (resource.RLIMIT_NPROC, "nproc", nproc),
              (resource.RLIMIT_CORE, "core", 0)]
    values = []
    for what, name, value in wanted:                        # (never above the hard limit we have)
        hard = resource.getrlimit(what)[1]
        values.append((what, name, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    prefix = []
    if group is not None:                                   # (a failed join leaves only the timeout)
        prefix = ["sh", "-c", 'echo $$ > "$0" 2>/dev/null; exec "$@"', str(group / "cgroup.procs")]
    prlimit = shutil.which("prlimit")
    if prlimit:
        return prefix + [prlimit, *(f"--{name}={value}" for _, name, value in values), "--", *cmd], None

    def preexec():
        for what, _, value in values:
            resource.setrlimit(what, (value, value))
    return prefix + cmd, preexec


def run(argv, cwd, env, timeout, writable=(), readable=(), readonly_inside=(), unsafe=False,
        limits: Limits = Limits(), read_limit: int = 8 * 2**20) -> tuple[int | None, str, float]:
    """Run `argv` sandboxed with a wall-clock timeout; output (stdout and stderr together)
    goes to a file, capped by the file-size limit, and at most `read_limit` bytes of it (head
    and tail) are read back.
    Returns (exit code, or None when it timed out; output; seconds).

    writable: folders the command may change (the workspace); readable: extra read-only
    folders (the test interpreter's, see python_dirs); readonly_inside: paths inside a
    writable folder that stay read-only (a workspace's .git). unsafe: without a working bwrap,
    run the command directly (only the resource limits apply) instead of refusing."""
    check(unsafe)
    if unavailable() is None:
        cmd = bwrap_args(argv, cwd, writable, readable, readonly_inside, limits)
        cmd[0] = shutil.which("bwrap")
    else:
        cmd = list(map(str, argv))
    group = _pids_cgroup(limits.processes + 8)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryFile() as out:
            cmd, preexec = _limited(cmd, limits, int(timeout) + 5, group)
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            _kill(proc, group)
            data = _read_capped(out, read_limit)
    finally:
        if group is not None:
            _remove_cgroup(group)
    return rc, data.decode("utf-8", "replace"), time.perf_counter() - start


def _kill(proc, group):
    """Kill what is left: the process group (bwrap takes its PID namespace down with it) and,
    unsandboxed or as a backstop, everything in the cgroup."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if group is not None:
        for _ in range(50):
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)


def _remove_cgroup(group: Path):
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:                        # (busy for a moment after its last process died)
            time.sleep(0.02)


def _read_capped(out, limit: int) -> bytes:
    size = out.seek(0, os.SEEK_END)
    out.seek(0)
    if size <= limit:
        return out.read()
    data = out.read(limit // 2) + b"\n[... output cut ...]\n"
    out.seek(size - limit // 2)
    return data + out.read()
