"""`mmenc` command line (also `python -m mmenc`): one subcommand per module (backends, encode, bench)."""
import argparse
import importlib
import sys

# subcommand -> module under mmenc.cli providing add_parser(subparsers) and run(args) -> int
SUBCOMMANDS = {"backends": "backends", "encode": "encode", "bench": "bench", "serve": "serve"}


def build_parser() -> argparse.ArgumentParser:
    from mmenc import __version__

    parser = argparse.ArgumentParser(prog="mmenc", description="Run the vision encoders of VLMs, fast.")
    parser.add_argument("--version", action="version", version=f"mmenc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(f"mmenc.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"mmenc.cli.{module}":
                raise
            continue
        mod.add_parser(sub).set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"mmenc {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # `encode` saves its partial results itself; the others have nothing to keep
        from mmenc.cli.signals import describe, exit_code

        print(f"mmenc {args.command}: {describe(e)}", file=sys.stderr)
        return exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
