import os

import torch
from hypothesis import settings

from hyperrl.trajectory import make_trajectory

settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
torch.set_num_threads(1)


def random_batch(B=8, T=12, group_size=4, seed=0, holes=False, prompt_len=3):
    """A valid right-padded trajectory: prompt of `prompt_len`, random response length, optional
    observation holes (action mask 0 inside the response)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len + 1, T + 1, (B,), generator=g)
    ar = torch.arange(T)
    attn = ar[None] < lengths[:, None]
    act = attn & (ar[None] >= prompt_len)
    if holes:
        act = act & (torch.rand(B, T, generator=g) > 0.25)
    lp = torch.where(act, -torch.rand(B, T, generator=g) * 3, 0.0)
    return make_trajectory(
        tokens=torch.randint(0, 50, (B, T), generator=g) * attn,
        attention_mask=attn,
        action_mask=act,
        rollout_logprobs=lp,
        policy_version=torch.zeros(B, dtype=torch.int64),
        group_id=torch.arange(B) // group_size,
        reward=torch.randint(0, 2, (B,), generator=g).float(),
    )


def resign(checkpoint, *names):
    """Record the current checksums of ``names`` in a checkpoint's marker (a test that edits a
    checkpoint file on purpose — to reach the check behind the checksum)."""
    import hashlib
    import json
    from pathlib import Path

    marker = Path(checkpoint) / "COMPLETE"
    rec = json.loads(marker.read_text())
    for n in names:
        rec["sha256"][n] = hashlib.sha256((Path(checkpoint) / n).read_bytes()).hexdigest()
    marker.write_text(json.dumps(rec))


# Every process the suite starts — directly, through an agent, a worker or a server — inherits this marker in its
# environment; at the end of the session (after xdist's workers are gone) any that is still alive outlived the test
# that started it: the session fails and names them (after a short grace for processes already exiting).
SESSION_MARK = "HYPERRL_TEST_SESSION"
os.environ.setdefault(SESSION_MARK, f"{os.getpid()}-{os.urandom(4).hex()}")


def _marked_processes(mark: str) -> dict[int, str]:
    found = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"{SESSION_MARK}={mark}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
            if int(ppid) == os.getpid() and "multiprocessing.resource_tracker" in cmd:
                continue  # Python's own helper of this process: it ends when this process does
            found[int(d)] = cmd
        except (OSError, IndexError):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if a process it started is still alive (the controller only, not an xdist worker)."""
    import signal
    import time

    if hasattr(session.config, "workerinput") or not os.path.isdir("/proc"):
        return
    mark, left = os.environ[SESSION_MARK], {}
    for _ in range(20):  # a process already on its way out gets 10 s
        left = _marked_processes(mark)
        if not left:
            return
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    print(f"\n{len(left)} processes started by the tests outlived them (now killed):", *left.values(), sep="\n  ")
    session.exitstatus = 1
