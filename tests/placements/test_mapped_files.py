"""Placement "cpu" serves table rows from memory maps of the checkpoint files: a file rewritten in
place or truncated under the running process is an error at the next lookup, never other rows or a
SIGBUS; a file replaced by a rename is harmless (the map keeps the old one)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import engram
from engram.checkpoint import SafetensorsCheckpoint
from engram.mapped import MappedFileChanged
from engram.tools.testing import write_synthetic_checkpoint

SRC = Path(engram.__file__).parent.parent


def _memory_and_ids(directory, layer_id=1):
    memory = engram.EngramMemory.from_pretrained(directory, placement="cpu", progress=False)
    index = memory.layer_ids.index(layer_id)
    ids = torch.as_tensor(memory.layout.column_offsets[index])[None].repeat(3, 1) + torch.arange(3)[:, None]
    return memory, ids


def test_a_file_rewritten_in_place_is_refused_at_the_next_lookup(tmp_path):
    directory = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word", num_shards=2).directory
    memory, ids = _memory_and_ids(directory)
    table = memory.table(1)
    before = table.lookup(ids)
    path = SafetensorsCheckpoint(directory).file_of("layers.1.engram.embed.weight")
    stat = path.stat()
    with open(path, "r+b") as handle:   # same size, other bytes: what an in-place copy does
        handle.seek(stat.st_size - 64)
        handle.write(bytes(64))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(MappedFileChanged, match=rf"file '.*{path.name}' changed while its table rows were "
                                                rf"memory-mapped \(modified in place"):
        table.lookup(ids)
    with pytest.raises(MappedFileChanged):
        memory.forward_layer(1, torch.zeros(3, memory.spec.hc_mult, memory.spec.hidden_size, dtype=torch.bfloat16),
                             torch.stack([ids, ids], dim=1) if memory.spec.num_layers == 2 else ids[:, None])
    assert before.shape == (3, memory.spec.num_columns, memory.spec.head_dim)


def test_a_file_replaced_by_a_rename_changes_nothing(tmp_path):
    directory = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word").directory
    memory, ids = _memory_and_ids(directory)
    before = memory.table(1).lookup(ids)
    path = SafetensorsCheckpoint(directory).file_of("layers.1.engram.embed.weight")
    replacement = path.with_suffix(".new")
    replacement.write_bytes(bytes(path.stat().st_size))
    os.replace(replacement, path)
    assert torch.equal(memory.table(1).lookup(ids).view(torch.int16), before.view(torch.int16))


def test_a_truncated_file_is_an_error_not_a_sigbus(tmp_path):
    """In a process of its own: a SIGBUS there fails the test instead of ending pytest."""
    directory = write_synthetic_checkpoint(tmp_path / "model", tokenizer="word").directory
    script = textwrap.dedent(f"""
        import os, torch, engram
        from engram.checkpoint import SafetensorsCheckpoint
        from engram.mapped import MappedFileChanged
        memory = engram.EngramMemory.from_pretrained({str(directory)!r}, placement="cpu", progress=False)
        layout = memory.layout
        last = layout.num_embeddings[0] - 1
        ids = torch.as_tensor(layout.column_offsets[0])[None].clone()
        ids[0, -1] = last                        # the table's last row, at the end of the mapping
        memory.table(1).lookup(ids)
        path = SafetensorsCheckpoint({str(directory)!r}).file_of("layers.1.engram.embed.weight")
        os.truncate(path, 4096)
        try:
            memory.table(1).lookup(ids)
        except MappedFileChanged as error:
            print("refused:", error)
    """)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "refused:" in result.stdout and "size" in result.stdout and "-> 4,096 bytes" in result.stdout
