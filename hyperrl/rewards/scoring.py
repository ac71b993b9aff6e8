"""Scoring a batch with a config's rewards: :class:`RewardSet` — each reward's calls made on its runner
(:mod:`hyperrl.rewards.runners`: inline in one pass, threads, processes, the event loop), collected into
``reward_components [B, K]``, the applicability mask and the metrics, the values those of one call at a time in row
order whatever the runner; a failed call named by reward and batch row. What the rewards are and how a config's
list resolves to them is :mod:`hyperrl.rewards.styles`'s; how each style calls its function,
:mod:`hyperrl.rewards.calling`'s.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from hyperrl.rewards.calling import Reward, RewardError, failure_error, reward_style, source_of
from hyperrl.rewards.runners import RUNNERS, Call, Finished, Outcome, WorkerStartError, submit

__all__ = ["RewardSet", "Pending", "Ran"]


def _own(fn) -> bool:
    """``fn`` is one of hyperrl's own rewards (defined in a ``hyperrl.`` module, a factory's closure included)."""
    return (getattr(fn, "__module__", None) or "").startswith("hyperrl.")


class Ran:
    """An inline reward's calls, made now in one pass (:meth:`~hyperrl.rewards.runners.InlineRunner.run_all`): the
    same outcomes as :func:`~hyperrl.rewards.runners.submit` gives call by call, without a future per call."""

    __slots__ = ("values", "failed", "futures")

    def __init__(self, runner, calls: list[Call]):
        self.values, self.failed = runner.run_all(calls)
        self.futures = (Finished(Outcome()),)  # one stamp: when the last call returned

    def outcomes(self):
        """Each call's :class:`Outcome`, in order."""
        for i, v in enumerate(self.values):
            yield self.failed[i] if i in self.failed else _OK(v)


def _read_values(r: Reward, conv, rows: list[int], calls: list[Call], values: list, value: dict, extra: dict) -> None:
    """What the calls returned (all of them returned) → ``value`` / ``extra`` by batch row, read by the style."""
    try:
        for c, out in zip(calls, values):
            for j, (v, e) in zip(c.rows, conv.read(r, c, out)):
                value[rows[j]], extra[rows[j]] = v, e
    except RewardError as e:  # the row within this reward's rows → the batch row
        if e.row is None:
            raise
        raise RewardError(f"{e} — batch row {rows[e.row]}", row=rows[e.row]) from e


class _OK:
    """A successful call's outcome (what :class:`Outcome` says of it, without a frozen dataclass per call)."""

    __slots__ = ("value",)
    failure = kind = error = None
    attempts = 1

    def __init__(self, value):
        self.value = value


@dataclass(frozen=True)
class Pending:
    """Scores under way (:meth:`RewardSet.submit`): per reward, its index, the rows it scores, its calls and their
    futures."""

    n: int
    parts: tuple
    stamps: list = field(default_factory=list)  # when each call finished (time.perf_counter)

    def finished_at(self) -> float | None:
        """When its last call finished (None: some still running)."""
        calls = sum(len(fs.futures if isinstance(fs, Ran) else fs) for _, _, _, fs in self.parts)
        return max(self.stamps, default=None) if len(self.stamps) >= calls and calls else None


@dataclass(frozen=True)
class RewardSet:
    """Several rewards scored together: ``score`` → (components ``[B, K]``, applicable ``[B, K]``,
    metrics). The total reward is ``(components · weights).sum(-1)``. Each reward's calls run on its runner
    (:mod:`hyperrl.rewards.runners`: inline, threads, processes, the event loop — started here, released by
    :meth:`close`); ``submit`` starts a batch's calls and ``collect`` waits for them, so scoring can overlap other
    work; the values are those of one call at a time, in row order, whatever the runner."""

    rewards: tuple[Reward, ...]
    runners: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        if not self.runners:
            runners = []
            try:
                for r in self.rewards:
                    runners.append(RUNNERS.get(r.runner_kind)(r.fn, workers=r.workers, timeout_s=r.timeout_s,
                                                              recipe=r.recipe, name=r.name))
            except WorkerStartError as e:
                for run in runners:
                    run.close()
                raise RewardError(str(e)) from None
            object.__setattr__(self, "runners", tuple(runners))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rewards)

    @property
    def weights(self) -> torch.Tensor:
        return torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)

    def close(self) -> None:
        """Release the rewards' threads and worker processes."""
        for run in self.runners:
            run.close()

    def submit(self, prompts: list, texts: list[str], ids: list[list[int]], samples: list) -> Pending:
        """Start every reward's calls on these rows (an inline reward runs now); :meth:`collect` the result. A
        user's reward gets copies of the prompts and samples: one that mutates its arguments cannot change the
        dataset (hyperrl's own rewards only read theirs: no copy — a step of the default job deep-copied 1,024)."""
        import copy

        parts = []
        for k, (r, run) in enumerate(zip(self.rewards, self.runners)):
            rows = [i for i, s in enumerate(samples) if r.data_sources is None or source_of(s) in r.data_sources]
            if not rows:
                continue
            ps, ss = [prompts[i] for i in rows], [samples[i] for i in rows]
            if not _own(r.fn):
                ps, ss = copy.deepcopy(ps), copy.deepcopy(ss)
            calls = reward_style(r.style).make_calls(r, ps, [texts[i] for i in rows], [ids[i] for i in rows], ss)
            if not r.retries and hasattr(run, "run_all"):  # an inline reward: its calls made now, in one pass
                parts.append((k, rows, calls, Ran(run, calls)))
            else:
                parts.append((k, rows, calls, [submit(run, c, r.retries) for c in calls]))
        out = Pending(len(texts), tuple(parts))
        for _, _, _, fs in parts:
            for f in fs.futures if isinstance(fs, Ran) else fs:
                f.add_done_callback(lambda _f, st=out.stamps: st.append(time.perf_counter()))
        return out

    def collect(self, *pendings: Pending):
        """The submitted scores — of several submissions, their rows one after another (a step's groups scored as
        each finished): (components ``[B, K]``, applicable ``[B, K]``, metrics), as one :meth:`score` of all the
        rows gives. A failed call raises a :class:`RewardError` naming the reward and the row — or, ``on_error:
        abstain``, leaves its rows not applicable, counted in ``reward_<name>_failed`` (with
        ``reward_<name>_retries``: calls made again)."""
        B, K = sum(p.n for p in pendings), len(self.rewards)
        comps, applicable = torch.zeros(B, K), torch.zeros(B, K, dtype=torch.bool)
        metrics: dict[str, float] = {}
        offsets = [sum(p.n for p in pendings[:i]) for i in range(len(pendings))]
        for k, r in enumerate(self.rewards):
            parts = [([off + i for i in rows], calls, futures) for p, off in zip(pendings, offsets)
                     for kk, rows, calls, futures in p.parts if kk == k]
            if not parts:
                continue
            conv, everyone = reward_style(r.style), [i for rows, _, _ in parts for i in rows]
            value, extra, failed, retried = {}, {}, 0, 0
            for rows, calls, futures in parts:
                if isinstance(futures, Ran) and not futures.failed:  # every call returned: read the values
                    _read_values(r, conv, rows, calls, futures.values, value, extra)
                    continue
                for c, o in zip(calls, futures.outcomes() if isinstance(futures, Ran) else
                                (f.result() for f in futures)):
                    retried += o.attempts - 1
                    if o.failure is not None:
                        if o.kind == "invalid" or r.on_error == "raise":
                            raise _call_error(r, c, o, rows)
                        failed += len(c.rows)
                        if failed == len(c.rows):
                            warnings.warn(f"reward {r.name!r} {o.failure}; on_error: abstain — its rows are not "
                                          f"scored (counted in reward_{r.name}_failed)", RuntimeWarning, stacklevel=2)
                        continue
                    try:
                        for j, (v, e) in zip(c.rows, conv.read(r, c, o.value)):
                            value[rows[j]], extra[rows[j]] = v, e
                    except RewardError as e:  # the row within this reward's rows → the batch row
                        if e.row is None:
                            raise
                        raise RewardError(f"{e} — batch row {rows[e.row]}", row=rows[e.row]) from e
            got = [(i, float(value[i])) for i in everyone if value.get(i) is not None]  # one write per reward
            if got:
                idx = torch.tensor([i for i, _ in got])
                comps[idx, k] = torch.tensor([v for _, v in got])
                applicable[idx, k] = True
            extras = [extra[i] for i in everyone if i in extra]
            for key in sorted({key for e in extras for key in e}):
                vals = [e[key] for e in extras if key in e]
                metrics[f"reward_{r.name}_{key}_mean"] = sum(vals) / len(vals)
            if r.retries or r.on_error == "abstain":
                metrics[f"reward_{r.name}_failed"] = float(failed)
                metrics[f"reward_{r.name}_retries"] = float(retried)
        return comps, applicable, metrics

    @property
    def overlaps(self) -> bool:
        """Do all its calls run off the caller's thread (pooled or async): does :meth:`submit` return at once?"""
        return bool(self.runners) and not any(run.synchronous for run in self.runners)

    def score(self, prompts: list, texts: list[str], ids: list[list[int]], samples: list):
        """:meth:`submit` then :meth:`collect`."""
        return self.collect(self.submit(prompts, texts, ids, samples))

    def token_rewards(self, pieces: list[list], samples: list, comps: torch.Tensor,
                      applicable: torch.Tensor) -> list[list[float]]:
        """Step rewards per response token, ``Σ_t = `` the row's total reward: each reward with a
        ``token_credit(pieces, sample)`` split (a registered function's attribute, e.g.
        ``digit_credit``) spreads its weighted value over the tokens; every other reward lands on
        the last token (verl's outcome placement). ``pieces[i]``: row i's token texts (None = stop)."""
        out, splits = [], [reward_style(r.style).splits_tokens for r in self.rewards]
        for i, (row, s) in enumerate(zip(pieces, samples)):
            credit, rest = [0.0] * len(row), 0.0
            for k, r in enumerate(self.rewards):
                split = getattr(r.fn, "token_credit", None) if splits[k] else None
                if not bool(applicable[i, k]):
                    continue
                if split is None or not row:
                    rest += r.weight * float(comps[i, k])
                    continue
                for t, v in enumerate(split(row, s, **r.kwargs)):
                    credit[t] += r.weight * v
            if row:
                credit[-1] += rest
            out.append(credit)
        return out

    def total(self, comps: torch.Tensor) -> torch.Tensor:
        return (comps * self.weights).sum(-1)


def _call_error(r: Reward, c, o, rows: list[int]) -> RewardError:
    """The error of a failed call, its row (of the reward's ``rows``, when one is to blame) named as the batch's."""
    e = o.error if o.kind == "invalid" else None
    if e is not None:  # the reward named bad input itself (its row: within the call's rows)
        row, msg = getattr(e, "row", None), str(e)
        j = c.rows[row] if row is not None and 0 <= row < len(c.rows) else (
            c.rows[0] if len(c.rows) == 1 and reward_style(r.style).per_row else None)
    else:
        err = failure_error(r, c, o.failure)
        j, msg = err.row, str(err)
    if j is None:
        return RewardError(msg)
    return RewardError(f"{msg} — batch row {rows[j]}", row=rows[j])
