"""Predicted speed-up of asynchronous RL for a disaggregated deployment, from measured phase times.

A discrete-event simulation that drives hyperrl's own admission rule and buffer
(``hyperrl.transforms.admission``: AReaL's capacity, earliest-deadline-first consumption) — the
same code the AsyncTrainer runs — under a model of the hardware. Assumptions (stated, not measured):

* decoding costs ``c`` seconds per token position whatever the number of requests in flight (decode
  is memory-bound: a batch step costs about one step) up to ``--slots`` requests per rollout device
  (its KV cache) — so a request of ``L`` tokens finishes ``L·c`` after it starts, a synchronous
  rollout lasts ``c · max L`` of its batch (the long tail sets it), and the asynchronous rollout
  devices hold at most ``slots · R / n`` groups in flight;
* response lengths follow the ``repeat`` task's long tail (80 % short, 20 % 4–8× longer), or any
  ``--short/--long/--tail`` you give;
* training a batch costs ``u`` seconds on the reference device count, scaling as ``1 / devices``;
  a publication costs ``p`` and pauses decoding (in-flight requests resume after it);
* **sync, colocated** on ``R + T`` devices: generate (``c · max L``), then train (``u · ref / (R + T)``);
  **async, disaggregated**: ``R`` devices decode continuously, ``T`` train (``u · ref / T``).

``c``, ``u``, ``p`` default to this machine's measurement (``benchmarks/async.py``, sync row: generate
0.284 s for a 21-token budget → c ≈ 0.0135 s, update 0.308 s on 2 cores, publish 0.005 s); a GPU
deployment has other constants — pass yours.

    python benchmarks/async_sim.py                       # 4 rollout + 4 training devices, η = 0…8
    python benchmarks/async_sim.py --c 0.02 --u 30 --rollout 4 --train 4 --short 300 --long 2400
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import append_results, table  # noqa: E402
from hyperrl.loop import admission as A


def _length(rng: random.Random, a) -> int:
    if rng.random() < a.tail:
        return rng.randint(a.long // 2, a.long)
    return rng.randint(1, a.short)


def sync_step_s(a, rng: random.Random) -> float:
    """Colocated synchronous step: the batch's longest request, then the update on every device."""
    L = max(_length(rng, a) for _ in range(a.batch * a.n))
    return L * a.c + a.u * a.ref / (a.rollout + a.train) + a.p


def async_run(a, eta: int, steps: int, rng: random.Random) -> tuple[float, int]:
    """Disaggregated asynchronous run: returns (seconds for ``steps`` steps, max staleness trained)."""
    buf = A.buffer_init(eta, a.batch, max(1, min((eta + 1) * a.batch, a.slots * a.rollout // a.n)))
    t, version, key, done, events, worst = 0.0, 0, 0, {}, [], 0
    train_s = a.u * a.ref / a.train
    learner_free = 0.0

    def top_up(now):
        nonlocal buf, key
        buf, new = A.admit(buf, list(range(key, key + buf.max_concurrent)), version)
        key += len(new)
        for u in new:  # a group finishes when its longest sample does
            heapq.heappush(events, (now + max(_length(rng, a) for _ in range(a.n)) * a.c, u.uid))

    top_up(0.0)
    for _ in range(steps):
        while True:  # the learner waits until EDF lets it take a batch
            buf2, got = A.take_batch(buf, version)
            if got is not None:
                buf = buf2
                break
            when, uid = heapq.heappop(events)
            t = max(t, when)
            buf = A.complete(buf, uid)
            top_up(t)
        worst = max(worst, max(version - u.version for u in got))
        start = max(t, learner_free)
        learner_free = start + train_s + a.p
        # generation continues during the update; completions before the publication land at version V
        while events and events[0][0] <= learner_free - a.p:
            when, uid = heapq.heappop(events)
            buf = A.complete(buf, uid)
            top_up(when)
        # the publication pauses decoding for p: every in-flight request finishes p later
        events = [(w + a.p, u) for w, u in events]
        heapq.heapify(events)
        version += 1
        t = learner_free
        top_up(t)
        done[version] = t
    return t, worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--c", type=float, default=0.0135, help="seconds per decode step")
    ap.add_argument("--u", type=float, default=0.308, help="seconds to train one batch on --ref devices")
    ap.add_argument("--p", type=float, default=0.005, help="seconds per publication")
    ap.add_argument("--ref", type=int, default=1, help="devices the update time u was measured on")
    ap.add_argument("--rollout", type=int, default=4)
    ap.add_argument("--train", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="prompt groups per step")
    ap.add_argument("--slots", type=int, default=128, help="requests in flight per rollout device")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--short", type=int, default=3, help="short answers: 1..short tokens")
    ap.add_argument("--long", type=int, default=21, help="tail answers: long/2..long tokens")
    ap.add_argument("--tail", type=float, default=0.2, help="fraction of tail answers")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    sync = sum(sync_step_s(a, rng) for _ in range(a.steps)) / a.steps
    rows = [["sync, colocated", a.rollout + a.train, round(sync, 4), "1.00×", 0]]
    for eta in a.etas:
        total, worst = async_run(a, eta, a.steps, random.Random(a.seed))
        assert worst <= eta
        rows.append([f"async η={eta}, {a.rollout} rollout + {a.train} train", a.rollout + a.train,
                     round(total / a.steps, 4), f"{sync / (total / a.steps):.2f}×", worst])
    cmd = " ".join(["python benchmarks/async_sim.py", *sys.argv[1:]])
    append_results("async speed-up, simulated (disaggregated deployment)",
                   f"`{cmd}`: decode {a.c} s/token position, update {a.u} s on {a.ref} device(s) (∝ 1/devices), "
                   f"publish {a.p} s; {a.slots} requests per rollout device; {a.batch} groups × {a.n}, answers "
                   f"1..{a.short} tokens or ({a.tail:.0%}) "
                   f"{a.long // 2}..{a.long}; hyperrl's admission + EDF buffer drive the async runs; assumptions in "
                   "the script's docstring:\n\n"
                   + table(["mode", "devices", "s/step", "vs sync", "max staleness trained"], rows))


if __name__ == "__main__":
    main()
