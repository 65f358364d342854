"""Table layout of every Engram layer: primes, column offsets, hash multipliers,
row counts and tensor-parallel shards (docs/design.md §2 and §3).

Column ``col = (order - 2) * n_heads + head`` of a layer owns the row range
``[offsets[col], offsets[col] + prime[col])`` of that layer's table.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from engram.checks import check_int, check_positive_int
from engram.primes import bucket_primes, is_prime
from engram.spec import EngramSpec

__all__ = ["EngramLayout", "ColumnShard", "is_prime", "table_primes", "layer_multipliers"]

_SEED_PRIME = 10007


def table_primes(spec: EngramSpec) -> list[list[list[int]]]:
    """Bucket sizes ``[L][N-1][H]`` of ``spec``'s tables (:func:`engram.primes.bucket_primes`)."""
    return bucket_primes(len(spec.layer_ids), spec.max_ngram_size, spec.n_heads, spec.vocab_size)


def layer_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Odd int64 multipliers ``[N]`` of one layer, from ``default_rng(10007 * layer_id)``.

    ``bound = (int64_max // compressed_vocab_size) // 2``, so ``id * m`` never overflows.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rng = np.random.default_rng(_SEED_PRIME * layer_id)
    return rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1


@dataclass(frozen=True)
class ColumnShard:
    """The whole hash columns ``[column_start, column_end)`` that one tensor-parallel
    rank owns, and per layer the contiguous row range ``[row_start, row_end)`` they span."""

    rank: int
    world_size: int
    column_start: int
    column_end: int
    row_ranges: tuple[tuple[int, int], ...]  # one (row_start, row_end) per layer

    @property
    def num_columns(self) -> int:
        return self.column_end - self.column_start

    def num_rows(self, layer_index: int) -> int:
        start, end = self.row_ranges[layer_index]
        return end - start


class EngramLayout:
    """Everything about the tables that follows from an :class:`EngramSpec`.

    Attributes:
        primes: ``[L][N-1][H]`` Python ints, bucket size per (layer, order, head).
        offsets: ``[L][C]`` first row of each hash column in its layer's table.
        multipliers: int64 ``[L, N]``.
        num_embeddings: rows per layer table, ``sum(primes of the layer)``.
        column_primes / column_offsets: int64 ``[L, C]`` arrays of the same numbers.
    """

    def __init__(self, spec: EngramSpec):
        if not isinstance(spec, EngramSpec):
            hint = (" (EngramSpec.from_hf_config(path) reads one from a config.json or model directory)"
                    if isinstance(spec, (str, os.PathLike, dict)) else "")
            raise ValueError(f"spec: expected an EngramSpec, found {type(spec).__name__} {spec!r}{hint}"[:400])
        self.spec = spec
        self.primes = table_primes(spec)
        self.column_primes = np.array(
            [[p for order in layer for p in order] for layer in self.primes], dtype=np.int64
        ).reshape(spec.num_layers, spec.num_columns)
        starts = np.cumsum(self.column_primes, axis=1) - self.column_primes
        self.column_offsets = starts.astype(np.int64)
        self.offsets = self.column_offsets.tolist()
        self.num_embeddings = [int(s) for s in self.column_primes.sum(axis=1)]
        self.multipliers = np.stack(
            [layer_multipliers(l, spec.max_ngram_size, spec.compressed_vocab_size) for l in spec.layer_ids]
        )

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_columns(self) -> int:
        return self.spec.num_columns

    @cached_property
    def table_bytes(self) -> list[int]:
        """FP8 bytes per layer table (E4M3 values + UE8M0 scales)."""
        return [rows * self.spec.row_bytes for rows in self.num_embeddings]

    def shard(self, rank: int, world_size: int) -> ColumnShard:
        """Rank ``rank`` of ``world_size`` owns columns ``[rank*ceil(C/tp), ...)``.

        Raises ``ValueError`` when that leaves the rank with no column.
        """
        check_positive_int("world_size", world_size)
        check_int("rank", rank, 0, below=world_size)
        columns = self.num_columns
        per_rank = -(-columns // world_size)  # ceil (engram.common.ceil_div, which imports torch)
        start, end = rank * per_rank, min(columns, (rank + 1) * per_rank)
        if start >= end:
            raise ValueError(
                f"world_size {world_size}: rank {rank} gets no hash column "
                f"({columns} columns, {per_rank} per rank); use a world size whose ceil(C/tp) split covers every rank"
            )
        row_ranges = tuple(
            (int(self.column_offsets[l, start]), int(self.column_offsets[l, end - 1] + self.column_primes[l, end - 1]))
            for l in range(self.num_layers)
        )
        return ColumnShard(rank, world_size, start, end, row_ranges)

    def __repr__(self) -> str:
        return (f"EngramLayout(layers={list(self.spec.layer_ids)}, columns={self.num_columns}, "
                f"num_embeddings={self.num_embeddings})")
