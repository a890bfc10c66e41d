"""`mmenc backends`: every encoder-attention backend and every linear backend, whether it can run here,
and the platform's picks."""
import argparse
import json
import shutil
import sys
import textwrap

import torch

from mmenc.backends.device import CPU_FEATURES
from mmenc.backends.linear import QUANTIZATIONS

# --dtype spellings -> dtype; the first three are the canonical names.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "float": torch.float32, "fp16": torch.float16, "half": torch.float16,
          "bf16": torch.bfloat16}
DEFAULT_HEAD_SIZE = 80


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "backends", help="list the encoder-attention backends and the one this platform picks",
        description="List every registered encoder-attention backend: installed (version), usable on this "
                    "device for the given head size and dtype (or why not), offered by the platform, and "
                    "which one the platform picks.")
    parser.add_argument("--head-size", type=int, default=DEFAULT_HEAD_SIZE,
                        help=f"attention head size (default {DEFAULT_HEAD_SIZE})")
    parser.add_argument("--dtype", default=None,
                        help="float32, float16 or bfloat16 (also fp32, fp16, bf16, half); "
                             "default bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                        help="the linear backends for quantized linears (default: unquantized)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                        help="wrap the table's WHY NOT column to fit COLUMNS characters (default: the terminal's "
                             "width when printing to a terminal, no wrapping otherwise; 0: no wrapping)")
    return parser


def resolve_dtype(name: str | None, device_type: str) -> tuple[torch.dtype, str]:
    """(dtype, how it was chosen) for a --dtype value; None picks the platform's default."""
    if name is None:
        if device_type == "cpu":
            return torch.float32, "default on CPU"
        return torch.bfloat16, f"default on {device_type}"
    dtype = DTYPES.get(name.strip().lower())
    if dtype is None:
        raise ValueError(f"--dtype {name!r} is not valid; choose one of {', '.join(DTYPES)}")
    return dtype, "requested"


def report(platform, head_size: int, dtype: torch.dtype) -> dict:
    """The table's content as plain data: platform, the priority list, each backend's row, the pick."""
    priority = platform.vit_attn_priority(dtype)
    rows = platform.explain_vit_attn_backends(head_size, dtype)
    try:
        selected, error = platform.get_vit_attn_backend(head_size, dtype), None
    except ValueError as e:  # nothing can run: the table shows why, and the message says so too
        selected, error = None, str(e)
    if selected is not None:
        skipped = [b.name for b in priority[:priority.index(selected)]]
        why = f"first usable in the {platform.name} priority list for {_name(dtype)}"
        why += f" (passed over: {', '.join(skipped)})" if skipped else ""
    else:
        why = error
    # Per-shape choice: packs whose longest segment is short may run another backend.
    short = platform.get_vit_attn_short_backend(head_size, dtype, selected) if selected is not None else None
    rank = {b: i + 1 for i, b in enumerate(priority)}
    rows = sorted(rows, key=lambda r: (rank.get(r.backend, len(rank) + 1), list(type(r.backend)).index(r.backend)))
    return {
        "platform": platform.name,
        "device": platform.device_info().describe(),
        "head_size": head_size,
        "dtype": _name(dtype),
        "priority": [b.name for b in priority],
        "selected": selected.name if selected is not None else None,
        "why": why,
        "short_priority": [b.name for b in platform.vit_attn_short_priority(dtype)],
        "short_seqlen_max": platform.short_seqlen_max,
        "short_selected": short.name if short is not None else None,
        "backends": [{"name": r.backend.name, "installed": r.installed, "version": r.version,
                      "usable": r.usable, "reasons": list(r.reasons), "offered": r.in_priority,
                      "priority": rank.get(r.backend), "selected": r.backend is selected,
                      "short_selected": r.backend is short} for r in rows],
    }


def linear_report(platform, dtype: torch.dtype, quantization: str | None) -> dict:
    """The linear backends' rows and the platform's pick for `dtype` (quantized as `quantization`)."""
    priority = platform.linear_priority(dtype, quantization)
    try:
        selected, why = platform.get_linear_backend(dtype, quantization), None
    except ValueError as e:
        selected, why = None, str(e)
    if selected is not None:
        skipped = [b.name for b in priority[:priority.index(selected)]]
        why = f"first usable in the {platform.name} priority list for {_name(dtype)}"
        why += f" (passed over: {', '.join(skipped)})" if skipped else ""
    rank = {b: i + 1 for i, b in enumerate(priority)}
    rows = sorted(platform.explain_linear_backends(dtype, quantization),
                  key=lambda r: (rank.get(r.backend, len(rank) + 1), list(type(r.backend)).index(r.backend)))
    info = platform.device_info()
    return {"quantization": quantization, "priority": [b.name for b in priority],
            "selected": selected.name if selected is not None else None, "why": why,
            "cpu_features": sorted(info.features) if info.type == "cpu" else None,
            "backends": [{"name": r.backend.name, "installed": r.installed, "version": r.version, "usable": r.usable,
                          "reasons": list(r.reasons), "offered": r.in_priority, "priority": rank.get(r.backend),
                          "selected": r.backend is selected} for r in rows]}


def run(args: argparse.Namespace) -> int:
    from mmenc.platforms import current_platform

    if args.head_size <= 0:
        raise ValueError(f"--head-size {args.head_size} is not valid; expected a positive integer")
    dtype, dtype_note = resolve_dtype(args.dtype, current_platform.device_type)
    data = report(current_platform, args.head_size, dtype)
    linear = linear_report(current_platform, dtype, args.quantization)
    if args.json:
        print(json.dumps({**data, "dtype_source": dtype_note, "linear": linear}, indent=2))
        return 0 if data["selected"] and linear["selected"] else 1
    print(f"platform: {data['platform']}    device: {data['device']}")
    print(f"head_size: {data['head_size']}    dtype: {data['dtype']} ({dtype_note})")
    print(f"priority for {data['dtype']}: {' > '.join(data['priority']) or '(empty)'}")
    print()
    for line in format_table(_rows(data["backends"]), _table_width(args.width)):
        print(line)
    print()
    if data["selected"]:
        print(f"selected (*): {data['selected']}: {data['why']}")
        if data["short_selected"]:
            print(f"for packs whose longest segment is <= {data['short_seqlen_max']} tokens (+): "
                  f"{data['short_selected']}: first usable in the {data['platform']} short-segment list "
                  f"({' > '.join(data['short_priority'])})")
    else:
        print(f"selected: none: {data['why']}")
    print()
    quantized = f", quantization {linear['quantization']}" if linear["quantization"] else ""
    print(f"linears ({data['dtype']}{quantized}): priority {' > '.join(linear['priority']) or '(empty)'}")
    if linear["cpu_features"] is not None:
        print(f"cpu features: {', '.join(linear['cpu_features']) or 'none of ' + ', '.join(CPU_FEATURES)}")
    print()
    for line in format_table(_rows(linear["backends"]), _table_width(args.width)):
        print(line)
    print()
    print(f"selected (*): {linear['selected']}: {linear['why']}" if linear["selected"]
          else f"selected: none: {linear['why']}")
    return 0 if data["selected"] and linear["selected"] else 1


def _rows(backends: list[dict]) -> list[tuple[str, ...]]:
    """The table of one kind of backend: header, then one row each."""
    table = [("", "BACKEND", "INSTALLED", "USABLE", "OFFERED", "PRIORITY", "WHY NOT")]
    for row in backends:
        installed = f"yes ({row['version']})" if row["installed"] and row["version"] else (
            "yes" if row["installed"] else "no")
        mark = "*" if row["selected"] else "+" if row.get("short_selected") else ""
        table.append((mark, row["name"], installed, "yes" if row["usable"] else "no",
                      "yes" if row["offered"] else "no", str(row["priority"] or "-"), "; ".join(row["reasons"])))
    return table


def _table_width(requested: int | None) -> int | None:
    """Characters a table line may use: --width, else the terminal's width on a terminal, else None."""
    if requested is not None:
        if requested < 0:
            raise ValueError(f"--width {requested} is not valid; expected a number of columns, or 0 for no limit")
        return requested or None
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def format_table(table: list[tuple[str, ...]], width: int | None, min_last: int = 24) -> list[str]:
    """Rows padded into columns; the last (free text) column is wrapped to fit `width` characters,
    continuation lines indented under it (or under the row, by 6, when fewer than `min_last` remain)."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]) - 1)]
    start = sum(widths) + 2 * len(widths)
    lines = []
    for r in table:
        head = "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  "
        if width is None or len(head) + len(r[-1]) <= width:
            lines.append((head + r[-1]).rstrip())
            continue
        indent = start if width - start >= min_last else 6
        wrapped = textwrap.wrap(r[-1], max(width - indent, 8), break_on_hyphens=False) or [""]
        if indent == start:
            lines.append((head + wrapped[0]).rstrip())
            wrapped = wrapped[1:]
        else:
            lines.append(head.rstrip())
        lines += [" " * indent + piece for piece in wrapped]
    return lines


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
