"""Replicas of tensor-parallel vLLM engines: tests/vllm/check_vllm_ray.py with each of the 2 Ray actors running a
vLLM TP 2 engine (each worker receiving only its shards of every publication). Two engines × two TP workers on this
2-core machine share the cores knowingly (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` for every engine, set before Ray
starts so the actors inherit it); the same guarantees are reported: every sample trained once within η, a killed
actor born again at the current version, every actor serving the learner's weights."""

import json
import os
import sys
from pathlib import Path


def run() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import check_vllm_ray

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        out = check_vllm_ray.run("{name: vllm, tp: 2, enforce_eager: true}")
    finally:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(run()))
    sys.stdout.flush()
