"""Checks of a checkpoint beyond one tensor's header: which names are Engram tensors the config has a
place for (:func:`unexpected_engram_tensors`), whether a file is one (:func:`file_problem`), and the
table scales' overflow check while rows stream in (:class:`ScaleOverflowCheck`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engram import mapped
from engram.spec import EngramSpec
from engram.table.fp8 import OVERFLOW_SCALE_BYTE, overflow_error, overflowing_blocks

if TYPE_CHECKING:
    from engram.checkpoint.reading import SafetensorsCheckpoint, TensorInfo

__all__ = ["TENSOR_KINDS", "file_problem", "unexpected_engram_tensors", "ScaleOverflowCheck"]

TENSOR_KINDS = ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight")
_ENGRAM_NAME = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.engram\.(?P<kind>.+)$")


def file_problem(path: Path, what: str, detail: str = "") -> str | None:
    """Why ``path`` cannot be read as ``what`` (``"tokenizer file"``, ...): missing, a directory, or
    not a regular file (``detail``, e.g. who names the file, follows the path); None when it is a
    regular file."""
    if path.is_file():
        return None
    named = f"{what} {str(path)!r}{f' {detail}' if detail else ''}"
    if path.is_dir():
        return f"{named} is a directory; expected a file"
    if path.exists():
        return f"{named} is not a regular file"
    return f"{named} does not exist"


def unexpected_engram_tensors(checkpoint: SafetensorsCheckpoint, spec: EngramSpec) -> list[str]:
    """One message per tensor of the checkpoint named as an Engram tensor (``...engram...``) that the
    config has no place for: a layer not in ``engram_layer_ids`` (a checkpoint of another config?),
    or a kind not in :data:`TENSOR_KINDS` (a format this version does not know: serving without it
    would not compute what the checkpoint means). In name order; each names the tensor and its file."""
    problems = []
    for name in sorted(checkpoint.weight_map):
        if ".engram." not in name and not name.startswith("engram."):
            continue
        where = f"tensor {name!r} in file {str(checkpoint.weight_map[name])!r}"
        match = _ENGRAM_NAME.match(name)
        if match is None or match["prefix"] != checkpoint.prefix:
            problems.append(f"{where}: expected an Engram tensor name '{checkpoint.prefix}layers.<layer>.engram.<kind>', "
                            f"found {name!r}")
        elif int(match["layer"]) not in spec.layer_ids:
            problems.append(f"{where}: layer {int(match['layer'])} is not an Engram layer of the config "
                            f"(engram_layer_ids {list(spec.layer_ids)}); a checkpoint of another config?")
        elif match["kind"] not in TENSOR_KINDS:
            problems.append(f"{where}: unknown Engram tensor {match['kind']!r}; expected one of "
                            f"{', '.join(TENSOR_KINDS)}")
    return problems


class ScaleOverflowCheck:
    """``check(scale_chunk, first_row)``: refuse a chunk of a table's UE8M0 scales (``uint8 [n, D / 32]``
    on the CPU, file rows ``first_row`` on) holding a scale byte under which a finite value of its block
    decodes to infinity (:data:`engram.table.fp8.OVERFLOW_SCALE_BYTE`). A chunk whose scales are all
    below 247 (every real table) costs one max; only the rows of larger scales read their values, from
    a memory map of the values' file. The error names the scale tensor, row, column and byte and the
    value that overflows."""

    def __init__(self, values_info: TensorInfo, scales_info: TensorInfo):
        self.values_info, self.scales_info = values_info, scales_info
        self._values: torch.Tensor | None = None

    def __call__(self, scale_chunk: torch.Tensor, first_row: int) -> None:
        scales = scale_chunk.numpy() if isinstance(scale_chunk, torch.Tensor) else np.asarray(scale_chunk)
        if scales.size == 0 or int(scales.max()) < OVERFLOW_SCALE_BYTE:
            return
        rows = np.unique(np.flatnonzero(scales.reshape(-1) >= OVERFLOW_SCALE_BYTE) // scales.shape[1])
        if self._values is None:
            info = self.values_info
            self._values = mapped.map_tensor_rows(mapped.tensor_location(info.file, info.name), 0, info.shape[0])
        values = self._values[torch.from_numpy(first_row + rows)].numpy()   # only these rows are read
        blocks = overflowing_blocks(values, scales[rows])
        if blocks.size:
            row, block = divmod(int(blocks[0]), scales.shape[1])
            raise overflow_error(self.values_info.where(), self.scales_info.where(), first_row + int(rows[row]), block,
                                 values[row], int(scales[rows[row], block]))
