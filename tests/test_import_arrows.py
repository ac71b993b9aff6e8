"""The import arrows: the package's layers, lowest first, and no import cycle.

Read from every import statement of every module (function-level imports included; relative
imports resolved), so a cycle hidden behind a function-level import is still one. The layer order
is stated once, here (docs/trainer.md draws it):

   -1 errors        HyperRLError, the one exception base every layer raises from
    0 foundations   trajectory, registry, sampling, device, tokenizer, routing, multimodal, sandbox
    1 kernels       transforms, sharding
    2 rewards
    3 inputs        envs, data
    4 runtime       rollout, models, distributed, algorithms (key providers and loss terms)
    5 agents        the OpenAI-compatible gateway, agent programs, MCP tools
    6 config
    7 loop
    8 the root      compose (the composition root: build), run (the outer loop: train), cli, export, diff, demo,
                    the facade

A module may import its own package and any package of a lower layer — never a higher one, nor a
package beside it in its layer.
"""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).parents[1] / "hyperrl"

LAYERS = [
    ("errors",),
    ("trajectory", "registry", "sampling", "device", "allocator", "tokenizer", "routing", "multimodal", "sandbox"),
    ("transforms", "sharding"),
    ("rewards",),
    ("envs", "data"),
    ("rollout", "models", "distributed", "algorithms"),
    ("agents",),
    ("config",),
    ("loop",),
    ("",),  # the root: compose (the composition root), run, cli, export, diff, demo and the facade hyperrl/__init__.py
]
FOUNDATIONS = (*LAYERS[0], *LAYERS[1])
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
LOOP = tuple(f"hyperrl.{n}" for names in LAYERS[5:] for n in names if n)


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The ``hyperrl`` modules ``path`` imports — each import resolved to the deepest module it
    names (``from hyperrl import transforms`` → ``hyperrl.transforms``; ``from hyperrl.loop.trainer
    import Trainer`` → ``hyperrl.loop.trainer``)."""
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
            for a in node.names:
                out.add(f"{name}.{a.name}" if f"{name}.{a.name}" in MODULES else name)
    return {i for i in out if i in MODULES}


GRAPH = {m: _imports(p) - {m} for m, p in MODULES.items()}


def _top(mod: str) -> str:
    """The unit a module belongs to: its package, a foundation module itself, or "" — the root layer."""
    parts = mod.split(".")
    name = parts[1] if len(parts) > 1 else ""
    return name if name in LAYER_OF else ""


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (as the list of its modules), or None. Iterative DFS with colours."""
    colour = dict.fromkeys(graph, 0)
    for root in sorted(graph):
        if colour[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path, colour[root] = [root], 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt) == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    return None


ROOT = {"hyperrl", "hyperrl.compose", "hyperrl.run", "hyperrl.cli", "hyperrl.export", "hyperrl.demo", "hyperrl.diff"}


def test_every_module_has_a_layer():
    # a package or module not in LAYERS would silently join the root layer: name it there instead
    assert {m for m in MODULES if _top(m) == ""} == ROOT, "a new package needs a place in LAYERS (and docs/trainer.md)"


def test_the_import_graph_has_no_cycle():
    # package facades (``__init__``) re-export their own modules; an edge into a facade stands for the modules
    # it re-exports, so facades are kept in the graph: a module importing its own package's facade is a cycle
    assert _cycle(GRAPH) is None, f"import cycle: {' -> '.join(_cycle(GRAPH))}"


def test_each_package_imports_only_the_layers_below_it():
    bad = sorted((m, i) for m, deps in GRAPH.items() for i in deps
                 if _top(i) != _top(m) and LAYER_OF[_top(i)] >= LAYER_OF[_top(m)])
    assert bad == [], f"imports that go up or sideways: {bad}"


def test_the_checker_can_fail():
    # the cycle finder finds a planted cycle, the layer rule catches an upward import, and the walker sees
    # function-level and relative imports
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert LAYER_OF["loop"] > LAYER_OF["config"] > LAYER_OF["rollout"] > LAYER_OF["transforms"]
    assert "hyperrl.loop.trainer" in _imports(PKG / "compose.py")
    assert "hyperrl.envs" in _imports(PKG / "loop" / "generation.py")  # a function-level import


def test_the_trainer_imports_no_torch_distributed():
    path = PKG / "loop" / "trainer.py"
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(i.startswith("torch.distributed") for i in names)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "distributed" not in attrs and "all_reduce" not in attrs  # nor reaches it through torch.
    assert not {"hasattr", "getattr"} & calls  # capabilities are declared, not probed


def test_the_loop_probes_no_engine_capability():
    """Engines declare what they can do (``engine.capabilities``); no caller probes an attribute."""
    probes = []
    for m, p in MODULES.items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr") \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value in (
                        "accepts_lora", "keyed", "resumable", "shared", "buffers", "hold", "capabilities"):
                probes.append((m, n.args[1].value))
    assert probes == []


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


def test_no_private_name_is_imported_across_packages():
    """A module may use its own package's ``_private`` helpers, never another package's: what another package
    needs is public (in ``__all__``, documented)."""
    crossing = []
    for m, p in MODULES.items():
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("hyperrl") and not n.level:
                crossing += [f"{m} ← {n.module}.{a.name}" for a in n.names
                             if a.name.startswith("_") and _top(n.module) != _top(m)]
    assert crossing == []


# attributes of other libraries' objects the loop may read when present (a Hugging Face model's ``config`` /
# ``generation_config``, a transformers KV cache's ``layers`` / ``keys`` / ``values``) and the config's ``async``
# section (a Python keyword: read with getattr) — never an attribute of one of hyperrl's plug-ins
_FOREIGN = {"config", "generation_config", "eos_token_id", "max_position_embeddings", "layers", "keys", "values",
            "async"}


def test_the_loop_and_the_composition_root_probe_no_plugin():
    """A plug-in's capability is declared where it registers (an engine's, environment's, task's record) and read
    from there; ``loop/`` and ``compose.py`` never ask a hyperrl object whether it has an attribute."""
    probes = []
    for m, p in MODULES.items():
        if not (m.startswith("hyperrl.loop") or m == "hyperrl.compose"):
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr") \
                    and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and n.args[1].value not in _FOREIGN:
                probes.append(f"{m}:{n.lineno} {n.func.id}(…, {n.args[1].value!r})")
    assert probes == []
