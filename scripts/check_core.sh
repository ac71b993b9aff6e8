#!/usr/bin/env bash
# The core install (`pip install hyperrl` with no extras) beside someone else's stack: a venv holding
# only the core dependencies, at the lowest versions pyproject.toml admits (torch 2.13.0 is the only
# CPU torch on disk), imports and runs the transforms, the trajectory contract and the planner —
# their tests, plus a plan from the command line. No transformers, pyarrow, yaml, matplotlib.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${CORE_VENV:-.venv-core}
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0 "tensordict==0.10.0" "numpy==1.26.4" "pydantic==2.6.0" pytest hypothesis
"$venv/bin/pip" install -q --no-deps -e .
for mod in transformers pyarrow yaml matplotlib jsonschema peft; do
  if "$venv/bin/python" -c "import $mod" 2>/dev/null; then echo "check_core: $mod is importable in the core venv" >&2; exit 1; fi
done
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/transforms/test_advantages.py tests/transforms/test_aggregation.py \
  tests/transforms/test_batching.py tests/transforms/test_kl.py tests/transforms/test_logprobs.py tests/transforms/test_misc_transforms.py tests/transforms/test_objectives.py \
  tests/foundations/test_trajectory.py tests/loop/test_async_pieces.py tests/sharding/test_sharding_algebra.py tests/sharding/test_sharding_plan.py
"$venv/bin/hyperrl" plan --model qwen3-4b --trainer fsdp=8 --rollout tp=2,dp=4 | tail -3
