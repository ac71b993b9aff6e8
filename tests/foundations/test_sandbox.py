"""The sandbox (hyperrl/sandbox/: bubblewrap + prlimit + setpriv) against the escapes a model's program might try,
each contained and reported — real processes, real namespaces (bubblewrap is installed by .ci/run). Every escape runs
twice: in a fresh sandbox, and through the sandboxed fork server (hyperrl/sandbox/server.py), whose programs share a
sandbox one after another — plus what only a server could be attacked with (its protocol, what one program leaves
for the next, the server itself)."""

import os
import socket
import subprocess
import threading
import time

import pytest

from hyperrl.sandbox import Limits, Sandbox, SandboxUnavailable
from hyperrl.sandbox.server import SandboxServer

# one xdist worker: the process limit counts every process of the sandbox's user, so a fork bomb beside another
# test's run would starve it (concurrent sandboxes take distinct uids: Sandbox(uid=...))
pytestmark = pytest.mark.xdist_group("sandbox")

LIMITS = Limits(wall_s=6, cpu_s=2, memory_mb=256, processes=32, file_mb=1, open_files=32, output_bytes=64 << 10)


@pytest.fixture(scope="module", params=["fresh", "server"])
def box(request):
    if request.param == "fresh":
        yield Sandbox(LIMITS)
        return
    server = SandboxServer(LIMITS)
    assert server.run_python("pass").ok  # started: its own processes are counted before each test
    yield server
    server.close()


@pytest.fixture
def server():
    s = SandboxServer(LIMITS, uid=65520)
    yield s
    s.close()


def _nobody_processes() -> int:
    """Processes of the sandbox's user (65534) on the machine — none may outlive a run."""
    out = subprocess.run(["ps", "-u", "65534", "-o", "pid="], capture_output=True, text=True)
    return len(out.stdout.split())


def _settles_to(n: int, within_s: float = 5.0) -> bool:
    """The sandbox user's processes come back to ``n`` (the kernel reaps a pid namespace's processes as its init
    exits; ``ps`` may still list one being torn down for a moment)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _nobody_processes() <= n:
            return True
        time.sleep(0.1)
    return False


def test_a_program_runs_with_its_stdin_and_files_and_its_output_comes_back(box):
    r = box.run_python("import sys\nprint(sys.stdin.read().upper())\nprint(open('data/x.txt').read())\n"
                       "open('out.txt', 'w').write('mine')", stdin="hello", files={"data/x.txt": "payload"})
    assert r.ok and r.exit_code == 0 and r.stdout == "HELLO\npayload\n" and r.stderr == ""
    bad = box.run_python("raise SystemExit(3)")
    assert bad.verdict == "error" and bad.exit_code == 3
    crash = box.run_python("1/0")
    assert crash.verdict == "error" and "ZeroDivisionError" in crash.stderr


def test_reading_outside_the_sandbox_finds_nothing(box, tmp_path):
    secret = tmp_path / "checkpoint.safetensors"  # the run's files: not in the sandbox's view at all
    secret.write_text("weights")
    r = box.run_python(f"""
for p in [{str(secret)!r}, '/root', '/work', '/etc/shadow', '/home']:
    try:
        open(p).read(); print('READ', p)
    except OSError as e:
        print('blocked', p, type(e).__name__)
""")
    assert r.ok and "READ" not in r.stdout and r.stdout.count("blocked") == 5, r.stdout


def test_writing_outside_its_directory_is_refused(box, tmp_path):
    r = box.run_python(f"""
for p in ['/usr/evil', {str(tmp_path / 'evil')!r}, '/evil']:
    try:
        open(p, 'w').write('x'); print('WROTE', p)
    except OSError as e:
        print('blocked', p, e.errno)
""")
    assert r.ok and "WROTE" not in r.stdout and r.stdout.count("blocked") == 3, r.stdout
    assert not (tmp_path / "evil").exists()
    big = box.run_python("open('big', 'wb').write(b'x' * (4 << 20))")  # past file_mb: SIGXFSZ / EFBIG
    assert not big.ok


def test_no_network_not_even_the_hosts_loopback(box):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        r = box.run_python(f"""
import socket
for addr in [('127.0.0.1', {port}), ('8.8.8.8', 53), ('10.0.0.1', 80)]:
    try:
        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)
    except OSError as e:
        print('blocked', addr[0], e.errno)
""")
    finally:
        server.close()
    assert r.ok and "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 3, r.stdout
    assert not accepted


def test_a_fork_bomb_is_stopped_and_leaves_nothing(box):
    before = _nobody_processes()
    r = box.run_python("""
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30); os._exit(0)
        n += 1
except OSError as e:
    print('stopped at', n, e.errno)
""")
    assert "stopped at" in r.stdout and int(r.stdout.split()[2]) <= LIMITS.processes, r.stdout
    assert _settles_to(before)  # every forked child died with the sandbox


def test_a_memory_bomb_is_refused_its_memory(box):
    r = box.run_python("x = bytearray(2 * 10**9)\nprint('ALLOCATED')")
    assert r.verdict == "memory" and "ALLOCATED" not in r.stdout


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(box):
    t0 = time.perf_counter()
    r = box.run_python("while True:\n    pass")
    assert r.verdict == "timeout" and time.perf_counter() - t0 < LIMITS.wall_s + 2


def test_a_sleeping_program_is_stopped_at_the_deadline_even_with_stdout_closed(box):
    t0 = time.perf_counter()
    r = box.run_python("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)")
    assert r.verdict == "timeout" and r.exit_code is None and time.perf_counter() - t0 < LIMITS.wall_s + 3


def test_a_huge_stdout_is_cut_and_the_program_killed(box):
    r = box.run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.verdict == "output_limit" and len(r.stdout) == LIMITS.output_bytes


def test_the_trainer_cannot_be_signalled(box):
    me = os.getpid()
    r = box.run_python(f"""
import os, signal
for pid in [{me}, {os.getppid()}]:
    try:
        os.kill(pid, signal.SIGTERM); print('SIGNALLED', pid)
    except OSError as e:
        print('blocked', pid, e.errno)
print('ppid', os.getppid())
""")
    assert "SIGNALLED" not in r.stdout and r.stdout.count("blocked") == 2, r.stdout
    assert os.getpid() == me  # and we are still here


def test_a_child_left_behind_dies_with_the_sandbox(box):
    before = _nobody_processes()
    r = box.run_python("""
import os, subprocess, sys
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    import time; time.sleep(120)
print('parent exits')
""")
    assert r.ok and "parent exits" in r.stdout
    assert _settles_to(before)


def test_a_missing_mechanism_is_named_never_run_unsandboxed():
    with pytest.raises(SandboxUnavailable, match=r"bwrap not found .*apt-get install bubblewrap"):
        Sandbox(bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable, match=r"python=/opt/python3 .* the sandbox sees only /usr"):
        Sandbox(python="/opt/python3")
    with pytest.raises(ValueError, match=r"Limits.cpu_s=0: must be > 0"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match=r"file '../x' must be a relative path inside the sandbox"):
        Sandbox(LIMITS).run(["/usr/bin/true"], files={"../x": "y"})


def test_one_program_leaves_nothing_for_the_next_in_a_server(server):
    """Files, /tmp, processes: cleared between programs; the protocol and the server are out of a program's reach."""
    first = server.run_python("""
import os, subprocess, sys
open('/tmp/mark', 'w').write('1'); open('mine.txt', 'w').write('2')
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)
print('left', os.getpid())
""")
    assert first.ok and "left" in first.stdout
    r = server.run_python("""
import os
print(sorted(os.listdir('/tmp')), sorted(os.listdir('.')))
procs = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (os.getpid(), 1, os.getppid())]
print('others', procs)
for what in ('fd', 'mem', 'environ'):
    where = f'/proc/{os.getppid()}/{what}'
    try:
        os.listdir(where) if what == 'fd' else open(where, 'rb').read(1)
        print('OPENED', what)
    except OSError as e:
        print('blocked', what, e.errno)
import ctypes
print('ptrace', ctypes.CDLL(None, use_errno=True).ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())  # ATTACH
""")
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "[] ['main.py']" and lines[1] == "others []", r.stdout
    assert "OPENED" not in r.stdout and r.stdout.count("blocked") == 3, r.stdout
    assert lines[-1] == "ptrace -1 1"  # EPERM: the server is not dumpable


def test_a_program_that_kills_its_server_is_killed_and_the_next_runs(server):
    starts = server.run_python("pass") and server.starts
    r = server.run_python("import os, signal; os.kill(os.getppid(), signal.SIGKILL)")
    assert r.verdict == "killed"
    again = server.run_python("print('fresh')")
    assert again.ok and again.stdout == "fresh\n" and server.starts == starts + 1
