"""Command-line flags made from the typed settings (mmenc.engine.settings.EncoderSettings): each field
that names a command becomes one flag of it, and docs/cli.md's flag table is rendered from the same
fields (`python -m mmenc.cli.flags` prints it; tests/test_cli_flags.py compares).
"""
import argparse
import dataclasses
import types

from mmenc.engine.settings import COMMANDS, EncoderSettings, flag_fields, flag_name


def _value_type(field: dataclasses.Field):
    """int, float or str: what argparse converts a flag's text to (settings validate the value)."""
    kinds = set(field.type.__args__) if isinstance(field.type, types.UnionType) else {field.type}
    for kind in (int, float):
        if kind in kinds:
            return kind
    return str


def _help(field: dataclasses.Field, command: str) -> str:
    meta = field.metadata
    text = meta["scope"].get(command, "") + meta["help"]
    if meta["shown_default"] is not None:
        return f"{text} (default: {meta['shown_default']})"
    if isinstance(field.default, bool) or field.default is None:
        return text
    default = ",".join(field.default) if isinstance(field.default, tuple) else field.default
    return f"{text} (default: {default})"


def add_settings_flags(parser, command: str, settings_cls: type = EncoderSettings) -> None:
    """The flags of `command` ("encode", "bench", "serve") made from `settings_cls`' fields (a parser or an
    argument group)."""
    if command not in COMMANDS:
        raise ValueError(f"command={command!r}; expected one of {COMMANDS}")
    for field in flag_fields(command, settings_cls):
        meta = field.metadata
        kwargs = dict(dest=field.name, default=field.default, help=_help(field, command).replace("%", "%%"))
        if isinstance(field.default, bool):
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=str if meta["text"] else _value_type(field), metavar=meta["metavar"])
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
        parser.add_argument(flag_name(field), **kwargs)


def settings_from_args(args: argparse.Namespace, settings_cls: type = EncoderSettings):
    """`settings_cls` (EncoderSettings, ServeSettings) from parsed flags (ValueError naming a bad value): the
    flags of `args.command`; for a parser of its own (no subcommand), those of "serve"."""
    command = getattr(args, "command", None)
    fields = flag_fields(command if command in COMMANDS else "serve", settings_cls)
    return settings_cls(**{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)})


TABLE_START, TABLE_END = "<!-- settings flags: python -m mmenc.cli.flags -->", "<!-- end of settings flags -->"
SERVE_START, SERVE_END = "<!-- serve flags: python -m mmenc.cli.flags serve -->", "<!-- end of serve flags -->"


def flag_table(settings_cls: type = EncoderSettings) -> str:
    """docs/cli.md's table of `settings_cls`' flags: flag, which commands take it, meaning (with the default)."""
    rows = ["| flag | commands | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(settings_cls):
        commands = field.metadata.get("commands", ())
        if not commands:
            continue
        name = flag_name(field)
        value = "" if isinstance(field.default, bool) else " " + (field.metadata["metavar"] or (
            "|".join(field.metadata["choices"]) if field.metadata["choices"] else field.name.split("_")[-1].upper()))
        meaning = _help(field, "").replace("|", "\\|")
        rows.append(f"| `{name}{value.replace('|', chr(92) + '|')}` | {', '.join(commands)} | {meaning} |")
    return "\n".join(rows)


def serve_table() -> str:
    from mmenc.serving.settings import ServeSettings

    return flag_table(ServeSettings)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["serve"]:
        print(SERVE_START, serve_table(), SERVE_END, sep="\n")
    else:
        print(TABLE_START, flag_table(), TABLE_END, sep="\n")
