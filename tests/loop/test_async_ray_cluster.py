"""The AsyncTrainer over a multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head and worker
raylets on this machine, one CPU each): the rollout workers spread over the nodes, every
publication reaches both, and when a whole node is lost its worker is restarted on a replacement
node serving the current version — nothing lost, nothing trained twice."""

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from hyperrl.compose import build_trainer
from hyperrl.config import load_config
from hyperrl.loop.trainer import AsyncTrainer

# one Ray instance at a time (README: --dist loadgroup)
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def nodes():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


class _Recording(AsyncTrainer):
    def collect(self, timer):
        got = super().collect(timer)
        batch = got.batch
        self.trained = getattr(self, "trained", []) + batch["sample_uid"].tolist()
        return got


def test_workers_span_the_nodes_and_survive_the_loss_of_one(nodes, tmp_path):
    cfg = load_config(None, ["--task=modsum", "--rollout.max_new_tokens=16", f"--run.out_dir={tmp_path}",
                             "--run.eval_every=0", "--rollout.prompts_per_step=4", "--rollout.n=4", "--run.threads=1",
                             "--async.max_staleness=1", "--async.executor={name: ray, workers: 2, num_cpus: 1}"])
    tr = build_trainer(cfg, trainer=_Recording, max_staleness=1)
    try:
        where = {w.name: w.info()["node"] for w in tr.collector.workers}
        assert len(set(where.values())) == 2  # one worker per node
        for _ in range(3):
            tr.step()
        head = ray.get_runtime_context().get_node_id()
        (lost,) = [n for n in nodes.worker_nodes]
        victim = next(w for w in tr.collector.workers if where[w.name] != head)
        nodes.remove_node(lost)  # the raylet and the actor on it are gone
        nodes.add_node(num_cpus=1)  # a replacement machine joins
        for _ in range(4):
            m = tr.step()
        assert victim.restarts == 1 and m["async_restarts"] == 1
        assert victim.info()["node"] not in (head, where[victim.name])  # restarted on the new node
        want = tr.policy.state_dict()
        for w in tr.collector.workers:
            got = ray.get(w.actor.__ray_call__.remote(lambda a: a.engine.state_dict()))
            assert w.info()["version"] == tr.version == 7 and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        tr.close()
    assert len(tr.trained) == len(set(tr.trained)) == 7 * 4 * 4
