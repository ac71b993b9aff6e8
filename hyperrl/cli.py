"""``hyperrl`` command line: ``hyperrl train`` (the main job), ``hyperrl config``, ``hyperrl plan``,
``hyperrl export``, ``hyperrl demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyperrl", description=__doc__)
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
    args, rest = parser.parse_known_args(argv)
    if args.command == "export":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from hyperrl.export import ExportError, export_hf

        try:
            print(f"exported {args.checkpoint} → {export_hf(args.checkpoint, args.out_dir)}")
        except (ExportError, FileNotFoundError) as e:
            print(f"hyperrl export: {e}", file=sys.stderr)
            return 2
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


def _config(args, overrides: list[str]) -> int:
    import json

    from hyperrl.config import ConfigError, describe, load_config

    try:
        if args.config or overrides:
            print(json.dumps(load_config(args.config, overrides).to_dict(), indent=1))
        else:
            print(describe())
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    return 0


def _train(args, overrides: list[str]) -> int:
    from hyperrl.config import ConfigError, load_config
    from hyperrl.run import train

    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    summary = train(cfg, resume=not args.no_resume)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    print(f"done: {summary['steps']} steps in {summary['seconds']:.0f} s, held-out "
          f"{summary['final_eval']}, outputs in {summary['out_dir']}/ (metrics.jsonl, reward_curve.png, "
          f"checkpoints/{', hf/' if summary.get('export') else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
