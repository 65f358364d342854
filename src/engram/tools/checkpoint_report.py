"""``engram info --checkpoint DIR``: what a checkpoint holds, and every check
:meth:`EngramMemory.from_pretrained` makes on it, run to the end with each problem collected.

Printed: the Engram tensors (file, dtype, shape, checked against the config), the files, and the
table bytes each placement keeps per tensor-parallel rank. Checked, as the loader does: every
header against the config, the pairing of ``wkv.weight`` with its block scales, the values of the
small tensors (:func:`engram.checkpoint.check_weight_values`), every table byte for NaN (a scan of
all table bytes, with a progress bar; ``scan_tables=False`` skips it) and the tokenizer against
the config. A file that cannot be read is one problem, however many tensors it holds.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from engram.layout import EngramLayout
from engram.spec import EngramSpec

__all__ = ["checkpoint_report", "format_bytes"]


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count} B"


class _Problems:
    """Numbered problems, each message once; :meth:`add` returns the table's pointer to it."""

    def __init__(self):
        self.messages: list[str] = []

    def add(self, message: str) -> str:
        if message not in self.messages:
            self.messages.append(message)
        return f"[red]problem {self.messages.index(message) + 1}[/]"


def _unreadable_files(checkpoint, problems: _Problems) -> dict[Path, str]:
    """Each file holding an Engram tensor that is missing or cannot be opened -> its problem's
    pointer (one problem per file, listing the Engram tensors it should hold)."""
    from engram.checkpoint import _open

    holders: dict[Path, list[str]] = {}
    for name, path in checkpoint.weight_map.items():
        if ".engram." in name:
            holders.setdefault(path, []).append(name)
    bad: dict[Path, str] = {}
    for path, error in checkpoint.unreadable_files.items():  # without an index: headers already read
        bad[path] = problems.add(f"file {str(path)!r} is not a readable safetensors file, it may be truncated or "
                                 f"corrupt ({error})")
    for path in sorted(holders):
        names = sorted(holders[path])
        listed = f"{len(names)} Engram tensor(s): {', '.join(repr(n) for n in names)}"
        if not path.is_file():
            bad[path] = problems.add(f"file {str(path)!r}, named by the index file {str(checkpoint.index_file)!r}, "
                                     f"does not exist; it should hold {listed}")
            continue
        try:
            with _open(path, "checkpoint"):
                pass
        except ValueError as error:
            bad[path] = problems.add(f"{str(error).removeprefix('checkpoint: ')}; it holds {listed}")
    return bad


def checkpoint_report(directory: str, spec: EngramSpec, layout: EngramLayout, console: Console, *,
                      scan_tables: bool = True, progress: bool = True) -> list[str]:
    """Print the tables described in the module docstring and return every problem found, each a
    whole message (the tables only point to it)."""
    from engram.checkpoint import (DEFAULT_CHUNK_BYTES, SafetensorsCheckpoint, map_table_rows, _wkv_scale_info,
                             expected_layer_tensors, layer_weight_problems, table_progress)
    from engram.memory import _read_vocab
    from engram.table import available_placements

    checkpoint = SafetensorsCheckpoint(directory)
    source = (f"index {checkpoint.index_file.name}" if checkpoint.index_file is not None
              else "no index: every *.safetensors header read")
    tensors = Table(title=f"Engram tensors of {directory} ({len(checkpoint.files)} files, {source})")
    for column in ("tensor", "file", "dtype", "shape", "bytes", "check"):
        tensors.add_column(column, justify="right" if column == "bytes" else "left")
    per_file: dict[str, list[int]] = {}
    problems = _Problems()
    unreadable = _unreadable_files(checkpoint, problems)
    sound_layers = []
    for index, layer_id in enumerate(spec.layer_ids):
        expected = expected_layer_tensors(spec, layout, index)
        sound = True
        wkv_info = None
        for kind in ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight"):
            name = checkpoint.name(layer_id, kind)
            if kind == "wkv.scale" and name not in checkpoint and (wkv_info is None or wkv_info.dtype != "F8_E4M3"):
                continue  # only FP8 wkv weights carry block scales
            path = checkpoint.weight_map.get(name)
            if path in unreadable:
                tensors.add_row(name, path.name, "", "", "", unreadable[path])
                sound = False
                continue
            try:
                if kind == "wkv.scale" and wkv_info is not None:
                    info = _wkv_scale_info(checkpoint, spec, layout, index, wkv_info)
                    verdict = "[green]ok[/]"
                elif kind in expected:
                    info, verdict = checkpoint.check(name, *expected[kind]), "[green]ok[/]"
                else:  # scales beside a wkv.weight that is itself a problem: judged once it is fixed
                    info, verdict = checkpoint.info(name), ""
            except ValueError as error:
                info, verdict, sound = None, problems.add(str(error)), False
            if info is None:
                try:
                    info = checkpoint.info(name)
                except ValueError:
                    tensors.add_row(name, "", "", "", "", verdict)
                    continue
            if kind == "wkv.weight" and verdict.endswith("ok[/]"):
                wkv_info = info
            tensors.add_row(name, info.file.name, info.dtype, str(list(info.shape)), f"{info.nbytes:,}", verdict)
            counts = per_file.setdefault(info.file.name, [0, 0])
            counts[0] += 1
            counts[1] += info.nbytes
        if sound:
            sound_layers.append(index)
    console.print(tensors)
    files = Table(title="files")
    for column in ("file", "Engram tensors", "Engram bytes", "other tensors"):
        files.add_column(column, justify="left" if column == "file" else "right")
    for path in checkpoint.files:
        others = sum(1 for name, file in checkpoint.weight_map.items() if file == path and ".engram." not in name)
        count, size = per_file.get(path.name, [0, 0])
        files.add_row(path.name, str(count), format_bytes(size), str(others))
    console.print(files)

    # The loader's checks beyond the headers, on the layers whose headers are sound.
    for index in sound_layers:
        for message in layer_weight_problems(checkpoint, spec, layout, index):
            problems.add(message)
    if scan_tables and sound_layers:
        total = sum(layout.num_embeddings[i] for i in sound_layers) * spec.row_bytes
        bar = table_progress(total, "checking engram tables", enabled=progress)
        try:
            for index in sound_layers:
                layer_id, expected = spec.layer_ids[index], expected_layer_tensors(spec, layout, index)
                values = checkpoint.check(checkpoint.name(layer_id, "embed.weight"), *expected["embed.weight"])
                scales = checkpoint.check(checkpoint.name(layer_id, "embed.scale"), *expected["embed.scale"])
                try:
                    map_table_rows(values, scales, 0, layout.num_embeddings[index], DEFAULT_CHUNK_BYTES, bar, True,
                                   f"layer {layer_id} table", layout.num_embeddings[index] * spec.row_bytes)
                except ValueError as error:
                    problems.add(str(error))
        finally:
            bar.close()
    try:
        _read_vocab(Path(directory), spec)
    except ValueError as error:
        problems.add(str(error))

    _print_placements(spec, layout, console, available_placements())
    if not scan_tables:
        console.print("[dim]--no-value-scan: the table bytes were not scanned for NaN[/]")
    return problems.messages


def _print_placements(spec: EngramSpec, layout: EngramLayout, console: Console, available) -> None:
    world_sizes = (1, 2, 4, 8)
    placements = Table(title="table bytes per placement and tensor-parallel size (the largest rank)")
    placements.add_column("placement", justify="left")
    placements.add_column("where the table bytes live", justify="left")
    for world_size in world_sizes:
        placements.add_column(f"tp={world_size}", justify="right")
    per_rank: list[str] = []
    per_node: list[str] = []
    for world_size in world_sizes:
        try:
            shards = [layout.shard(rank, world_size) for rank in range(world_size)]
        except ValueError:
            per_rank.append("no split")
            per_node.append("no split")
            continue
        largest = max(sum(s.num_rows(l) for l in range(spec.num_layers)) for s in shards) * spec.row_bytes
        per_rank.append(format_bytes(largest))
        per_node.append(format_bytes(sum(layout.table_bytes)))
    placements.add_row("cpu", "page cache (memory-mapped files), per node", *per_rank)
    placements.add_row("device", "HBM, per GPU", *per_rank)
    if "host" in available:
        placements.add_row("host", "pinned host memory, all ranks' shards (one copy per node with "
                           "share_host_tables; rows packed to 272 B there, +3%)", *per_node)
    else:
        placements.add_row("host", "[dim]not available in this version[/]", *[""] * len(world_sizes))
    wkv_bytes = spec.num_layers * (spec.kv_dim * spec.num_columns * spec.head_dim + 2 * spec.hc_mult * spec.hidden_size) * 2
    placements.add_row("(any)", "wkv, q/k weights in bf16 (an FP8 wkv stays FP8 on a GPU: half), "
                       "on every rank's compute device",
                       *[format_bytes(wkv_bytes)] * len(world_sizes))
    console.print(placements)
    console.print("[dim]'no split': ceil(C/tp) columns per rank leave a rank without a column[/]")

