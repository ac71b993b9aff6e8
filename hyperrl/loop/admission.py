"""Bounded-staleness admission and the rollout buffer, as a plain value with pure transitions.

The unit is one admitted *request*: a prompt and its ``n`` samples (a GRPO group travels whole —
its advantage needs all of it). A batch is ``batch`` units. Every unit records the learner version
``v_a`` current when it was admitted; all of its tokens are sampled at versions ``≥ v_a`` (partial
rollout resumes them under newer weights), so its *deadline* — the last learner version allowed to
train it — is ``v_a + η``.

**Admission** (AReaL, Fu et al. 2025, with ``accepted`` = ready + consumed units):

    capacity = min(max_concurrent − in_flight, (η + V + 1)·batch − (accepted + in_flight))

so at most ``(d + 1)·batch`` live-or-consumed units ever carry a deadline ``≤ d``.

**Consumption** (:func:`take_batch`, learner version ``V``): the ``batch`` ready units that come
first by (deadline, admission order) — earliest deadline first — *provided* that afterwards, for
every ``d ≥ V + 1``, at most ``(d − V)·batch`` live units have a deadline ``≤ d`` (and none is due
at ``V``); otherwise the learner waits for a running unit. Greedy EDF takes, for every ``d`` at
once, the most units due by ``d`` that any choice could, so if it fails every choice fails; and
with the admission bound the condition can always be met once the running units finish. Together:
**no unit is ever trained staler than η**, nothing is dropped to keep that (pacing, not
discarding), and a strict FIFO is not needed (a long-tail unit holds the learner only when its
deadline comes).

**Conservation law** (:func:`check_conservation`): ``admitted = consumed + evicted + in_flight +
ready``; an eviction is recorded with its reason and its unit's ``key`` (e.g. the prompt index,
for the driver to re-admit) — never silent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "Unit",
    "Buffer",
    "check_admission",
    "capacity",
    "buffer_init",
    "admit",
    "complete",
    "restart",
    "evict",
    "take_batch",
    "take_units",
    "check_conservation",
    "deadline_violations",
]

RUNNING, READY = "running", "ready"


@dataclass(frozen=True)
class Unit:
    """One admitted request (a prompt and its ``n`` samples): its admission index, the learner version at
    admission (deadline ``version + η``), the driver's ``key``, its state and restart count."""

    uid: int  # admission index: 0, 1, 2, … (unique over the run)
    version: int  # learner version at admission (its deadline is version + η)
    key: Any = None  # what the driver needs to regenerate it (e.g. the prompt's data index)
    state: str = RUNNING  # "running" (in flight on a worker) | "ready" (complete, awaiting the learner)
    attempt: int = 0  # restarts after a lost worker


@dataclass(frozen=True)
class Buffer:
    """The admission state (see the module doc): staleness bound ``eta`` (η), ``batch`` units per step,
    ``max_concurrent`` in flight, the live units, and the admitted / consumed / evicted counts and evictions."""

    eta: int
    batch: int
    max_concurrent: int
    units: tuple[Unit, ...] = ()  # live units (running or ready), in admission order
    admitted: int = 0
    consumed: int = 0
    evicted: int = 0
    evictions: tuple[tuple[int, Any, str], ...] = ()  # (uid, key, reason)

    @property
    def in_flight(self) -> int:
        return sum(u.state == RUNNING for u in self.units)

    @property
    def ready(self) -> int:
        return sum(u.state == READY for u in self.units)


def check_admission(eta: int, batch: int, max_concurrent: int) -> None:
    """Refuse settings the admission rule cannot serve, naming the key."""
    if not isinstance(eta, int) or eta < 0:
        raise ValueError(f"async.max_staleness: {eta!r}; η must be an integer ≥ 0 (0 = synchronous)")
    if batch < 1:
        raise ValueError(f"batch: {batch} units per step; the learner needs at least one prompt group per step")
    if max_concurrent < 1:
        raise ValueError(f"async.max_concurrent: {max_concurrent}; at least one request must be allowed in flight")


def capacity(in_flight: int, accepted: int, version: int, eta: int, batch: int, max_concurrent: int) -> int:
    """Units that may be admitted now: ``max(0, min(max_concurrent − in_flight,
    (η + V + 1)·batch − (accepted + in_flight)))`` (``accepted`` = ready + consumed)."""
    return max(0, min(max_concurrent - in_flight, (eta + version + 1) * batch - (accepted + in_flight)))


def buffer_init(eta: int, batch: int, max_concurrent: int) -> Buffer:
    """An empty admission buffer for staleness bound ``eta``, ``batch`` groups per step and at most
    ``max_concurrent`` groups in flight (checked by :func:`check_admission`)."""
    check_admission(eta, batch, max_concurrent)
    return Buffer(eta, batch, max_concurrent)


def _capacity(buf: Buffer, version: int) -> int:
    return capacity(buf.in_flight, buf.ready + buf.consumed, version, buf.eta, buf.batch, buf.max_concurrent)


def admit(buf: Buffer, keys: list, version: int) -> tuple[Buffer, tuple[Unit, ...]]:
    """Admit as many of ``keys`` as :func:`capacity` allows at learner version ``V`` (in order);
    returns the new buffer and the admitted units (uids ``admitted, admitted + 1, …``)."""
    n = min(len(keys), _capacity(buf, version))
    new = tuple(Unit(buf.admitted + i, version, k) for i, k in enumerate(keys[:n]))
    return replace(buf, units=buf.units + new, admitted=buf.admitted + n), new


def _find(buf: Buffer, uid: int) -> int:
    for i, u in enumerate(buf.units):
        if u.uid == uid:
            return i
    raise KeyError(f"sample_uid {uid}: not in flight (never admitted, already consumed or evicted)")


def _find_unit(buf: Buffer, uid: int) -> Unit:
    return buf.units[_find(buf, uid)]


def complete(buf: Buffer, uid: int) -> Buffer:
    """A running unit finished: it is ready for the learner. Completing a unit twice is an error
    (a duplicate would be trained twice)."""
    i = _find(buf, uid)
    if buf.units[i].state != RUNNING:
        raise ValueError(f"sample_uid {uid}: returned twice (it is already {buf.units[i].state})")
    return replace(buf, units=buf.units[:i] + (replace(buf.units[i], state=READY),) + buf.units[i + 1:])


def restart(buf: Buffer, uid: int) -> Buffer:
    """A running unit's worker was lost: it stays in flight (same uid, same deadline) and is
    generated again (``attempt + 1``)."""
    i = _find(buf, uid)
    if buf.units[i].state != RUNNING:
        raise ValueError(f"sample_uid {uid}: is {buf.units[i].state}, only a running unit can be restarted")
    u = buf.units[i]
    return replace(buf, units=buf.units[:i] + (replace(u, attempt=u.attempt + 1),) + buf.units[i + 1:])


def evict(buf: Buffer, uid: int, reason: str) -> Buffer:
    """Remove a live unit, counted and recorded with ``reason`` and its ``key``."""
    i = _find(buf, uid)
    u = buf.units[i]
    return replace(buf, units=buf.units[:i] + buf.units[i + 1:], evicted=buf.evicted + 1,
                   evictions=buf.evictions + ((u.uid, u.key, reason),))


def take_batch(buf: Buffer, version: int) -> tuple[Buffer, tuple[Unit, ...] | None]:
    """Earliest-deadline-first selection of ``batch`` ready units for learner version ``V``, or
    ``None`` (wait) when too few are ready or taking them would leave a unit unable to meet its
    deadline (see the module doc). The taken units leave the buffer (``consumed`` += batch)."""
    late = deadline_violations(buf.units, version, buf.eta)
    if late:
        raise ValueError(f"sample_uid {late[0]}: admitted at version {_find_unit(buf, late[0]).version} and still "
                         f"live at learner version {version} > its deadline (η = {buf.eta}); the admission bound "
                         "was bypassed (units admitted without capacity, or the learner's version jumped)")
    order = sorted(buf.units, key=lambda u: (u.version, u.uid))
    chosen = [u for u in order if u.state == READY][:buf.batch]
    if len(chosen) < buf.batch:
        return buf, None
    taken = {u.uid for u in chosen}
    due: dict[int, int] = {}  # deadline → live units left with that deadline
    for u in buf.units:
        if u.uid not in taken:
            due[u.version + buf.eta] = due.get(u.version + buf.eta, 0) + 1
    left = 0
    for d in sorted(due):
        left += due[d]
        if left > (d - version) * buf.batch:
            return buf, None
    rest = tuple(u for u in buf.units if u.uid not in taken)
    return replace(buf, units=rest, consumed=buf.consumed + len(chosen)), tuple(chosen)


def take_units(buf: Buffer, keys: list) -> tuple[Buffer, tuple[Unit, ...] | None]:
    """Take the live units with these ``keys`` (a replayed consumption: the learner takes what the
    recorded run took), or ``None`` (wait) while any of them is missing or still running. They
    leave the buffer in the order given (``consumed`` += len(keys))."""
    by_key = {u.key: u for u in buf.units}
    chosen = [by_key.get(k) for k in keys]
    if any(u is None or u.state != READY for u in chosen):
        return buf, None
    taken = {u.uid for u in chosen}
    rest = tuple(u for u in buf.units if u.uid not in taken)
    return replace(buf, units=rest, consumed=buf.consumed + len(chosen)), tuple(chosen)


def check_conservation(buf: Buffer) -> None:
    """``admitted = consumed + evicted + in_flight + ready``; raises if any unit is unaccounted."""
    if buf.admitted != buf.consumed + buf.evicted + buf.in_flight + buf.ready:
        raise AssertionError(f"buffer: admitted {buf.admitted} ≠ consumed {buf.consumed} + evicted {buf.evicted} "
                             f"+ in flight {buf.in_flight} + ready {buf.ready}")
    if buf.evicted != len(buf.evictions):
        raise AssertionError(f"buffer: {buf.evicted} evictions counted, {len(buf.evictions)} recorded")


def deadline_violations(units: tuple[Unit, ...], version: int, eta: int) -> list[int]:
    """uids of ``units`` that training at version ``V`` would make staler than η (``V > v_a + η``)."""
    return [u.uid for u in units if version - u.version > eta]
