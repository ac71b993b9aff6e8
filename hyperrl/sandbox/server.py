"""A fork server inside the sandbox: many untrusted programs run one after another in one sandbox, each a fresh
process forked from a Python already started — ~1–2 ms a run instead of ~20 ms (bubblewrap's set-up and the Python
start-up paid once), for rewards that run thousands of small programs a step (issue 50: the code task).

:class:`SandboxServer` has :class:`~hyperrl.sandbox.Sandbox`'s ``run_python`` and gives the same
:class:`~hyperrl.sandbox.SandboxResult` s. The server is the system Python (``-I -c``: no file of it to tamper with)
in a sandbox built exactly as :class:`~hyperrl.sandbox.Sandbox` builds one (namespaces, read-only ``/usr``, a private
``/tmp``, its own uid, ``prlimit`` on processes, file size and open files), and for each program it:

* forks a child that makes its own session, takes fresh pipes for stdin / stdout / stderr, closes every other
  descriptor (the server's protocol pipes included), lowers its limits (CPU seconds, address space, file size, open
  files) and runs ``main.py`` in a fresh ``/sandbox/job`` holding the run's files;
* reads its output to the byte limit and ends it at the wall deadline (the child's session killed);
* then **clears the sandbox** before the next program: ``kill(-1, SIGKILL)`` — every other process of the uid, so
  nothing a program left behind (a daemon, a double fork) meets the next one — and empties ``/sandbox/job`` and
  ``/tmp``.

The server marks itself non-dumpable (``PR_SET_DUMPABLE = 0``): a program of the same uid cannot ptrace it nor open
its ``/proc/<pid>/fd`` or ``mem``, so it cannot reach the protocol or change the server. A program can kill the
server (same uid): that run is ``killed``, and the next one starts a fresh server. The protocol is length-prefixed
JSON (never pickle: the host parses nothing that could run code). Threat model and limits otherwise as the
sandbox's (docs/rewards.md); what this adds: programs of one slot share the server's uid and pid namespace in time
(never at once) — one cannot see another running, only what the clearing removes.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time

from hyperrl.sandbox import Limits, Sandbox, SandboxResult, _verdict

__all__ = ["SandboxServer"]

_SERVER = r'''
import base64, ctypes, json, os, resource, runpy, select, signal, struct, sys, time, traceback
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: no ptrace, no /proc/<pid>/fd|mem for same-uid programs
P_IN, P_OUT = os.dup(0), os.dup(1)
_null = os.open("/dev/null", os.O_RDWR)
os.dup2(_null, 0); os.dup2(_null, 1)
ME = os.getpid()

def read_exact(n):
    buf = b""
    while len(buf) < n:
        c = os.read(P_IN, n - len(buf))
        if not c:
            sys.exit(0)
        buf += c
    return buf

def send(obj):
    data = json.dumps(obj).encode()
    data = struct.pack("<Q", len(data)) + data
    while data:
        data = data[os.write(P_OUT, data):]

def others():
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in (1, ME):
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(p))
            except OSError:
                pass
    return out

def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return

def wipe(path):
    for root, dirs, files in os.walk(path, topdown=False):
        for n in files + dirs:
            p = os.path.join(root, n)
            try:
                os.chmod(p, 0o700) if os.path.isdir(p) and not os.path.islink(p) else None
                os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            except OSError:
                pass

def clear():
    for _ in range(200):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if not others():
            break
        time.sleep(0.002)
    for d in ("/sandbox/job", "/tmp"):
        wipe(d)
    try:
        os.rmdir("/sandbox/job")
    except OSError:
        pass

def child(job, fds):
    os.setsid()
    os.dup2(fds[0], 0); os.dup2(fds[1], 1); os.dup2(fds[2], 2)
    os.closerange(3, 1 << 16)
    os.chdir("/sandbox/job")
    L = job["limits"]
    for r, v in ((resource.RLIMIT_CPU, L["cpu_s"]), (resource.RLIMIT_AS, L["memory_mb"] << 20),
                 (resource.RLIMIT_FSIZE, L["file_mb"] << 20), (resource.RLIMIT_NOFILE, L["open_files"])):
        resource.setrlimit(r, (v, v))
    sys.argv, sys.path[0] = ["main.py"], "/sandbox/job"
    code = 0
    try:
        runpy.run_path("main.py", run_name="__main__")
    except SystemExit as e:
        c = e.code
        if c is None:
            code = 0
        elif isinstance(c, int):
            code = c
        else:
            print(c, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush(); sys.stderr.flush()
    except BaseException:
        pass
    os._exit(code & 0xFF)

def run(job):
    L = job["limits"]
    os.mkdir("/sandbox/job", 0o700)
    for name, b64 in job["files"].items():
        path = os.path.join("/sandbox/job", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(b64))
    ins, outs, errs = os.pipe(), os.pipe(), os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            child(job, (ins[0], outs[1], errs[1]))
        finally:
            os._exit(1)
    for fd in (ins[0], outs[1], errs[1]):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    stdin, sent = base64.b64decode(job["stdin"]), 0
    os.set_blocking(ins[1], False)
    bufs, open_ = {outs[0]: bytearray(), errs[0]: bytearray()}, {outs[0], errs[0]}
    writing = ins[1]
    if not stdin:
        os.close(writing); writing = None
    deadline, over, timed_out, exited = t0 + L["wall_s"], False, False, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        r, w, _ = select.select(list(open_) + [pidfd], [writing] if writing is not None else [], [], left)
        if writing is not None and writing in w:
            try:
                sent += os.write(writing, stdin[sent:sent + 65536])
            except OSError:
                sent = len(stdin)
            if sent >= len(stdin):
                os.close(writing); writing = None
        for fd in r:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_.discard(fd)
                continue
            bufs[fd] += chunk[:L["output_bytes"] - len(bufs[fd])]
            if len(bufs[fd]) >= L["output_bytes"]:
                over = True
        if over or exited:
            break
    if exited:  # what is still in the pipes (a descendant may hold them open: never wait for their end)
        for fd in list(open_):
            os.set_blocking(fd, False)
            try:
                while (chunk := os.read(fd, 65536)) and len(bufs[fd]) < L["output_bytes"]:
                    bufs[fd] += chunk[:L["output_bytes"] - len(bufs[fd])]
            except BlockingIOError:
                pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    wall = time.monotonic() - t0
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    for fd in [pidfd, outs[0], errs[0]] + ([writing] if writing is not None else []):
        os.close(fd)
    clear()
    send({"code": code, "stdout": base64.b64encode(bytes(bufs[outs[0]])).decode(),
          "stderr": base64.b64encode(bytes(bufs[errs[0]])).decode(), "timed_out": timed_out, "over": over,
          "wall": wall})

def warm():  # what the first program of a fresh interpreter loads lazily, loaded once here, before any fork
    with open("/sandbox/warm.py", "w") as f:
        f.write("import json\n")
    try:
        runpy.run_path("/sandbox/warm.py", run_name="__warm__")
    finally:
        os.unlink("/sandbox/warm.py")

warm()
send({"ready": True})
while True:
    n = struct.unpack("<Q", read_exact(8))[0]
    run(json.loads(read_exact(n)))
'''


class _Spawner:
    """Starts the servers' processes from one thread that never ends: bubblewrap's ``--die-with-parent`` is a
    parent-death signal, sent when the *thread* that started it exits — a server started from a pool thread that
    later retires would die under a running program."""

    _lock, _jobs = threading.Lock(), None

    @classmethod
    def popen(cls, cmd: list[str], **kw) -> subprocess.Popen:
        import queue
        from concurrent.futures import Future

        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(target=cls._serve, args=(cls._jobs,), name="hyperrl-sandbox-spawner",
                                 daemon=True).start()
        out: Future = Future()
        cls._jobs.put((cmd, kw, out))
        return out.result()

    @staticmethod
    def _serve(jobs) -> None:
        while True:
            cmd, kw, out = jobs.get()
            try:
                out.set_result(subprocess.Popen(cmd, **kw))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                out.set_exception(e)


class SandboxServer:
    """Runs Python programs one after another in one sandboxed fork server (module doc), under ``limits`` (per
    program: CPU seconds, address space, file size, open files, the wall deadline, output bytes; ``processes`` for
    the whole slot). ``run_python`` as :meth:`hyperrl.sandbox.Sandbox.run_python`; one program at a time (a lock);
    a server that dies or stops answering is replaced at the next run. :meth:`close` ends it."""

    START_S = 30.0

    def __init__(self, limits: Limits | None = None, *, python: str = "/usr/bin/python3", uid: int = 65534,
                 bwrap: str = "bwrap"):
        self.box = Sandbox(limits, python=python, uid=uid, bwrap=bwrap)  # its checks: bwrap, prlimit, setpriv
        self.limits, self.lock, self.proc, self.work = self.box.limits, threading.Lock(), None, None
        self.starts = 0

    def _start(self) -> None:
        lim = self.limits
        self.work = tempfile.mkdtemp(prefix="hyperrl-sandbox-server-")
        os.chmod(self.work, 0o777)
        cmd = self.box._command([self.box.python, "-I", "-c", _SERVER], self.work)
        # the server itself: no CPU or address-space limit (each program gets its own); the rest as the sandbox's
        cmd = [c for c in cmd if not c.startswith(("--cpu=", "--as="))]
        self.proc = _Spawner.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        self.starts += 1
        got = self._read(time.monotonic() + self.START_S)
        if got is None or not got.get("ready"):
            self._stop()
            raise RuntimeError(f"the sandbox server did not start (limits {lim})")

    def _read(self, deadline: float) -> dict | None:
        """One message from the server (None: it died or missed ``deadline``)."""
        import select

        fd, buf, need = self.proc.stdout.fileno(), b"", 8
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, need - len(buf))
                if not chunk:
                    return None
                buf += chunk
            if need == 8:
                need, buf = 8 + struct.unpack("<Q", buf)[0], buf
                if need == 8:
                    return None
                continue
            try:
                return json.loads(buf[8:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None

    def _stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
            for s in (self.proc.stdin, self.proc.stdout):
                try:
                    s.close()
                except OSError:
                    pass
            self.proc = None
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None

    def run_python(self, code: str, *, stdin: str | bytes = "", files: dict[str, str | bytes] | None = None
                   ) -> SandboxResult:
        """Run the Python program ``code`` (as ``main.py`` beside ``files``) with ``stdin``."""
        lim = self.limits
        enc = {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode()
               for k, v in {**(files or {}), "main.py": code}.items()}
        from pathlib import PurePosixPath

        for name in enc:
            if not name or ".." in PurePosixPath(name).parts or PurePosixPath(name).is_absolute():
                raise ValueError(f"SandboxServer.run_python: file {name!r} must be a relative path inside the sandbox")
        job = {"files": enc, "stdin": base64.b64encode(stdin.encode() if isinstance(stdin, str) else stdin).decode(),
               "limits": {"cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "file_mb": lim.file_mb,
                          "open_files": lim.open_files, "wall_s": lim.wall_s, "output_bytes": lim.output_bytes}}
        data = json.dumps(job).encode()
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._stop()
                self._start()
            t0 = time.perf_counter()
            try:
                self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
                self.proc.stdin.flush()
                got = self._read(time.monotonic() + lim.wall_s + 10.0)
            except OSError:
                got = None
            if got is None:  # the program killed or stopped its server: this run is killed, the server replaced
                self._stop()
                return SandboxResult("killed", None, "", "", time.perf_counter() - t0)
        out, err = (base64.b64decode(got[k]).decode(errors="replace") for k in ("stdout", "stderr"))
        code_, timed_out, over = got["code"], bool(got["timed_out"]), bool(got["over"])
        verdict = _verdict(code_, err, float(got["wall"]), timed_out=timed_out, over=over, cpu_s=lim.cpu_s)
        return SandboxResult(verdict, None if timed_out or over else code_, out, err, float(got["wall"]))

    def close(self) -> None:
        """End the server (and everything of its sandbox)."""
        with self.lock:
            self._stop()

    def __del__(self):
        try:
            self._stop()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass
