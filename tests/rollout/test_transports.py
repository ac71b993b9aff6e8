"""The vLLM engine's transport registry without vLLM: names, the CPU refusals, and vLLM's native
transports' source (:class:`~hyperrl.rollout.transports.StagedSource`) — a fused engine parameter
sent as its checkpoint tensors, views of it (no copy), in one replayable order."""

import pytest
import torch

from hyperrl.rollout.transports import TRANSPORTS, StagedSource, transport_class


def test_registry_names_every_transport_and_refuses_an_unknown_one():
    assert TRANSPORTS.names() == ["cuda_ipc", "file", "shm", "vllm_ipc", "vllm_nccl"]
    with pytest.raises(ValueError, match=r"transport='pigeon': one of cuda_ipc, file, shm, vllm_ipc, vllm_nccl"):
        transport_class("pigeon")
    assert [transport_class(n).native for n in TRANSPORTS.names()] == [False, False, False, True, True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a CPU-only torch")
@pytest.mark.parametrize("name", ["cuda_ipc", "vllm_ipc", "vllm_nccl"])
def test_gpu_transports_are_refused_on_a_cpu_only_torch_naming_the_fix(name):
    with pytest.raises(ValueError, match=rf"transport={name}: .*CUDA GPU .*use transport=shm on CPU"):
        transport_class(name).check_available()
    transport_class("shm").check_available()  # hyperrl's own run anywhere


def test_staged_source_sends_a_fused_parameter_as_its_checkpoint_tensors():
    # qkv_proj [q 4 rows; k 2; v 2] × 3 columns, as the engine's views say: (name, element offset, shape)
    qkv = torch.arange(24.0).reshape(8, 3)
    norm = torch.ones(3)
    views = {"qkv_proj.weight": [("q_proj.weight", 0, (4, 3)), ("k_proj.weight", 12, (2, 3)),
                                 ("v_proj.weight", 18, (2, 3))]}
    src = StagedSource(lambda name, t: views.get(name) or [(name, 0, tuple(t.shape))])
    src.set({"qkv_proj.weight": qkv, "norm.weight": norm})
    sent = list(src)
    assert [n for n, _ in sent] == ["q_proj.weight", "k_proj.weight", "v_proj.weight", "norm.weight"]
    assert torch.equal(sent[0][1], qkv[:4]) and torch.equal(sent[1][1], qkv[4:6]) and torch.equal(sent[2][1], qkv[6:])
    assert sent[0][1].data_ptr() == qkv.data_ptr() and sent[1][1].data_ptr() == qkv.data_ptr() + 12 * 4
    assert [n for n, _ in src] == [n for n, _ in sent]  # replayable: vLLM's engines iterate it every round
    assert [g for g, _ in src.iter_groups()] == [[n] for n, _ in sent]
