"""A reward's worker process (``rewards[].pool: process``): ``python -m hyperrl.rewards.worker READ_FD WRITE_FD
PARENT_PID``, started by :class:`hyperrl.rewards.runners.ProcessRunner`.

It receives the reward's recipe (a pickled ``(builder, args)``: a file's function loaded by path, a registered
factory called with its hyperparameters, a function by reference), builds the reward once and answers ``ready``
(or the error), then answers each call ``(args, kwargs)`` with ``("ok", value)`` or ``("raised", "Type: message")``
until its input closes. The user's prints go to stderr — fd 1 is pointed there — never into the protocol; it dies
with its parent (a thread watching its parent pid), so a killed trainer leaves no reward process behind.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import sys
import threading
import time

__all__ = ["main"]


def _die_with_parent(parent: int) -> None:
    """End this process when its parent is gone, even in the middle of a call: a thread watching the parent pid
    (``PR_SET_PDEATHSIG`` would fire when the parent's *thread* that started it exits — a pool thread)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="hyperrl-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    """Serve one reward: ``argv`` = [prog, read fd, write fd, parent pid]; 0 when its input closes."""
    from hyperrl.errors import HyperRLError
    from hyperrl.rewards.processes import read_bytes, read_message, send_message

    r, w, parent = int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent(parent)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        builder, args = pickle.loads(read_message(r))
        fn = builder(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the reward
        send_message(w, ("error", f"{type(e).__name__}: {e}"))
        return 1
    send_message(w, ("ready", None))
    while True:
        try:
            raw = read_bytes(r)
        except EOFError:
            return 0
        try:
            args, kwargs = pickle.loads(raw)
        except Exception as e:  # noqa: BLE001 - e.g. a sample of a class only the trainer's __main__ has
            send_message(w, ("raised", f"{type(e).__name__} while its arguments were read in the worker process: {e}"))
            continue
        try:
            value = fn(*args, **kwargs)
            if inspect.iscoroutine(value):  # an async def reward in a worker process: run to completion here
                value = asyncio.run(value)
            send_message(w, ("ok", value))
        except BaseException as e:  # noqa: BLE001 - sys.exit() too: the call's failure, not the worker's
            if isinstance(e, HyperRLError):  # bad input named (a row without tests): never retried
                send_message(w, ("invalid", (f"{type(e).__name__}: {e}", getattr(e, "row", None))))
            else:
                send_message(w, ("raised", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
