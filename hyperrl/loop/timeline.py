"""The run's timeline: when each stage of each step ran, and each rollout worker's calls, as one trace.

:func:`write_timeline` (a hook ``hyperrl train`` installs) appends to ``out_dir/timeline.jsonl`` one record per step —
the trainer's timed stages (``generate`` or ``wait``, ``reward``, ``logprob``, ``update``, ``publish``: each
``[name, start, seconds]``, start in seconds since the epoch) and the collector's events since the last step (an
asynchronous run's worker calls: worker, call number, version, requests, aborted rows, decode steps, start,
seconds; a worker that died; an evicted group and why) — and one per evaluation and checkpoint. :func:`chrome_trace`
turns the records into the Chrome trace-event format Perfetto's UI (ui.perfetto.dev) and ``chrome://tracing`` open:
one track per learner stage and one per rollout worker, the published versions and evictions as instants.
``hyperrl trace RUN`` writes it (a run still in progress: what is there; a torn last line skipped).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["write_timeline", "read_timeline", "chrome_trace", "STAGE_TRACKS"]

# the learner's tracks, in the step's order (a collector's wait shares generation's track: one or the other runs)
STAGE_TRACKS = ("generate", "reward", "logprob", "update", "publish", "evaluate", "checkpoint")
_TRACK_OF = {"wait": "generate", "data": "generate", "values": "logprob"}
_LEARNER, _WORKERS = 1, 2  # the trace's processes


def write_timeline(out: Path):
    """A hook appending the step's timed stages and collector events (the ``batch`` event), each evaluation's and
    checkpoint's time (``span``) and each resume to ``out/timeline.jsonl``."""
    path = Path(out) / "timeline.jsonl"

    def hook(event, trainer, payload):
        if event == "batch":
            rec = {"step": payload["step"], "version": payload["metrics"].get("policy_version"),
                   "spans": [list(s) for s in payload.get("spans", ())], "events": payload.get("events", [])}
        elif event == "span":
            rec = {"step": payload["step"], "span": payload["name"], "t0": payload["t0"], "dur": payload["dur"]}
        elif event == "resume":
            rec = {"step": payload["step"], "event": "resume", "t0": time.time()}
        else:
            return
        with path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    return hook


def read_timeline(run: str | Path) -> list[dict]:
    """``run/timeline.jsonl``'s records (a torn last line — a run still writing — skipped)."""
    path = Path(run) / "timeline.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no timeline — the run was started before hyperrl recorded one, or never "
                                "finished a step")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _meta(pid: int, tid: int | None, name: str) -> dict:
    e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name", "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


def chrome_trace(records: list[dict]) -> dict:
    """Timeline records → a Chrome / Perfetto trace (``{"traceEvents": [...]}``): complete events (``ph: X``,
    microseconds from the first record) on one track per learner stage (:data:`STAGE_TRACKS`) and one per rollout
    worker; a ``version V`` instant at the end of each publication; evictions, worker deaths and resumes as
    instants."""
    starts = [s[1] for r in records for s in r.get("spans", ())] + [r["t0"] for r in records if "t0" in r] + \
        [e["t0"] for r in records for e in r.get("events", ()) if "t0" in e]
    t0 = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 1)

    stage_tid = {name: i + 1 for i, name in enumerate(STAGE_TRACKS)}
    workers: dict[str, int] = {}
    ev = [_meta(_LEARNER, None, "learner"), _meta(_WORKERS, None, "rollout workers")]
    ev += [_meta(_LEARNER, tid, name) for name, tid in stage_tid.items()]
    for r in records:
        step = r["step"]
        for name, start, dur in r.get("spans", ()):
            track = _TRACK_OF.get(name, name)
            tid = stage_tid.setdefault(track, len(stage_tid) + 1)
            ev.append({"ph": "X", "name": name, "pid": _LEARNER, "tid": tid, "ts": us(start),
                       "dur": round(dur * 1e6, 1), "args": {"step": step}})
            if name == "publish" and r.get("version") is not None:
                ev.append({"ph": "i", "s": "p", "name": f"version {r['version']}", "pid": _LEARNER, "tid": tid,
                           "ts": us(start + dur), "args": {"step": step}})
        if "span" in r:
            tid = stage_tid.setdefault(r["span"], len(stage_tid) + 1)
            ev.append({"ph": "X", "name": r["span"], "pid": _LEARNER, "tid": tid, "ts": us(r["t0"]),
                       "dur": round(r["dur"] * 1e6, 1), "args": {"step": step}})
        if r.get("event") == "resume":
            ev.append({"ph": "i", "s": "g", "name": f"resumed at step {step}", "pid": _LEARNER, "tid": 0,
                       "ts": us(r["t0"])})
        for e in r.get("events", ()):
            if "evict" in e:
                ev.append({"ph": "i", "s": "p", "name": f"evicted group {e['evict']}", "pid": _WORKERS, "tid": 0,
                           "ts": us(e["t0"]), "args": {"why": e["why"], "step": step}})
                continue
            tid = workers.setdefault(e["worker"], len(workers) + 1)
            name = f"call {e['call']}" + (" (worker died)" if e.get("died") else "")
            args = {k: e[k] for k in ("call", "version", "requests", "aborted", "steps") if k in e}
            ev.append({"ph": "X", "name": name, "pid": _WORKERS, "tid": tid, "ts": us(e["t0"]),
                       "dur": round(e["dur"] * 1e6, 1), "args": {**args, "trained at step": step}})
    ev += [_meta(_LEARNER, tid, name) for name, tid in stage_tid.items() if name not in STAGE_TRACKS]
    ev += [_meta(_WORKERS, tid, name) for name, tid in workers.items()]
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": t0}}
