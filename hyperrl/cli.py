"""``hyperrl`` command line: ``hyperrl demo`` and ``hyperrl plan`` (``train`` arrives with the trainer)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hyperrl", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="build GRPO/DAPO/GSPO losses on a synthetic batch and time group advantages")
    from .sharding import cli as plan_cli

    plan_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_cli.run(args)
    if args.command in (None, "demo"):
        from .demo import main as demo

        demo()
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
