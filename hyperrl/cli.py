"""``hyperrl`` command line: ``hyperrl train`` (the main job), ``hyperrl config``, ``hyperrl plan``,
``hyperrl export``, ``hyperrl diff``, ``hyperrl doctor``, ``hyperrl trace``, ``hyperrl demo``."""

from __future__ import annotations

import argparse
import sys


def _known_errors() -> dict[type, tuple[str, int]]:
    """Error type → (its one-word label, exit code): 2 for what the user can fix (config, data,
    tokenizer, reward, checkpoint, export, evaluation, planner input), 1 for a failure at run time
    (a rollout worker, a publication, every agent episode of a round failing, an MCP server)."""
    from hyperrl.agents import AgentError
    from hyperrl.agents.mcp import MCPError
    from hyperrl.config import ConfigError
    from hyperrl.data import DataError
    from hyperrl.diff import DiffError
    from hyperrl.export import ExportError
    from hyperrl.loop.checkpoint import CheckpointError
    from hyperrl.loop.doctor import DoctorError
    from hyperrl.loop.evaluate import EvaluationError
    from hyperrl.loop.prepare import GateError
    from hyperrl.registry import HyperparameterError
    from hyperrl.rewards import RewardError
    from hyperrl.rollout.base import WeightPublishError
    from hyperrl.rollout.workers.base import WorkerError
    from hyperrl.sharding.layout import LayoutError
    from hyperrl.sharding.mesh import MeshError
    from hyperrl.sharding.spec import SpecError
    from hyperrl.tokenizer import TokenizerError

    return {ConfigError: ("config error", 2), HyperparameterError: ("config error", 2), DataError: ("data error", 2),
            TokenizerError: ("tokenizer error", 2), RewardError: ("reward error", 2),
            CheckpointError: ("checkpoint error", 2), ExportError: ("export error", 2),
            EvaluationError: ("evaluation error", 2), GateError: ("gate error", 2), LayoutError: ("plan error", 2),
            MeshError: ("plan error", 2), SpecError: ("plan error", 2), WorkerError: ("rollout worker error", 1),
            WeightPublishError: ("publication error", 1), AgentError: ("agent error", 1), MCPError: ("mcp error", 1),
            DiffError: ("diff error", 2), DoctorError: ("doctor error", 2)}


def main(argv: list[str] | None = None) -> int:
    """Run a command. A known error (config, data, tokenizer, reward, checkpoint, export,
    evaluation, planner input) prints one line naming the key / file / row / step and the fix, and
    exits 2 (1 for a rollout worker's or a publication's failure); ``--debug`` or
    ``HYPERRL_DEBUG=1`` shows the traceback instead. Anything else is a crash: its traceback, exit 1."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("HYPERRL_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    try:
        return _main(argv)
    except SystemExit as e:  # argparse and the planner's input checks: a message, exit 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except Exception as e:
        if debug:
            raise
        known = next((v for t, v in _known_errors().items() if isinstance(e, t)), None)
        if known is None:
            raise
        label, code = known
        msg = str(e).strip().replace("\n", " ")
        print(f"{label}: {msg}\n(the traceback: rerun with --debug or HYPERRL_DEBUG=1)", file=sys.stderr)
        return code


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hyperrl", description=__doc__,
                                     epilog="--debug (or HYPERRL_DEBUG=1): show the traceback of an error")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="build GRPO/DAPO/GSPO losses on a synthetic batch and time group advantages")
    from hyperrl.sharding import cli as plan_cli

    plan_cli.add_parser(sub)
    cf = sub.add_parser("config", help="list every config key with its default and doc, every registered variant "
                        "with its hyperparameters, and every recipe (with --config/overrides: the resolved config)")
    cf.add_argument("--config", help="YAML config to resolve")
    tr = sub.add_parser("train", help="train with RL (no arguments: the embedded CPU default that learns); "
                        "`hyperrl config` lists every key")
    tr.add_argument("--config", help="YAML config; dotted overrides follow, e.g. --algo.objective=gspo")
    tr.add_argument("--no-resume", action="store_true", help="start fresh even if out_dir has checkpoints")
    ex = sub.add_parser("export", help="a checkpoint → a Hugging Face model directory (save_pretrained + tokenizer) "
                        "that transformers and vLLM load")
    ex.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/default/checkpoints/step_1000")
    ex.add_argument("out_dir", help="where to write the model directory")
    ex.add_argument("--adapters", action="store_true", help="a LoRA run: write only the adapters (PEFT's "
                    "adapter_model.safetensors + adapter_config.json, which PEFT and vLLM's LoRA load) and the "
                    "tokenizer, not merged weights")
    df = sub.add_parser("diff", help="where two runs part: configs, package versions, then the first step and stage "
                        "whose fingerprints differ, drilled down to rows, tokens and weight tensors")
    df.add_argument("run_a", help="a run directory (run.out_dir)")
    df.add_argument("run_b", help="another run directory")
    df.add_argument("--step", type=int, help="compare this step only")
    df.add_argument("--json", action="store_true", help="print the diff as JSON")
    tc = sub.add_parser("trace", help="a run's timeline (each step's stages, each rollout worker's calls, versions, "
                        "evictions) as a Chrome / Perfetto trace")
    tc.add_argument("run", help="a run directory (run.out_dir)")
    tc.add_argument("--out", help="where to write it (default: RUN/trace.json)")
    dr = sub.add_parser("doctor", help="why the trainer's and the engine's log-probs disagree: a recorded batch "
                        "re-scored under each known cause, ranked by how much of the gap it closes")
    dr.add_argument("run", help="a run directory (run.out_dir)")
    dr.add_argument("--step", type=int, help="the step whose kept rows to examine (default: the last one the "
                    "doctor has weights for)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from hyperrl.loop.doctor import doctor_run

        d, step = doctor_run(args.run, args.step)
        print(f"step {step}: {d.verdict()}\n{d.table()}")
        return 0
    if args.command == "trace":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _trace(args)
    if args.command == "diff":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return _diff(args)
    if args.command == "export":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from hyperrl.export import export_hf

        print(f"exported {args.checkpoint} → {export_hf(args.checkpoint, args.out_dir, adapters=args.adapters)}")
        return 0
    if args.command == "plan":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return plan_cli.run(args)
    if args.command == "train":
        return _train(args, rest)
    if args.command == "config":
        return _config(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in (None, "demo"):
        from hyperrl.demo import main as demo

        demo()
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


def _diff(args) -> int:
    """``hyperrl diff``: the report (or ``--json``); exit 0 when the runs agree in every step both reached, 1 when
    they part."""
    import json

    from hyperrl.diff import diff_runs, format_diff

    d = diff_runs(args.run_a, args.run_b, step=args.step)
    print(json.dumps(d.to_dict(), indent=1) if args.json else format_diff(d))
    return 0 if d.step is None and not d.events else 1


def _trace(args) -> int:
    """``hyperrl trace``: write the run's timeline as a trace file and say where and what it holds."""
    import json
    from pathlib import Path

    from hyperrl.loop.timeline import chrome_trace, read_timeline

    try:
        records = read_timeline(args.run)
    except FileNotFoundError as e:
        raise SystemExit(f"trace error: {e}") from None
    trace = chrome_trace(records)
    out = Path(args.out or Path(args.run) / "trace.json")
    out.write_text(json.dumps(trace))
    steps = {r["step"] for r in records if "spans" in r}
    calls = sum(1 for e in trace["traceEvents"] if e.get("pid") == 2 and e.get("ph") == "X")
    print(f"{out}: {len(steps)} steps, {calls} rollout worker calls — open it in https://ui.perfetto.dev or "
          "chrome://tracing")
    return 0


def _config(args, overrides: list[str]) -> int:
    import json

    from hyperrl.config import describe, load_config

    if args.config or overrides:
        print(json.dumps(load_config(args.config, overrides).to_dict(), indent=1))
    else:
        print(describe())
    return 0


def _train(args, overrides: list[str]) -> int:
    from hyperrl.config import load_config
    from hyperrl.run import train

    cfg = load_config(args.config, overrides)
    summary = train(cfg, resume=not args.no_resume)
    import torch.distributed as dist

    if summary.get("interrupted"):
        import signal

        code = 128 + int(getattr(signal, summary["interrupted"]))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"interrupted ({summary['interrupted']}) at step {summary['steps']}: checkpoint "
                  f"{summary['checkpoint']} — rerun the same command to resume", file=sys.stderr)
        return code
    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    print(f"done: {summary['steps']} steps in {summary['seconds']:.0f} s, held-out "
          f"{summary['final_eval']}, outputs in {summary['out_dir']}/ (metrics.jsonl, reward_curve.png, "
          f"checkpoints/{', hf/' if summary.get('export') else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
