"""``engram tables write``: every Engram layer's row file for the disk tier, written ahead of time.

``engram tables write CHECKPOINT --directory DIR [--layers ID ...] [--no-value-scan] [--json]`` writes the
row file of each layer's table (:func:`engram.table.disk.ensure_row_file`: packed rows in 4 KiB pages,
named after the checkpoint's fingerprint), reusing a valid file of the same rows and continuing an
interrupted write. Exit codes: 0 every file is there; 1 the work ran and found a problem (a
checkpoint whose config or tensors fail the loader's checks, a NaN byte in a table, a write that
failed); 2 bad input, checked before any byte is written (CHECKPOINT not a directory, DIR not a
writable directory or without room for the files still to write, a layer id the checkpoint lacks).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engram.tools.outputs import CommandFailed

__all__ = ["add_tables_parser", "command_tables_write"]


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _checked_inputs(args: argparse.Namespace):
    """``(checkpoint, layout, layer indices, directory)`` or ValueError (bad input, exit 2); a checkpoint
    whose content fails its checks is CommandFailed (exit 1)."""
    from engram.checkpoint import SafetensorsCheckpoint
    from engram.layout import EngramLayout
    from engram.spec import EngramSpec
    from engram.table.host_memory.shm_files import check_directory

    if not Path(args.checkpoint).is_dir():
        found = "a file" if Path(args.checkpoint).exists() else "nothing"
        raise ValueError(f"CHECKPOINT: expected a checkpoint directory (config.json, *.safetensors), found {found} at "
                         f"{args.checkpoint!r}")
    try:
        directory = check_directory(args.directory)
    except ValueError as error:
        raise ValueError(f"--{error}") from None   # "--directory: ..."
    try:
        spec = EngramSpec.from_hf_config(args.checkpoint)
        layout = EngramLayout(spec)
        checkpoint = SafetensorsCheckpoint(args.checkpoint)
    except ValueError as error:
        raise CommandFailed(f"checkpoint {args.checkpoint}: {error}") from None
    if args.layers:
        unknown = [layer for layer in args.layers if layer not in spec.layer_ids]
        if unknown:
            raise ValueError(f"--layers: {unknown} are not Engram layers of this checkpoint (its layers: "
                             f"{list(spec.layer_ids)})")
        indices = [spec.layer_ids.index(layer) for layer in dict.fromkeys(args.layers)]
    else:
        indices = list(range(spec.num_layers))
    return checkpoint, layout, indices, directory


def command_tables_write(args: argparse.Namespace, console: Console) -> int:
    from engram.table.disk.row_file import RowFileLayout, open_row_file
    from engram.table.disk.writing import (DISK_ROOM_ADVICE, layer_table_source, row_file_path, source_fingerprint,
                                           write_row_file)
    from engram.table.host_memory.shm_files import check_room

    checkpoint, layout, indices, directory = _checked_inputs(args)
    try:
        sources = [layer_table_source(checkpoint, layout, index, check_values=not args.no_value_scan)
                   for index in indices]
    except ValueError as error:   # a tensor of the wrong dtype or shape, a missing file
        raise CommandFailed(f"checkpoint {args.checkpoint}: {error}") from None
    # Which files are there already (valid), and room for the others, before any byte is written.
    plans, needed = [], 0
    for index, source in zip(indices, sources):
        fingerprint = source_fingerprint(source)
        path = row_file_path(source, directory, fingerprint)
        row_layout = RowFileLayout(source.num_rows, source.head_dim)
        try:
            open_row_file(path, fingerprint, source.num_rows, source.head_dim)
            reused = True
        except ValueError:
            reused = False
            temporary = path.with_name(path.name + ".tmp")
            on_disk = temporary.stat().st_blocks * 512 if temporary.exists() else 0
            needed += max(0, row_layout.file_bytes - on_disk)
        plans.append((layout.spec.layer_ids[index], source, path, row_layout, reused))
    if needed:
        check_room(directory, needed, "the row files still to write", DISK_ROOM_ADVICE)
    results = []
    for layer_id, source, path, row_layout, reused in plans:
        started = time.perf_counter()
        if not reused:
            try:
                path = write_row_file(source, directory, progress=not args.json)
            except ValueError as error:   # a NaN byte, another process writing it
                raise CommandFailed(f"{source.description}: {error}") from None
        results.append({"layer": layer_id, "path": str(path), "rows": source.num_rows,
                        "bytes": row_layout.file_bytes, "reused": reused,
                        "seconds": round(time.perf_counter() - started, 3)})
    if args.json:
        print(json.dumps(results))
        return 0
    table = Table(title=f"row files in {escape(str(directory))}")
    for column in ("layer", "rows", "size", "file", "state"):
        table.add_column(column, justify="right" if column in ("layer", "rows", "size") else "left")
    for entry in results:
        state = "reused (valid)" if entry["reused"] else f"written in {entry['seconds']:.1f} s"
        table.add_row(str(entry["layer"]), f"{entry['rows']:,}", _bytes(entry["bytes"]),
                      escape(os.path.basename(entry["path"])), state)
    console.print(table)
    return 0


def add_tables_parser(commands) -> None:
    """Register ``engram tables write`` on the ``engram`` command's subparsers."""
    tables = commands.add_parser("tables", help="the disk tier's row files of a checkpoint's tables")
    actions = tables.add_subparsers(dest="action", required=True)
    write = actions.add_parser("write", help="write each Engram layer's row file (packed rows in 4 KiB pages) into "
                                             "DIR, reusing valid ones and continuing interrupted writes")
    write.add_argument("checkpoint", metavar="CHECKPOINT", help="the model directory (config.json, *.safetensors)")
    write.add_argument("--directory", required=True, metavar="DIR",
                       help="where the row files go (a local disk with room for the tables)")
    write.add_argument("--layers", type=int, nargs="+", metavar="ID",
                       help="only these Engram layer ids (default: every Engram layer)")
    write.add_argument("--no-value-scan", action="store_true",
                       help="skip the check of every E4M3 value byte for NaN (scales are always checked)")
    write.add_argument("--json", action="store_true", help="print a JSON list of the files (no progress bars)")
    write.set_defaults(run=command_tables_write)
