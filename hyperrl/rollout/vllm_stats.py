"""vLLM's own statistics as step metrics: what its scheduler saw while a generation ran.

vLLM keeps Prometheus metrics in the process that holds its ``LLM`` (``LLM.get_metrics()``, with
``disable_log_stats=False``): counters (preemptions, prefix-cache queries and hits, tokens), histograms (each
request's time in the queue) and gauges (requests waiting, running; KV-cache usage). The gauges read ~0 once a
synchronous ``generate`` has returned, so :class:`EngineStats` samples them from a thread while the generation
runs (10 ms after it starts, then every ``interval`` s: a snapshot costs ~3 ms) and takes the counters' and
histograms' differences across it:

* ``engine_requests_waiting_max`` / ``engine_requests_running_max`` — the scheduler's queue and batch at their
  largest (sampled);
* ``engine_kv_cache_usage_max`` — the KV cache's fill at its largest (sampled, 0–1);
* ``engine_queue_time_s`` — the mean time a request waited before it was scheduled;
* ``engine_preemptions`` — requests preempted (their KV cache evicted and recomputed);
* ``engine_prefix_cache_hit_rate`` — the share of prompt tokens the prefix cache served.
"""

from __future__ import annotations

import contextlib
import threading

__all__ = ["EngineStats"]

_COUNTERS = {"vllm:num_preemptions": "preemptions", "vllm:prefix_cache_queries": "queries",
             "vllm:prefix_cache_hits": "hits"}
_GAUGES = {"vllm:num_requests_waiting": "engine_requests_waiting_max",
           "vllm:num_requests_running": "engine_requests_running_max",
           "vllm:kv_cache_usage_perc": "engine_kv_cache_usage_max"}
_QUEUE = "vllm:request_queue_time_seconds"


def _snapshot(metrics) -> dict[str, float]:
    """Counters (summed over label sets), gauges (max over label sets) and the queue histogram's sum and count."""
    out: dict[str, float] = {}
    for m in metrics:
        name = m.name
        if name in _COUNTERS:
            out[_COUNTERS[name]] = out.get(_COUNTERS[name], 0.0) + float(m.value)
        elif name in _GAUGES:
            out[_GAUGES[name]] = max(out.get(_GAUGES[name], 0.0), float(m.value))
        elif name == _QUEUE:
            out["queue_sum"] = out.get("queue_sum", 0.0) + float(m.sum)
            out["queue_count"] = out.get("queue_count", 0.0) + float(m.count)
    return out


class EngineStats:
    """Sample an ``LLM``'s metrics around its generations (:meth:`during`) and hand the step's figures over once
    (:meth:`pop`). ``llm``: a ``vllm.LLM`` built with ``disable_log_stats=False``."""

    def __init__(self, llm, *, interval: float = 0.1):
        self.llm, self.interval = llm, interval
        self.base = _snapshot(llm.get_metrics())
        self.peaks: dict[str, float] = {}
        self._lock = threading.Lock()  # an async run pops on the learner's thread while a worker's thread samples

    @contextlib.contextmanager
    def during(self):
        """Sample the gauges on a thread while the body (a ``generate``) runs."""
        stop = threading.Event()

        def sample():
            wait = min(self.interval, 0.01)  # the first look early: a short generation is over before `interval`
            while not stop.wait(wait):
                wait = self.interval
                snap = _snapshot(self.llm.get_metrics())
                with self._lock:
                    for k, v in snap.items():
                        if k.startswith("engine_"):
                            self.peaks[k] = max(self.peaks.get(k, 0.0), v)

        t = threading.Thread(target=sample, name="hyperrl-vllm-stats", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()

    def pop(self) -> dict[str, float]:
        """The figures since the last call (module doc); the peaks start again."""
        now = _snapshot(self.llm.get_metrics())
        with self._lock:
            peaks, self.peaks = self.peaks, {}
        d = {k: now.get(k, 0.0) - self.base.get(k, 0.0) for k in ("preemptions", "queries", "hits", "queue_sum",
                                                                   "queue_count")}
        out = {**{k: max(v, now.get(k, 0.0)) for k, v in peaks.items()},
               "engine_preemptions": d["preemptions"],
               "engine_prefix_cache_hit_rate": d["hits"] / d["queries"] if d["queries"] else 0.0,
               "engine_queue_time_s": d["queue_sum"] / d["queue_count"] if d["queue_count"] else 0.0}
        for k in _GAUGES.values():
            out.setdefault(k, now.get(k, 0.0))
        self.base = now
        return out
