"""The import arrows: transforms and sharding import nothing from the loop; envs and rollout do not
import each other; the trainer imports no torch.distributed. Read from every import statement of
every module (function-level imports included), and checked at run time in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).parents[1] / "hyperrl"
LOOP = ("hyperrl.trainer", "hyperrl.train", "hyperrl.learner", "hyperrl.parallel", "hyperrl.checkpointer",
        "hyperrl.recipes", "hyperrl.config", "hyperrl.cli", "hyperrl.tasks", "hyperrl.rollout", "hyperrl.envs",
        "hyperrl.data", "hyperrl.forward")


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return out


def _files(sub: str):
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).is_dir() else [PKG / f"{sub}.py"]


def _hits(files, forbidden) -> list:
    return [(f.name, i) for f in files for i in sorted(_imports(f)) if i.startswith(forbidden)]


@pytest.mark.parametrize("sub", ["transforms", "sharding", "trajectory", "registry", "sampling"])
def test_core_imports_nothing_from_the_loop(sub):
    assert _hits(_files(sub), LOOP) == []


def test_envs_and_rollout_do_not_import_each_other():
    assert _hits(_files("envs"), ("hyperrl.rollout",)) == []
    assert _hits(_files("rollout"), ("hyperrl.envs",)) == []


def test_the_trainer_imports_no_torch_distributed():
    assert [i for i in _imports(PKG / "trainer.py") if i.startswith("torch.distributed")] == []
    tree = ast.parse((PKG / "trainer.py").read_text())
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "distributed" not in attrs and "all_reduce" not in attrs  # nor reaches it through torch.
    assert "hasattr" not in calls  # no DTensor probing


def test_the_import_walker_sees_function_level_and_relative_imports(tmp_path):
    # the checker itself must be able to fail
    assert "hyperrl.trainer" in _imports(PKG / "train.py")
    assert "hyperrl.sharding.execute" in _imports(PKG / "sharding" / "publisher.py")


def test_core_loads_without_the_loop_at_run_time():
    code = ("import sys, hyperrl.transforms, hyperrl.sharding, hyperrl.trajectory; "
            f"bad = [m for m in sys.modules if m.startswith({LOOP!r})]; print(bad); assert not bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


_TRAIN_ONLY = ("transformers", "tokenizers", "pyarrow", "yaml", "matplotlib", "jsonschema", "peft", "safetensors",
               "tqdm")


def test_core_runs_with_the_training_packages_unimportable():
    """The core extra's promise (pyproject: torch, tensordict, numpy, pydantic only): with every
    training-only package made unimportable, a GRPO loss is built from the registry and a
    reshard plan is made. (scripts/check_core.sh proves the same in a venv holding only the core.)"""
    code = f"""
import sys
for name in {_TRAIN_ONLY!r}:
    sys.modules[name] = None  # `import name` now raises ImportError, find_spec says absent
import torch, hyperrl.transforms as T
from hyperrl.sharding.models import MODELS, trainer_layout
from hyperrl.sharding.vllm import rollout_layout
from hyperrl.sharding import reshard_plan
from tests.conftest import random_batch
b = T.compute_advantages(random_batch(), "grpo")
out = T.policy_loss(b, b["rollout_logprobs"], objective="ppo_clip", agg="token-mean", clip_low=0.2, clip_high=0.28)
m = MODELS["qwen3-tiny"]
plan = reshard_plan(trainer_layout(m, fsdp=2), rollout_layout(m, tp=2))
assert torch.isfinite(out.loss) and plan.stats().wire_bytes > 0
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PKG.parent)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
