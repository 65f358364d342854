"""``engram shm list|remove``: the node-shared host table files of a tmpfs directory.

``engram shm list [--dir DIR] [--json]`` describes each file (:func:`engram.table.host_memory.shm_admin.list_shared_tables`);
``engram shm remove (--all-stale | KEY/PATH) [--dir DIR]`` removes one table (by share key
or path) or every stale file. Exit codes: 0 success; 1 a problem found (``list``: a stale file
or a table of ours that cannot be attached; ``remove``: a file had to stay, because its filler
is alive or this user may not remove it); 2 bad input (``remove``: a key or path that names no
table file, ``--dir`` not a directory). Errors go to stderr, one line each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["add_shm_parser"]

DEFAULT_DIRECTORY = "/dev/shm"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _state(entry) -> str:
    if entry.live_filler:
        return f"filling (pid {entry.filler_pid or 'unknown'})"
    if entry.stale:
        return "stale" + (f": {entry.problem}" if entry.problem else {"partial": ": its filler died",
                                                                      "lock": ": a lock file alone"}[entry.kind])
    if entry.owner_uid != os.getuid():
        return f"another user's (uid {entry.owner_uid})"
    return f"refused: {entry.problem}" if entry.problem else "ok"


def command_shm_list(args: argparse.Namespace, console: Console) -> int:
    from engram.table.host_memory.shm_admin import list_shared_tables

    entries = list_shared_tables(args.dir)
    problems = [e for e in entries if e.stale or (e.problem is not None and e.owner_uid == os.getuid())]
    if args.json:
        console.print_json(json.dumps([dataclasses.asdict(e) for e in entries]))
        return 1 if problems else 0
    if not entries:
        console.print(f"no shared table files in {escape(args.dir)}", highlight=False)
        return 0
    table = Table(title=f"shared table files in {escape(args.dir)}")
    for column in ("file", "kind", "size", "memory", "owner", "mode", "share key", "filled", "state"):
        table.add_column(column, justify="right" if column in ("size", "memory") else "left")
    for e in entries:
        table.add_row(escape(os.path.basename(e.path)), e.kind, _bytes(e.size), _bytes(e.allocated),
                      str(e.owner_uid), oct(e.mode), escape(e.share_key or ""), "yes" if e.filled else "no",
                      escape(_state(e)))
    console.print(table)
    stale = sum(e.stale for e in entries)
    if problems:
        console.print(f"{len(problems)} file(s) need attention ({stale} stale: `engram shm remove --all-stale "
                      f"--dir {escape(args.dir)}` removes them)", highlight=False)
    return 1 if problems else 0


def command_shm_remove(args: argparse.Namespace, console: Console) -> int:
    from engram.table.host_memory.shm_admin import remove_shared_table

    removal = remove_shared_table(args.target, directory=args.dir, all_stale=args.all_stale)
    for path in removal.removed:
        console.print(f"removed {escape(path)}", highlight=False)
    for message in removal.refused:
        console.print(f"[red]left:[/] {escape(message)}", highlight=False)
    if removal.refused:
        return 1
    if not removal.removed:
        if args.all_stale:
            console.print(f"no stale shared table files in {escape(args.dir)}", highlight=False)
            return 0
        raise ValueError(f"nothing to remove: no shared table file for {args.target!r} in {args.dir}")
    return 0


def _guarded(command):
    """A command whose OS errors (an unreadable directory) are one line on stderr and exit code 1."""
    def run(args: argparse.Namespace, console: Console) -> int:
        try:
            return command(args, console)
        except OSError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 1
    return run


def add_shm_parser(commands) -> None:
    """Register ``engram shm list|remove`` on the ``engram`` command's subparsers."""
    shm = commands.add_parser("shm", help="list or remove node-shared host tables (files in /dev/shm)")
    actions = shm.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="each table file: size, owner, share key, filled, a live filler, "
                                              "stale or not; exit 1 when one needs attention")
    listing.add_argument("--dir", default=DEFAULT_DIRECTORY, help=f"where the tables live (default {DEFAULT_DIRECTORY})")
    listing.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    listing.set_defaults(run=_guarded(command_shm_list))
    remove = actions.add_parser("remove", help="remove a table (share key or path) or every stale file; a table "
                                               "whose filler is alive is left (exit 1); a key or path that names "
                                               "no table is bad input (exit 2)")
    which = remove.add_mutually_exclusive_group(required=True)
    which.add_argument("--all-stale", action="store_true",
                       help="every file of ours that can never be attached: dead fillers' files, lone lock files, "
                            "invalid or unfilled tables, tables of changed source files")
    which.add_argument("target", nargs="?", metavar="KEY/PATH", help="a share key or a table file's path")
    remove.add_argument("--dir", default=DEFAULT_DIRECTORY, help=f"where the tables live (default {DEFAULT_DIRECTORY})")
    remove.set_defaults(run=_guarded(command_shm_remove))
