"""``hyperrl diff RUN_A RUN_B``: where two runs part — their configs and package versions, then the first step and
the first stage of it whose fingerprints differ (:mod:`hyperrl.loop.fingerprints`), drilled down to the rows (by
``sample_uid``), the first differing token with both values (where the rows were kept), the loss terms and the
weight tensors; for asynchronous runs, the first event of their logs that differs (which call, which version).

A run without fingerprints is compared on its ``metrics.jsonl`` (the first step and metric that differ, the
clocks aside) and named as such. The pieces are pure functions of the two directories: :func:`diff_runs` →
:class:`RunDiff`, :func:`format_diff` → the text the command prints.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from hyperrl.errors import HyperRLError
from hyperrl.loop.fingerprints import FORMAT, STAGES, Fingerprints, read_fingerprints, unpack_detail

__all__ = ["RunDiff", "DiffError", "diff_runs", "format_diff"]

_MAX_ROWS = 10  # rows named in a drill-down (the count is always whole)
_CLOCKS = ("tokens_per_s", "async_admitted", "async_in_flight", "async_ready", "reward_latency_s",
           "reward_hidden_frac")


class DiffError(HyperRLError, ValueError):
    """Two run directories that cannot be compared (a missing directory, nothing recorded); the message says why."""


@dataclass
class RunDiff:
    """What differs between runs ``a`` and ``b``: ``config`` (dotted key → both values), ``versions`` (package →
    both), ``step`` and ``stage`` — the first that differ (None: none within the steps both reached), ``rows`` (the
    differing rows: ``sample_uid`` and the row in each run), ``token`` (the first differing position of the first
    differing row, both values), ``scalars`` / ``tensors`` (the loss terms / weight tensors that differ),
    ``steps`` (how far each run got), ``source`` (``fingerprints`` or ``metrics``), ``events`` (the first differing
    event of the asynchronous logs) and ``notes`` (what could not be compared, and why)."""

    a: str
    b: str
    config: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    steps: tuple[int, int] = (0, 0)
    source: str = "fingerprints"
    step: int | None = None
    stage: str | None = None
    rows: list[dict] = field(default_factory=list)
    n_rows: int = 0
    token: dict | None = None
    scalars: dict = field(default_factory=dict)
    tensors: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    events: dict | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The diff as JSON-able data (``hyperrl diff --json``)."""
        from dataclasses import asdict

        return asdict(self)


def _config(run: Path) -> dict:
    path = run / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _flat(d, prefix: str = "") -> dict:
    """Every leaf of a config as a dotted key (variants too: ``task.name``, ``task.max_operand``)."""
    if not isinstance(d, dict) or not d:
        return {prefix[:-1]: d}
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def _config_diff(a: dict, b: dict) -> dict:
    fa, fb = _flat(json.loads(json.dumps(a))), _flat(json.loads(json.dumps(b)))
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb))
            if k != "run.out_dir" and fa.get(k) != fb.get(k)}


def _versions_diff(fa: Fingerprints, fb: Fingerprints) -> dict:
    """Packages whose version differs between the runs' first starts, and any a later start (a resume) changed."""
    va, vb = fa.starts[0]["versions"] if fa.starts else {}, fb.starts[0]["versions"] if fb.starts else {}
    out = {k: [va.get(k), vb.get(k)] for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}
    for name, f in (("a", fa), ("b", fb)):
        for s in f.starts[1:]:
            changed = {k: [f.starts[0]["versions"].get(k), v] for k, v in s["versions"].items()
                       if f.starts[0]["versions"].get(k) != v}
            for k, (old, new) in changed.items():
                out.setdefault(f"{k} (run {name} resumed at step {s['step']})", [old, new])
    return out


def _same_float(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def _rows(ra: dict, rb: dict, stage: str) -> tuple[list[dict], int]:
    """The rows whose ``stage`` hash differs, aligned by ``sample_uid`` (a uid in one run only differs too)."""
    ua, ha = unpack_detail(ra)
    ub, hb = unpack_detail(rb)
    ia, ib = {int(u): i for i, u in enumerate(ua)}, {int(u): i for i, u in enumerate(ub)}
    out = []
    for u in sorted(set(ia) | set(ib)):
        i, j = ia.get(u), ib.get(u)
        if i is None or j is None or stage not in ha or stage not in hb or ha[stage][i] != hb[stage][j]:
            out.append({"sample_uid": u, "row_a": i, "row_b": j})
    return out[:_MAX_ROWS], len(out)


def _values(run: Path, step: int):
    from safetensors.torch import load_file

    f = run / "fingerprints" / f"step_{step}.safetensors"
    return load_file(f) if f.is_file() else None


_STAGE_KEY = {"prompts": "tokens", "completions": "tokens", "logprobs": "rollout_logprobs", "rewards": "reward",
              "advantages": "advantages"}


def _token(a: Path, b: Path, step: int, stage: str, row: dict) -> dict | None:
    """The first position where ``stage``'s values of the row differ, with both values — where both runs kept the
    step's rows (``run.fingerprint_values``)."""
    import torch

    from hyperrl.loop.fingerprints import stage_tensors

    va, vb = _values(a, step), _values(b, step)
    if va is None or vb is None or row["row_a"] is None or row["row_b"] is None:
        return None
    from tensordict import TensorDict

    ta = stage_tensors(TensorDict(va, batch_size=[va["sample_uid"].shape[0]])).get(stage)
    tb = stage_tensors(TensorDict(vb, batch_size=[vb["sample_uid"].shape[0]])).get(stage)
    if ta is None or tb is None:
        return None
    (xa, ma), (xb, mb) = ta, tb
    xa, xb = xa[row["row_a"]].reshape(-1), xb[row["row_b"]].reshape(-1)
    pa = torch.arange(xa.numel()) if ma is None else ma[row["row_a"]].reshape(-1).nonzero().flatten()
    pb = torch.arange(xb.numel()) if mb is None else mb[row["row_b"]].reshape(-1).nonzero().flatten()
    for k in range(max(len(pa), len(pb))):
        ya = xa[pa[k]].item() if k < len(pa) else None
        yb = xb[pb[k]].item() if k < len(pb) else None
        if not _same_float(ya, yb):
            return {"key": _STAGE_KEY[stage], "index": k, "position_a": int(pa[k]) if k < len(pa) else None,
                    "position_b": int(pb[k]) if k < len(pb) else None, "a": ya, "b": yb}
    return None


def _compare_step(d: RunDiff, a: Path, b: Path, ra: dict, rb: dict, names_a: list, names_b: list) -> bool:
    """Fill ``d`` with the first stage of this step that differs; → whether one did."""
    for stage in STAGES:
        ha, hb = ra["stages"].get(stage), rb["stages"].get(stage)
        if ha != hb:
            d.stage = stage
            d.rows, d.n_rows = _rows(ra, rb, stage)
            if d.rows:
                d.token = _token(a, b, d.step, stage, d.rows[0])
            return True
    sa, sb = ra.get("scalars", {}), rb.get("scalars", {})
    diff = {k: [sa.get(k), sb.get(k)] for k in sorted(set(sa) | set(sb)) if not _same_float(sa.get(k), sb.get(k))}
    if diff:
        d.stage, d.scalars = "loss", diff
        return True
    if ra.get("weights") != rb.get("weights"):
        d.stage = "weights"
        ta, tb = dict(zip(names_a, ra.get("tensors", []))), dict(zip(names_b, rb.get("tensors", [])))
        d.tensors = [k for k in list(ta) + [k for k in tb if k not in ta] if ta.get(k) != tb.get(k)]
        return True
    if ra.get("version") != rb.get("version"):
        d.stage, d.scalars = "version", {"policy_version": [ra.get("version"), rb.get("version")]}
        return True
    return False


def _metrics(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    out = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("event") == "step":
                out[r["step"]] = {k: v for k, v in r.items() if not k.startswith("time_") and k not in _CLOCKS}
    return out


def _by_metrics(d: RunDiff, a: Path, b: Path, only: int | None) -> None:
    ma, mb = _metrics(a), _metrics(b)
    d.source, d.steps = "metrics", (max(ma, default=0), max(mb, default=0))
    for s in ([only] if only is not None else sorted(set(ma) & set(mb))):
        if s not in ma or s not in mb:
            return
        diff = {k: [ma[s].get(k), mb[s].get(k)] for k in sorted(set(ma[s]) | set(mb[s]))
                if not _same_float(ma[s].get(k), mb[s].get(k))}
        if diff:
            d.step, d.stage, d.metrics = s, "metrics", diff
            return


def _events(a: Path, b: Path) -> dict | None:
    """The first differing event of two asynchronous runs' logs (``async_events.jsonl``): its line and both."""
    fa, fb = a / "async_events.jsonl", b / "async_events.jsonl"
    if not (fa.is_file() and fb.is_file()):
        return None
    la, lb = fa.read_text().splitlines(), fb.read_text().splitlines()
    for i in range(max(len(la), len(lb))):
        ea = json.loads(la[i]) if i < len(la) else None
        eb = json.loads(lb[i]) if i < len(lb) else None
        if ea != eb:
            return {"line": i + 1, "a": ea, "b": eb}
    return None


def diff_runs(a: str | Path, b: str | Path, *, step: int | None = None) -> RunDiff:
    """Compare run directories ``a`` and ``b`` (module doc); ``step``: drill into that step only."""
    a, b = Path(a), Path(b)
    for r in (a, b):
        if not r.is_dir():
            raise DiffError(f"{r}: no such run directory (give two run.out_dir directories)")
        if not (r / "metrics.jsonl").is_file() and not (r / "fingerprints.jsonl").is_file():
            raise DiffError(f"{r}: no metrics.jsonl or fingerprints.jsonl — not a run directory, or a run that never "
                            "finished a step")
    d = RunDiff(str(a), str(b), config=_config_diff(_config(a), _config(b)))
    d.events = _events(a, b)
    fa, fb = read_fingerprints(a), read_fingerprints(b)
    missing = [str(r) for r, f in ((a, fa), (b, fb)) if f is None or not f.steps]
    if missing:
        d.notes.append(f"{' and '.join(missing)}: no fingerprints (recorded since hyperrl 0.1.0 with "
                       "run.fingerprints: true) — compared on metrics.jsonl")
        _by_metrics(d, a, b, step)
        return d
    fmt = {f.starts[0].get("format") if f.starts else None for f in (fa, fb)}
    if fmt != {FORMAT}:
        d.notes.append(f"fingerprint formats {sorted(map(str, fmt))}: this hyperrl reads format {FORMAT} — compared on "
                       "metrics.jsonl")
        _by_metrics(d, a, b, step)
        return d
    d.versions = _versions_diff(fa, fb)
    d.steps = (max(fa.steps), max(fb.steps))
    names_a, names_b = fa.starts[0].get("tensors", []), fb.starts[0].get("tensors", [])
    common = sorted(set(fa.steps) & set(fb.steps))
    if step is not None:
        for name, f in (("a", fa), ("b", fb)):
            if step not in f.steps:
                d.notes.append(f"run {name} has no step {step} (it recorded steps {min(f.steps)}–{max(f.steps)})")
        common = [step] if not d.notes else []
    for s in common:
        d.step = s
        if _compare_step(d, a, b, fa.steps[s], fb.steps[s], names_a, names_b):
            return d
    d.step = None
    if d.steps[0] != d.steps[1] and step is None:
        short, longer = ("a", "b") if d.steps[0] < d.steps[1] else ("b", "a")
        d.notes.append(f"run {short} stops at step {min(d.steps)}, run {longer} goes on to step {max(d.steps)}")
    return d


def _val(v) -> str:
    return repr(v) if not isinstance(v, float) else f"{v!r}"


def format_diff(d: RunDiff) -> str:
    """The report ``hyperrl diff`` prints."""
    lines = [f"A: {d.a} ({d.steps[0]} steps)", f"B: {d.b} ({d.steps[1]} steps)"]
    if d.config:
        lines.append(f"config: {len(d.config)} setting(s) differ")
        lines += [f"  {k}: {_val(x)} → {_val(y)}" for k, (x, y) in d.config.items()]
    else:
        lines.append("config: the same")
    if d.source == "fingerprints":
        if d.versions:
            lines.append("packages: " + "; ".join(f"{k} {x} → {y}" for k, (x, y) in d.versions.items()))
        else:
            lines.append("packages: the same versions")
    lines += [f"note: {n}" for n in d.notes]
    if d.step is None:
        lines.append("no step differs" + (" (compared on metrics.jsonl)" if d.source == "metrics" else "")
                     + (f" in the {min(d.steps)} steps both reached" if d.steps[0] != d.steps[1] else ""))
    else:
        before = STAGES[:STAGES.index(d.stage)] if d.stage in STAGES else ()
        same = f" ({', '.join(before)} equal)" if before else ""
        lines.append(f"first difference: step {d.step}, {d.stage}{same}")
        if d.stage in STAGES:
            more = " …" if d.n_rows > len(d.rows) else ""
            lines.append(f"  {d.n_rows} row(s) differ — sample_uid: {', '.join(str(r['sample_uid']) for r in d.rows)}"
                         f"{more}; rows in A: {', '.join(str(r['row_a']) for r in d.rows)}{more}; in B: "
                         f"{', '.join(str(r['row_b']) for r in d.rows)}{more}")
            if d.token is not None:
                t = d.token
                lines.append(f"  first differing value of sample_uid {d.rows[0]['sample_uid']}: "
                             f"{t['key']}[{t['index']}] (position {t['position_a']} in A, {t['position_b']} in B): "
                             f"A {_val(t['a'])}, B {_val(t['b'])}")
            elif d.rows:
                lines.append(f"  (the rows' values are kept for the first run.fingerprint_values steps only: step "
                             f"{d.step} has none in both runs)")
        for k, (x, y) in {**d.scalars, **d.metrics}.items():
            lines.append(f"  {k}: A {_val(x)}, B {_val(y)}")
        if d.tensors:
            lines.append(f"  {len(d.tensors)} weight tensor(s) differ: {', '.join(d.tensors[:_MAX_ROWS])}"
                         + (" …" if len(d.tensors) > _MAX_ROWS else ""))
    if d.events is not None:
        e = d.events
        lines.append(f"async event logs part at line {e['line']}: A {json.dumps(e['a'])}, B {json.dumps(e['b'])}")
    return "\n".join(lines)
