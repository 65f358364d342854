"""``engram info --checkpoint DIR``: what a checkpoint holds, and every check
:meth:`EngramMemory.from_pretrained` makes on it, run to the end with each problem collected.

Printed: the Engram tensors (file, dtype, shape, checked against the config), the files, and the
table bytes each placement keeps per tensor-parallel rank. Checked, as the loader does: every
header against the config, the pairing of ``wkv.weight`` with its block scales, the values of the
small tensors (:func:`engram.checkpoint.check_weight_values`), every table byte for NaN and every
scale for a byte that makes a value of its block infinite (a scan of all table bytes, with a progress
bar; ``scan_tables=False`` skips it), tensors named as Engram tensors the config has no place for, and
the tokenizer against the config. A file that cannot be read is one problem, however many tensors it
holds; one found without an index that holds no tensor the loader reads is a warning, as the loader
sees it. The checkpoint's config is read by the caller: a broken one is the report's only problem.
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


def _unreadable_files(checkpoint, problems: _Problems, warn) -> dict[Path, str]:
    """Each file holding an Engram tensor that is missing or cannot be opened -> its problem's
    pointer (one problem per file, listing the Engram tensors it should hold). A file found
    without an index that cannot be read is only a warning, as the loader sees it: it is an
    error there only when a tensor is looked for and found in no other file (then that tensor's
    problem names the file)."""
    from engram.checkpoint import _open, file_problem

    holders: dict[Path, list[str]] = {}
    for name, path in checkpoint.weight_map.items():
        if ".engram." in name:
            holders.setdefault(path, []).append(name)
    bad: dict[Path, str] = {}
    for path, error in checkpoint.unreadable_files.items():  # without an index: headers already read
        warn([f"file {str(path)!r} is not a readable safetensors file ({error}); the loader reads no tensor from "
              f"it"])
    for path in sorted(holders):
        names = sorted(holders[path])
        listed = f"{len(names)} Engram tensor(s): {', '.join(repr(n) for n in names)}"
        problem = file_problem(path, "file")
        if problem is not None:
            bad[path] = problems.add(f"{problem}; the index file {str(checkpoint.index_file)!r} names it for {listed}")
            continue
        try:
            with _open(path, "checkpoint"):
                pass
        except ValueError as error:
            bad[path] = problems.add(f"{str(error).removeprefix('checkpoint: ')}; it holds {listed}")
    return bad


def checkpoint_report(directory: str, spec: EngramSpec, layout: EngramLayout, console: Console, *,
                      scan_tables: bool = True, progress: bool = True, warn=None) -> list[str]:
    """Print the tables described in the module docstring and return every problem found, each a
    whole message (the tables only point to it). ``warn(messages)``: what is worth saying but no
    problem (an unreadable stray file the loader never reads); default: printed with the tables."""
    from engram.checkpoint import (DEFAULT_CHUNK_BYTES, SafetensorsCheckpoint, map_table_rows, _wkv_scale_info,
                             expected_layer_tensors, file_problem, layer_weight_problems, table_progress,
                             unexpected_engram_tensors)
    from engram.memory import _read_vocab
    from engram.table import available_placements

    if warn is None:
        def warn(messages):
            for message in messages:
                console.print(f"warning: {message}", markup=False, highlight=False)
    try:
        checkpoint = SafetensorsCheckpoint(directory)
    except ValueError as error:  # no shard, a garbage index, a tensor in two files: nothing else can be read
        return [str(error)]
    source = (f"index {checkpoint.index_file.name}" if checkpoint.index_file is not None
              else "no index: every *.safetensors header read")
    tensors = Table(title=f"Engram tensors of {directory} ({len(checkpoint.files)} files, {source})")
    for column in ("tensor", "file", "dtype", "shape", "bytes", "check"):
        tensors.add_column(column, justify="right" if column == "bytes" else "left")
    problems = _Problems()
    unreadable = _unreadable_files(checkpoint, problems, warn)
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
        if sound:
            sound_layers.append(index)
    unknown = {}
    for message in unexpected_engram_tensors(checkpoint, spec):
        name = message.split("'", 2)[1]
        unknown[name] = problems.add(message)
    for name, pointer in unknown.items():
        try:
            info = checkpoint.info(name)
            tensors.add_row(name, info.file.name, info.dtype, str(list(info.shape)), f"{info.nbytes:,}", pointer)
        except ValueError:
            tensors.add_row(name, checkpoint.weight_map[name].name, "", "", "", pointer)
    console.print(tensors)
    _print_files(checkpoint, console)

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
    tokenizer_problem = file_problem(Path(directory) / "tokenizer.json", "tokenizer file")
    if tokenizer_problem is not None:
        problems.add(tokenizer_problem)
    else:
        try:
            _read_vocab(Path(directory), spec)
        except ValueError as error:
            problems.add(str(error))

    _print_placements(spec, layout, console, available_placements())
    if not scan_tables:
        console.print("[dim]--no-value-scan: the table bytes were not scanned[/]")
    return problems.messages


def _print_files(checkpoint, console: Console) -> None:
    """Per file: its Engram tensors (every tensor named ``...engram...``, known or not) and their
    bytes, and its other tensors, from the index or the headers."""
    files = Table(title="files")
    for column in ("file", "Engram tensors", "Engram bytes", "other tensors"):
        files.add_column(column, justify="left" if column == "file" else "right")
    unreadable = checkpoint.unreadable_files
    for path in checkpoint.files:
        names = [name for name, file in checkpoint.weight_map.items() if file == path]
        engram_names = [name for name in names if ".engram." in name]
        size = 0
        for name in engram_names:
            try:
                size += checkpoint.info(name).nbytes
            except ValueError:
                pass
        if path in unreadable:
            files.add_row(path.name, "", "", "[dim]unreadable: not read[/]")
            continue
        files.add_row(path.name, str(len(engram_names)), format_bytes(size), str(len(names) - len(engram_names)))
    console.print(files)


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
        from engram.table.host_memory.rows import packed_row_bytes

        packed = packed_row_bytes(spec.head_dim)
        host_bytes = format_bytes(sum(layout.num_embeddings) * packed)
        placements.add_row("host", f"pinned host memory, all ranks' shards (one copy per node with share_host_tables); "
                           f"rows packed to {packed} B of {spec.row_bytes} "
                           f"(+{packed / spec.row_bytes - 1:.0%}, counted)", *[host_bytes if cell != "no split" else cell
                                                                           for cell in per_node])
    else:
        placements.add_row("host", "[dim]not available in this version[/]", *[""] * len(world_sizes))
    wkv_bytes = spec.num_layers * (spec.kv_dim * spec.num_columns * spec.head_dim + 2 * spec.hc_mult * spec.hidden_size) * 2
    placements.add_row("(any)", "wkv, q/k weights in bf16 (an FP8 wkv stays FP8 on a GPU: half), "
                       "on every rank's compute device",
                       *[format_bytes(wkv_bytes)] * len(world_sizes))
    console.print(placements)
    console.print("[dim]'no split': ceil(C/tp) columns per rank leave a rank without a column[/]")

