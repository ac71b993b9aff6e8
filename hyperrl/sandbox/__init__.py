"""Running untrusted code — a model's program, its unit tests, an agent's ``python`` tool — in a sandbox.

Isolation comes from well-kept OS mechanisms, not from Python tricks (issue 50; docs/rewards.md has the threat
model). Each run is a fresh process tree:

* ``prlimit`` sets the resource limits every process of the tree inherits: CPU seconds, address space, processes,
  file size, open files;
* ``setpriv`` drops to an unprivileged uid (``nobody``) — root is exempt from the process limit, so a fork bomb run
  as root is stopped only by the machine's pid limit;
* ``bwrap`` (bubblewrap, the sandbox Flatpak uses) gives it new namespaces (``--unshare-all``: no network but its
  own loopback, its own pids — the trainer is not visible, let alone signalable — ipc, uts, cgroup), a root holding
  only ``/usr`` read-only (the system Python and its libraries: no home directories, no checkpoints, no repository),
  a private ``/tmp``, and one writable directory, the run's own, at ``/sandbox`` (the rest of its root is
  remounted read-only); ``--die-with-parent`` and the pid
  namespace end every process of the tree when its first one exits;
* here: a wall-clock deadline (the whole process group killed), stdout / stderr read to a byte limit (the tree is
  killed past it), stdin written from a thread (a program that never reads it cannot block the caller).

Why bubblewrap: it is packaged by every distribution (``apt-get install bubblewrap``), needs no daemon, and works
as root or unprivileged; nsjail is not packaged on Debian, firejail's setuid surface is larger, and raw
``unshare`` would leave the mount setup to this module. A machine without it gets :class:`SandboxUnavailable` at
construction, naming the package — never an unsandboxed run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hyperrl.errors import HyperRLError

__all__ = ["Limits", "SandboxResult", "Sandbox", "SandboxUnavailable", "VERDICTS", "allocate_uids"]

_UID_LOCK = threading.Lock()
_UID_NEXT: list[int] = []


def allocate_uids(n: int) -> list[int]:
    """``n`` unprivileged uids for sandboxes, this process's own: descending from ``HYPERRL_SANDBOX_UID_BASE``
    (default 65533, just below ``nobody`` — a bare ``Sandbox()``'s; a reward's worker process is given a block of its
    own), never handed out twice —
    the process limit counts a uid's processes, so sandboxes running at once must not share one."""
    with _UID_LOCK:
        if not _UID_NEXT:
            _UID_NEXT.append(int(os.environ.get("HYPERRL_SANDBOX_UID_BASE", "65533")))
        top = _UID_NEXT[0]
        if top - n < 1000:
            raise SandboxUnavailable(f"no sandbox uids left ({n} asked below {top}; uids under 1000 are system ones)")
        _UID_NEXT[0] = top - n
    return list(range(top, top - n, -1))

VERDICTS = ("ok", "error", "timeout", "memory", "output_limit", "killed")


class SandboxUnavailable(HyperRLError, RuntimeError):
    """The sandbox's mechanism (bubblewrap, prlimit, setpriv, the Python it runs) is missing on this machine."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use. ``wall_s``: its deadline; ``cpu_s``: CPU seconds of each process;
    ``memory_mb``: address space of each process; ``processes``: processes of the sandbox's uid at once (a fork
    bomb's ceiling — shared by runs in flight at the same time); ``file_mb``: the largest file it may write;
    ``open_files``: descriptors per process; ``output_bytes``: stdout and stderr each, past which the run is killed."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 64
    file_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb", "processes", "file_mb", "open_files", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)}: must be > 0")


@dataclass(frozen=True)
class SandboxResult:
    """One run: ``verdict`` (one of :data:`VERDICTS` — ``ok`` exit 0; ``error`` another exit code; ``timeout`` the
    wall or CPU limit; ``memory`` the address-space limit; ``output_limit`` stdout / stderr past its limit;
    ``killed`` another signal), the exit code (None when killed here), what it printed (cut at the limit) and its
    wall time."""

    verdict: str
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


class Sandbox:
    """Runs commands and Python programs under :class:`Limits` (see the module doc). ``python``: the interpreter
    programs run with — under ``/usr`` (the only tree the sandbox sees); ``uid``: the unprivileged user it runs as."""

    def __init__(self, limits: Limits | None = None, *, python: str = "/usr/bin/python3", uid: int = 65534,
                 bwrap: str = "bwrap"):
        self.limits, self.uid = limits or Limits(), uid
        tools = {"bwrap": bwrap, "prlimit": "prlimit", "setpriv": "setpriv"}
        found = {k: shutil.which(v) for k, v in tools.items()}
        missing = [k for k, v in found.items() if v is None]
        if missing:
            raise SandboxUnavailable(f"sandbox: {', '.join(missing)} not found on this machine — install "
                                     "bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; prlimit and setpriv "
                                     "are util-linux); hyperrl never runs untrusted code unsandboxed")
        self._tools = found
        real = os.path.realpath(python)
        if not os.access(real, os.X_OK) or not real.startswith("/usr/"):
            raise SandboxUnavailable(f"sandbox: python={python} ({real}) is not an executable under /usr — the "
                                     "sandbox sees only /usr; install the system Python (apt-get install python3)")
        self.python = python

    def _command(self, argv: list[str], work: str) -> list[str]:
        lim = self.limits
        return [self._tools["prlimit"], f"--cpu={lim.cpu_s}", f"--as={lim.memory_mb << 20}",
                f"--nproc={lim.processes}", f"--fsize={lim.file_mb << 20}", f"--nofile={lim.open_files}", "--",
                self._tools["setpriv"], f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--",
                self._tools["bwrap"], "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", work, "/sandbox",
                "--remount-ro", "/", "--chdir", "/sandbox", "--unshare-all", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/sandbox", "--", *argv]

    def run(self, argv: list[str], *, stdin: str | bytes = "", files: dict[str, str | bytes] | None = None
            ) -> SandboxResult:
        """Run ``argv`` in ``/sandbox`` (holding ``files``, relative names) with ``stdin``; see
        :class:`SandboxResult`."""
        if not argv:
            raise ValueError("Sandbox.run: argv is empty")
        work = tempfile.mkdtemp(prefix="hyperrl-sandbox-")
        try:
            os.chmod(work, 0o777)  # the sandbox's user writes here; nothing else of the host is writable to it
            for name, data in (files or {}).items():
                path = Path(work) / name
                if ".." in Path(name).parts or Path(name).is_absolute():
                    raise ValueError(f"Sandbox.run: file {name!r} must be a relative path inside the sandbox")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data.encode() if isinstance(data, str) else data)
            return self._run(self._command(list(argv), work), stdin.encode() if isinstance(stdin, str) else stdin)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def run_python(self, code: str, *, stdin: str | bytes = "", files: dict[str, str | bytes] | None = None
                   ) -> SandboxResult:
        """Run the Python program ``code`` (as ``main.py``, isolated mode: no site, no environment)."""
        return self.run([self.python, "-I", "main.py"], stdin=stdin, files={**(files or {}), "main.py": code})

    def _run(self, cmd: list[str], stdin: bytes) -> SandboxResult:
        lim, t0 = self.limits, time.perf_counter()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        over = threading.Event()
        outs = {"stdout": bytearray(), "stderr": bytearray()}

        def read(stream, buf):
            while chunk := stream.read1(65536):
                buf += chunk[:lim.output_bytes - len(buf)]
                if len(buf) >= lim.output_bytes:
                    over.set()
                    _kill(proc)
                    return

        def feed():
            try:
                proc.stdin.write(stdin)
                proc.stdin.close()
            except OSError:
                pass  # it exited or closed stdin without reading it

        threads = [threading.Thread(target=read, args=(proc.stdout, outs["stdout"]), daemon=True),
                   threading.Thread(target=read, args=(proc.stderr, outs["stderr"]), daemon=True),
                   threading.Thread(target=feed, daemon=True)]
        for t in threads:
            t.start()
        timed_out = False
        try:
            proc.wait(timeout=lim.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill(proc)  # the whole group: anything it left behind
        proc.wait()
        for t in threads[:2]:
            t.join(timeout=5)
        wall = time.perf_counter() - t0
        out, err = (outs[k].decode(errors="replace") for k in ("stdout", "stderr"))
        code = proc.returncode
        verdict = _verdict(code, err, wall, timed_out=timed_out, over=over.is_set(), cpu_s=lim.cpu_s)
        return SandboxResult(verdict, None if timed_out or over.is_set() else code, out, err, wall)


def _verdict(code: int | None, err: str, wall: float, *, timed_out: bool, over: bool, cpu_s: int) -> str:
    """The run's verdict from how it ended. bwrap reports a signalled program as ``128 + signal``; the CPU limit
    ends a process with SIGXCPU or SIGKILL only after ``cpu_s`` of its CPU time — at least that much wall time."""
    if over:
        return "output_limit"
    if timed_out:
        return "timeout"
    if code and "MemoryError" in err:
        return "memory"
    sig = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128 else 0)
    if sig in (signal.SIGXCPU, signal.SIGKILL) and wall >= cpu_s:
        return "timeout"
    if sig:
        return "killed"
    return "ok" if code == 0 else "error"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (its session: ``start_new_session``), if any is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
