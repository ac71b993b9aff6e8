"""A process tree that ends whole: how a CLI agent (``env.command``, ``env.harness``) runs.

An agent may start children that leave its session — ``setsid``, a double fork, a daemon (a language server, a
dev server) — and those keep the agent's stdout / stderr open: killing the agent's process group does not reach
them, and reading its pipes to their end waits for them. So each agent runs as the first process of **its own pid
namespace** (bubblewrap: ``bwrap --unshare-pid --die-with-parent``, the host's filesystem, network, user and
environment unchanged — containment, not a sandbox). When that process exits, or is killed at the deadline, the
kernel ends every process of the namespace, however it detached itself, and the pipes close.

Why a pid namespace: it is the one mechanism that catches every escape without privileges or set-up — a cgroup
needs a writable cgroup tree (rarely given inside containers), a child subreaper (``PR_SET_CHILD_SUBREAPER``)
applies to the whole trainer process and cannot tell two concurrent episodes' orphans apart. bubblewrap is
already what :mod:`hyperrl.sandbox` runs untrusted code with. Without it (``apt-get install bubblewrap``) the agent
runs in a process group only and a warning says what escapes.

Output is read by two threads, each keeping only the last ``tail_bytes`` of its stream (``truncated`` says
whether more was written): a verbose agent costs the trainer a bounded amount of memory. Reading stops at the
process's end, or a grace period after it when something outside the namespace still holds a pipe.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["TreeResult", "run_tree", "TAIL_BYTES"]

TAIL_BYTES = 1 << 20  # the last MiB of each stream is kept for the judge
_WARNED: list[bool] = []


@dataclass(frozen=True)
class TreeResult:
    """How a process tree ended: its output's tails, exit code (None when it was killed at the deadline),
    ``timed_out``, ``truncated`` (either stream held more than the tail) and wall seconds."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    wall_s: float


def _contained(argv: list[str]) -> list[str]:
    """``argv`` as the first process of a new pid namespace (bubblewrap), or unchanged — with one warning — when
    bubblewrap is missing."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        if not _WARNED:
            _WARNED.append(True)
            print("warning: bubblewrap (bwrap) not found: a CLI agent's children that leave its session (setsid, "
                  "daemons) are not ended with it — apt-get install bubblewrap", file=sys.stderr)
        return argv
    return [bwrap, "--dev-bind", "/", "/", "--proc", "/proc", "--unshare-pid", "--die-with-parent", "--", *argv]


def _read_tail(stream, buf: bytearray, cap: int, cut: list[bool]) -> None:
    while chunk := stream.read1(65536):
        buf += chunk
        if len(buf) > cap:
            del buf[:len(buf) - cap]
            cut[0] = True


def run_tree(argv: list[str], *, env: dict[str, str], cwd: str, timeout_s: float, tail_bytes: int = TAIL_BYTES,
             grace_s: float = 2.0, cancel: threading.Event | None = None) -> TreeResult:
    """Run ``argv`` (stdin empty) until it exits, ``timeout_s`` passes or ``cancel`` is set, then end its whole
    tree (see the module doc); → :class:`TreeResult` with each stream's last ``tail_bytes`` (a cancelled run
    reads as timed out)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(_contained(list(argv)), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True)
    bufs, cuts = (bytearray(), bytearray()), ([False], [False])
    readers = [threading.Thread(target=_read_tail, args=(s, b, tail_bytes, c), daemon=True)
               for s, b, c in zip((proc.stdout, proc.stderr), bufs, cuts)]
    for r in readers:
        r.start()
    timed_out, end = False, time.monotonic() + timeout_s
    while True:
        try:
            proc.wait(timeout=max(0.0, min(0.2, end - time.monotonic())) if cancel is not None else timeout_s)
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= end or (cancel is not None and cancel.is_set()):
                timed_out = True
                break
    try:  # its process group — and, through the namespace, everything it started
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + grace_s
    for r in readers:
        r.join(timeout=max(0.0, deadline - time.monotonic()))
    for s, r in zip((proc.stdout, proc.stderr), readers):
        if not r.is_alive():  # a reader still blocked (a pipe held outside the namespace) is left to its thread
            s.close()
    out, err = (bytes(b).decode(errors="replace") for b in bufs)
    return TreeResult(out, err, None if timed_out else proc.returncode, timed_out, cuts[0][0] or cuts[1][0],
                      time.perf_counter() - t0)
