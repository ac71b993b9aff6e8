"""The AsyncTrainer on Ray (``async.executor: {name: ray, …}``), on a real Ray cluster: rollout
workers are actors with their own engines, publications reach every one through the publisher and
Ray's object store (two-phase, all-or-nothing), a killed worker — ``ray.kill`` or SIGKILL of its
process, at random moments — loses no trajectory and trains none twice, and a run spans the nodes
of a multi-node cluster (``ray.cluster_utils.Cluster``: several raylets on this machine)."""

import os
import random
import signal
import threading
import time

import pytest
import ray
import torch

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.loop.trainer import AsyncTrainer
from hyperrl.rollout import WeightPublishError
from hyperrl.rollout.workers import WorkerError
from tests.async_helpers import assert_every_sample_trained_once, kill_and_resume

# one Ray instance at a time (README: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(tmp_path, *extra, workers=2):
    return load_config(None, ["--task=modsum", "--rollout.max_new_tokens=16", f"--run.out_dir={tmp_path}",
                              "--run.eval_every=0", "--rollout.prompts_per_step=4", "--rollout.n=4",
                              "--run.threads=1", f"--async.executor={{name: ray, workers: {workers}, num_cpus: 1}}",
                              *extra])


# what depends on timing, not on what was generated and trained: how many groups were in flight or
# ready (admitted) when the learner took its batch, and the clocks
_TIMING = {"tokens_per_s", "async_admitted", "async_in_flight", "async_ready"}


class _Recording(AsyncTrainer):
    def collect(self, timer):
        got = super().collect(timer)
        batch, info = got.batch, got.metrics
        self.trained = getattr(self, "trained", []) + [(self.version, batch["sample_uid"].tolist())]
        assert info["staleness_max"] <= self.collector.eta  # every trained token within η, each step
        return got


def _served(w) -> dict:
    return ray.get(w.actor.__ray_call__.remote(lambda a: a.engine.state_dict()))


def _slow_decode(tr, seconds: float = 0.01) -> None:
    """Every actor's decode steps ``seconds`` slower (only the timing changes), so publications
    land mid-generation even when the learner is slowed by a loaded machine. The flag class is
    made inside the actor's function so that it travels by value (the actor cannot import tests)."""

    def patch(actor):
        class _Slow:
            def __init__(self, inner):
                self.inner = inner

            def is_set(self):
                time.sleep(seconds)
                return self.inner.is_set()

        gen = actor.engine.generate_requests
        actor.engine.generate_requests = lambda reqs, sp, abort=None, **kw: gen(reqs, sp, abort=_Slow(abort), **kw)

    ray.get([w.actor.__ray_call__.remote(patch) for w in tr.collector.workers])


def _assert_serving(tr):
    """Every worker serves the learner's version, with exactly the learner's weights."""
    want = {k: v.detach() for k, v in tr.policy.state_dict().items()}
    for w in tr.collector.workers:
        assert w.info()["version"] == tr.version
        got = _served(w)
        assert all(torch.equal(got[k], want[k]) for k in want), w.name


def test_ray_workers_train_within_eta_publish_to_every_actor_and_lose_nothing(cluster, tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--async.max_staleness=1"), trainer=_Recording, max_staleness=1)
    _slow_decode(tr)
    try:
        assert len({w.info()["pid"] for w in tr.collector.workers}) == 2 and tr.engine.policy_version == 0
        ms = [tr.step() for _ in range(6)]
        _assert_serving(tr)
        assert 0 <= tr.evaluate()["eval_reward_mean"] <= 1  # evaluation on a paused worker
    finally:
        tr.close()
    uids = [u for _, us in tr.trained for u in us]
    assert len(uids) == len(set(uids)) == 6 * 4 * 4
    assert max(m["staleness_max"] for m in ms) == 1 and ms[-1]["async_evicted"] == 0
    assert any(m["partial_rows_frac"] > 0 for m in ms), "no request was resumed across a publication"


def test_a_refused_publication_leaves_every_worker_at_the_old_version(cluster, tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--async.max_staleness=1"), trainer=AsyncTrainer, max_staleness=1)
    try:
        tr.step()
        group, v = tr.engine, tr.engine.policy_version
        bad = {k: t.clone() for k, t in tr.policy.state_dict().items()}
        bad["model.norm.weight"][0] = float("nan")
        with pytest.raises(WeightPublishError, match="model.norm.weight: contains NaN"):
            group.load_weights(bad, v + 1)  # refused locally, before anything is shipped
        # a refusal inside one actor: its engine refuses a shape the group's check let through
        victim = tr.collector.workers[1]
        def widen(a):  # the actor's engine now expects a wider final norm
            norm = a.engine.model.model.norm
            norm.weight = torch.nn.Parameter(torch.ones(norm.weight.shape[0] + 1))

        ray.get(victim.actor.__ray_call__.remote(widen))
        with pytest.raises(WeightPublishError, match="rollout-worker-1 refused version"):
            group.load_weights({k: t.clone() for k, t in tr.policy.state_dict().items()}, v + 1)
        assert group.policy_version == v and [w.info()["version"] for w in tr.collector.workers] == [v, v]
    finally:
        tr.close()


def test_killed_workers_lose_no_trajectory_and_train_none_twice(cluster, tmp_path):
    """8 kills at random moments (generation, publication, idle), alternating ``ray.kill`` and SIGKILL
    of the actor's process; each killed worker is restarted serving the current version and its
    requests are generated again from their partial tokens."""
    tr = build_trainer(_cfg(tmp_path, "--async.max_staleness=1",
                            "--async.executor={name: ray, workers: 2, num_cpus: 1, max_restarts: 25}"),
                       trainer=_Recording, max_staleness=1)
    rng, kills, done = random.Random(0), [], threading.Event()

    def killer():
        while len(kills) < 8 and not done.is_set():
            time.sleep(rng.uniform(0.0, 0.5))
            w = rng.choice(tr.collector.workers)
            try:
                pid = w.info()["pid"]  # alive (restarted) before it is killed again
            except Exception:  # noqa: BLE001 — mid-restart: pick again
                continue
            if len(kills) % 2:
                ray.kill(w.actor, no_restart=True)
            else:
                os.kill(pid, signal.SIGKILL)
            kills.append(w.name)

    k = threading.Thread(target=killer, daemon=True)
    k.start()
    try:
        deadline, extra = time.monotonic() + 240, 0
        while extra < 2:
            m = tr.step()
            extra += not k.is_alive() and sum(w.restarts for w in tr.collector.workers) == len(kills)
            restarts = [w.restarts for w in tr.collector.workers]
            assert time.monotonic() < deadline, f"{len(kills)} kills, restarts {restarts}"
        _assert_serving(tr)
    finally:
        done.set()
        tr.close()
    assert len(kills) == 8 and sum(w.restarts for w in tr.collector.workers) == 8
    assert m["async_restarts"] == 8  # every restart counted, those during a publication's commit too
    uids = [u for _, us in tr.trained for u in us]
    assert len(uids) == len(set(uids)) == tr.step_idx * 4 * 4  # nothing lost from a trained step, nothing twice
    key = lambda u: (u // 64) * 4 + (u // 4) % 4  # uid = step·64 + g·4 + j → the prompt's key step·4 + g
    trained = {key(u) for u in uids}
    live = {u.key for u in tr.collector.queue.buffer.units} | set(tr.collector.queue.requeue)
    # every admitted prompt accounted for
    assert trained | live == set(range(tr.collector.queue.next_key)) and not trained & live
    b = tr.collector.queue.buffer
    assert b.admitted == b.consumed + b.evicted + b.in_flight + b.ready and b.evicted == 0


def test_a_worker_past_its_restarts_fails_the_step_naming_it(cluster, tmp_path):
    tr = build_trainer(_cfg(tmp_path, "--async.max_staleness=1",
                            "--async.executor={name: ray, workers: 2, num_cpus: 1, max_restarts: 0}"),
                       trainer=AsyncTrainer, max_staleness=1)
    try:
        tr.step()
        ray.kill(tr.collector.workers[1].actor, no_restart=True)
        with pytest.raises(WorkerError, match=r"rollout-worker-1 died and was restarted 0 times already "
                                              r"\(async.executor.max_restarts=0\)"):
            for _ in range(5):
                tr.step()
    finally:
        tr.close()


def test_gated_ray_run_equals_the_gated_thread_run_bit_for_bit(cluster, tmp_path):
    """The same gated schedule (batch k generated whole at version k − η) on a Ray actor and on the
    learner's thread: the same metrics and weights, bit for bit (keyed sampling; one torch thread)."""
    runs = []
    for name, ex in (("thread", "{name: thread}"), ("ray", "{name: ray, workers: 1, num_cpus: 1}")):
        cfg = _cfg(tmp_path / name, "--async.max_staleness=1", "--async.schedule=gated",
                   f"--async.executor={ex}")
        tr = build_trainer(cfg)
        try:
            runs.append(([tr.step() for _ in range(4)], {k: v.clone() for k, v in tr.policy.state_dict().items()}))
        finally:
            tr.close()
    (ma, wa), (mb, wb) = runs
    for a, b in zip(ma, mb):
        same = {k: a[k] for k in a if not k.startswith("time_") and k != "tokens_per_s"}
        assert same == {k: b[k] for k in same}
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_bad_ray_settings_are_refused(cluster, tmp_path):
    with pytest.raises(ValueError, match="async.executor.workers=0"):
        build_trainer(_cfg(tmp_path, "--async.max_staleness=1", workers=0))
    with pytest.raises(ValueError, match="share_weights"):
        build_trainer(_cfg(tmp_path, "--async.max_staleness=1", "--rollout.engine.share_weights=true",
                           "--model.dtype=float32"), trainer=AsyncTrainer, max_staleness=1)


def test_a_free_running_ray_run_replays_from_its_event_log_bit_for_bit(cluster, tmp_path):
    """Two actor workers running free (η = 2): the event log replays the same calls on the actors —
    each stopped where the recorded one was interrupted — and the same batches, bit for bit."""
    runs = []
    for name, extra in (("free", ()), ("replay", (f"--async.replay={tmp_path / 'free' / 'async_events.jsonl'}",))):
        tr = build_trainer(_cfg(tmp_path / name, "--async.max_staleness=2", *extra))
        if name == "free":
            _slow_decode(tr)
        try:
            ms = [tr.step() for _ in range(5)]
        finally:
            tr.close()
        runs.append((ms, {k: v.clone() for k, v in tr.policy.state_dict().items()}))
    (ma, wa), (mb, wb) = runs
    assert any(m["partial_rows_frac"] > 0 for m in ma), "no request was interrupted: the test would prove nothing"
    for a, b in zip(ma, mb):
        same = {k: a[k] for k in a if k not in _TIMING and not k.startswith("time_")}
        assert same == {k: b[k] for k in same}
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_killed_ray_run_resumes_losslessly(cluster, tmp_path):
    """Checkpoint at step 3 with groups in flight, throw the run away (its actors with it), start a new
    run with new actors and resume: the live groups are generated again with the same uids, every
    sample is trained once, the data cursor continues exactly, and the new actors serve the resumed
    weights."""
    cfg = _cfg(tmp_path, "--rollout.max_new_tokens=8", "--async.max_staleness=2")
    # after resume: the new actors were born at version 0 and got the resumed weights
    a, b, state, live_end = kill_and_resume(lambda: build_trainer(cfg, trainer=_Recording),
                                            after_resume=_assert_serving)
    assert_every_sample_trained_once(cfg, a, b, state, live_end)


def _assert_serving_cast(tr):
    """Every worker serves the learner's version, bit for bit what a full publication casts and sends."""
    for w in tr.collector.workers:
        assert w.info()["version"] == tr.version
        got = _served(w)
        for k, p in tr.policy.named_parameters():
            want = p.detach().to(got[k].dtype)
            assert torch.equal(got[k].view(torch.int16), want.view(torch.int16)), (w.name, k)


def test_deltas_reach_every_actor_and_a_skewed_or_damaged_actor_gets_the_full_weights(cluster, tmp_path, monkeypatch):
    """``rollout.delta_publication`` into Ray actors (bf16 engines, fp32 master): the group checks each delta
    (names, sizes, new elements finite), only the deltas travel, every actor applies them and verifies the
    checksums; after every step each actor is bit-identical to a full publication. An actor at another version,
    and an actor whose weights were damaged (its checksum fails), each make the publisher fall back to the full
    weights, named — and every actor is exact again; an actor born again after deltas (the last full
    publication + the deltas since, or those folded in) is exact too."""
    tr = build_trainer(_cfg(tmp_path, "--async.max_staleness=1", "--model.dtype=bfloat16", "--optim.lr=1e-5",
                            "--rollout.delta_publication=true"), trainer=AsyncTrainer, max_staleness=1)
    pub = tr.publisher.publisher
    try:
        fracs = []
        for _ in range(3):
            fracs.append(tr.step()["delta_frac"])
            _assert_serving_cast(tr)
        assert fracs[0] == 1.0 and all(0 < f < 0.3 for f in fracs[1:]), fracs  # the first has no base
        assert "delta_fallback" not in pub.last and pub.last["publish_bytes"] < pub.last["publish_full_bytes"]
        victim = tr.collector.workers[1]

        def skew(a):  # the actor's engine claims the version before the group's
            a.engine._version -= 1

        tr.collector.stop_workers()  # publications by hand from here (steps would find versions they did not make)

        def publish_after(fn):  # ``fn`` in the actor, then the next version published
            if fn is not None:
                ray.get(victim.actor.__ray_call__.remote(fn))
            tr.publisher.publish(tr.version + 1)
            tr.version += 1
            return pub.last

        said = publish_after(skew)["delta_fallback"]
        assert pub.last["delta_frac"] == 1.0
        assert "rollout-worker-1 refused version" in said and "this engine serves version" in said, said
        _assert_serving_cast(tr)

        def damage(a):  # one row of one weight changed behind the group's back
            with torch.no_grad():
                a.engine.model.model.layers[0].mlp.down_proj.weight[0] += 1.0

        said = publish_after(damage)["delta_fallback"]
        assert pub.last["delta_frac"] == 1.0
        assert "rollout-worker-1 refused" in said and "model.layers.0.mlp.down_proj.weight: checksum mismatch" in said
        _assert_serving_cast(tr)
        assert publish_after(None)["delta_frac"] < 0.3 and "delta_fallback" not in pub.last  # deltas again
        _assert_serving_cast(tr)
        # an actor born again gets the last full publication with the deltas since applied to it
        assert publish_after(None)["delta_frac"] < 0.3 and len(tr.engine._chain) == 2
        ray.kill(victim.actor, no_restart=True)
        victim.restart()
        _assert_serving_cast(tr)
        tr.engine._full_bytes = 0  # deltas outweighing the last full publication are folded into it, off the
        publish_after(None)  # publication's path (a background thread)
        tr.engine.folded()
        assert tr.engine._chain == [] and "delta_fallback" not in pub.last
        ray.kill(victim.actor, no_restart=True)
        victim.restart()
        _assert_serving_cast(tr)
        # publications go on during a fold: a delta committed meanwhile stays in the chain, a full publication
        # meanwhile makes the fold moot — an actor born after either is exact
        import hyperrl.rollout.workers.ray_executor as rw

        gate, entered, real = threading.Event(), threading.Event(), rw._from_store

        def held(packed):  # the fold (its own thread) waits here until the test lets it go
            if threading.current_thread().name.startswith("hyperrl-ray-fold"):
                entered.set()
                gate.wait(120)
            return real(packed)

        monkeypatch.setattr(rw, "_from_store", held)
        publish_after(None)  # a delta: the chain outweighs the model → a fold starts and waits
        assert entered.wait(120)
        try:
            publish_after(None)  # committed during the fold
        finally:
            gate.set()  # never a fold left waiting (close would wait for it)
        tr.engine.folded()
        assert [v for v, _ in tr.engine._chain] == [tr.version]  # the fold swapped in only what it had read
        ray.kill(victim.actor, no_restart=True)
        victim.restart()
        _assert_serving_cast(tr)
        gate.clear()
        entered.clear()
        publish_after(None)
        assert entered.wait(120)
        try:
            pub.publish(tr.policy, tr.version + 1)  # a full publication during the fold
            tr.version += 1
            full = tr.engine._weights
        finally:
            gate.set()
        tr.engine.folded()
        assert tr.engine._chain == [] and tr.engine._weights is full  # the fold was moot: dropped
        ray.kill(victim.actor, no_restart=True)
        victim.restart()
        _assert_serving_cast(tr)

        def broken(packed):  # a background fold that fails: said once, the chain kept for a restart to fold
            if threading.current_thread().name.startswith("hyperrl-ray-fold"):
                raise RuntimeError("store unreadable")
            return real(packed)

        monkeypatch.setattr(rw, "_from_store", broken)
        publish_after(None)  # the first delta after a full publication: a full one (the publisher's new base)
        with pytest.warns(RuntimeWarning, match="could not fold its delta chain .*store unreadable"):
            publish_after(None)  # a delta: the fold starts and fails
            tr.engine.folded()
        failed = tr.engine._fold_failed
        publish_after(None)  # the same chain: not folded in the background again
        tr.engine.folded()
        assert len(tr.engine._chain) == 2 and failed is not None and tr.engine._fold_failed == failed
        ray.kill(victim.actor, no_restart=True)
        victim.restart()  # the restart folds the chain itself (in this thread)
        assert tr.engine._chain == []
        _assert_serving_cast(tr)
    finally:
        tr.close()
