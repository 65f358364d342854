"""EngramTable and lookup_reference: bit-exact reads, shards, out-of-shard zeros, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engram.layout import EngramLayout
from engram.spec import EngramSpec
from engram.table import (
    E8M0_DTYPE,
    CpuPlacement,
    EngramTable,
    available_placements,
    lookup_reference,
    register_placement,
)
from engram.table import placement as table_module

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKEN_COUNTS = st.sampled_from([1, 2, 7, 63, 100])
seeds = st.integers(0, 2**63 - 1)


def layout_of(max_ngram_size: int, n_heads: int, head_dim: int = 64) -> EngramLayout:
    config = {
        "engram_layer_ids": [1, 3], "engram_max_ngram_size": max_ngram_size, "engram_n_heads": n_heads,
        "engram_head_dim": head_dim, "engram_vocab_size": 101, "engram_compressed_vocab_size": 50,
        "engram_pad_token_id": 0, "hidden_size": 64, "hc_mult": 2, "rms_norm_eps": 1e-6,
        "engram_num_embeddings": [1, 1],
    }
    config["engram_num_embeddings"] = EngramLayout(EngramSpec.from_hf_config(config, check_rows=False)).num_embeddings
    return EngramLayout(EngramSpec.from_hf_config(config))


LAYOUTS = {
    "C6": layout_of(3, 3),          # the brief's geometry: C = 6
    "C10": layout_of(3, 5, 96),     # C = 10: tp 3 -> 4+4+2, tp 4 -> 3+3+3+1
    "C9": layout_of(4, 3, 32),      # C = 9: tp 2 -> 5+4
}
layout_names = st.sampled_from(sorted(LAYOUTS))


# ---------------------------------------------------------------------------
# independent model: numpy decode of E4M3 * 2**(b - 127), rounded once to bf16
# ---------------------------------------------------------------------------
def decode_e4m3(value_bytes: np.ndarray) -> np.ndarray:
    value_bytes = value_bytes.astype(np.int64)
    sign = np.where(value_bytes & 0x80, -1.0, 1.0)
    exponent, mantissa = (value_bytes >> 3) & 0xF, value_bytes & 0x7
    magnitude = np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -9),
                         np.ldexp((8 + mantissa).astype(np.float64), exponent - 10))
    return np.where((value_bytes & 0x7F) == 0x7F, np.nan, sign * magnitude)


def bf16_bits_of_float64(x: np.ndarray) -> np.ndarray:
    """Round float64 to bf16 (nearest even, subnormals, overflow to inf); bit patterns as int64."""
    _, frexp_exponent = np.frexp(np.abs(x))
    quantum = np.ldexp(1.0, np.maximum(frexp_exponent - 1, -126) - 7)
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.round(x / quantum) * quantum
        rounded = np.where(np.abs(rounded) >= 2.0**128, np.copysign(np.inf, rounded), rounded)
        bits = (rounded.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
    return np.where(np.isnan(x), -1, bits)


def expected_lookup_bits(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end):
    """bf16 bit patterns [T, C_local, D] of the rows named by hash_ids[:, column_start:column_end]."""
    ids = hash_ids[:, column_start:column_end].astype(np.int64) - row_start
    inside = (ids >= 0) & (ids < value_bytes.shape[0])
    safe = np.where(inside, ids, 0)
    scales = scale_bytes[safe].astype(np.int64)
    factors = np.where(scales == 255, np.nan, np.ldexp(1.0, scales - 127))   # E8M0 byte 255 is NaN
    product = decode_e4m3(value_bytes[safe]) * np.repeat(factors, 32, axis=-1)
    product = np.where(inside[..., None], product, 0.0)
    return bf16_bits_of_float64(product)


def bits_of(tensor: torch.Tensor) -> np.ndarray:
    bits = tensor.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    return np.where(torch.isnan(tensor).numpy(), -1, bits)


def random_table(rng: np.random.Generator, rows: int, head_dim: int, poison_row_zero: bool = False):
    """Random FP8 rows over every finite E4M3 byte and every finite scale byte (0..254): some products
    overflow to inf, so the tables built from them are raw bytes (``check_values=False``)."""
    value_bytes = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    value_bytes[(value_bytes & 0x7F) == 0x7F] = 0x3C
    scale_bytes = rng.integers(0, 255, size=(rows, head_dim // 32), dtype=np.uint8)
    if poison_row_zero:  # the row a masked-out id is clamped to: NaN everywhere, so a leak shows
        value_bytes[0] = 0x7F
        scale_bytes[0] = 0xFF
    return value_bytes, scale_bytes


def random_hash_ids(rng, layout: EngramLayout, layer_index: int, tokens: int, anywhere_fraction: float = 0.3):
    """[T, C] global row ids: per column offset + (random % prime), some anywhere in [0, rows)."""
    offsets, primes = layout.column_offsets[layer_index], layout.column_primes[layer_index]
    ids = offsets + rng.integers(0, primes, size=(tokens, layout.num_columns))
    anywhere = rng.random(ids.shape) < anywhere_fraction
    return np.where(anywhere, rng.integers(0, layout.num_embeddings[layer_index], size=ids.shape), ids)


def as_values(value_bytes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(value_bytes).view(torch.float8_e4m3fn)


# ---------------------------------------------------------------------------
# whole layers
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, name=layout_names, layer_index=st.integers(0, 1), tokens=TOKEN_COUNTS,
       id_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_whole_layer_lookup_bit_exact(seed, name, layer_index, tokens, id_dtype):
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[name]
    rows, head_dim = layout.num_embeddings[layer_index], layout.spec.head_dim
    value_bytes, scale_bytes = random_table(rng, rows, head_dim)
    table = EngramTable.from_layout(layout, layer_index, None, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                    check_values=False)
    hash_ids = random_hash_ids(rng, layout, layer_index, tokens)
    ids = torch.from_numpy(hash_ids).to(id_dtype)

    out = table.lookup(ids)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, layout.num_columns, head_dim)
    expected = expected_lookup_bits(value_bytes, scale_bytes, hash_ids, 0, 0, layout.num_columns)
    assert np.array_equal(bits_of(out), expected)
    reference = lookup_reference(as_values(value_bytes), torch.from_numpy(scale_bytes), ids)
    assert np.array_equal(bits_of(reference), expected)

    packed_values, packed_scales = table.lookup_packed(ids)
    assert packed_values.dtype == torch.float8_e4m3fn and packed_scales.dtype == torch.uint8
    assert np.array_equal(packed_values.view(torch.uint8).numpy(), value_bytes[hash_ids])
    assert np.array_equal(packed_scales.numpy(), scale_bytes[hash_ids])


def test_properties_and_plain_constructor(rng):
    rows = int(rng.integers(5, 300))
    value_bytes, scale_bytes = random_table(rng, rows, 96)
    table = EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes), check_values=False)
    assert (table.num_rows, table.head_dim, table.placement, table.device) == (rows, 96, "cpu", torch.device("cpu"))
    assert table.nbytes == rows * (96 + 3)
    assert table.num_rows_total == rows and table.validate
    assert (table.row_start, table.row_end, table.column_start, table.column_end) == (0, rows, 0, None)
    # column_end None: every column of the hash ids, whatever their width
    for width in (1, 5):
        hash_ids = rng.integers(0, rows, size=(3, width))
        out = table.lookup(torch.from_numpy(hash_ids))
        assert out.shape == (3, width, 96)
        assert np.array_equal(bits_of(out), expected_lookup_bits(value_bytes, scale_bytes, hash_ids, 0, 0, width))
    assert "placement='cpu'" in repr(table)


def test_uint8_values_and_e8m0_scales_accepted(rng):
    value_bytes, scale_bytes = random_table(rng, 40, 64)
    hash_ids = torch.from_numpy(rng.integers(0, 40, size=(9, 4)))
    baseline = EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes), check_values=False).lookup(hash_ids)
    from_bytes = EngramTable(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes),
                             check_values=False).lookup(hash_ids)
    assert torch.equal(baseline.view(torch.int16), from_bytes.view(torch.int16))
    if E8M0_DTYPE is not None:
        scales = torch.from_numpy(scale_bytes).view(E8M0_DTYPE)
        from_e8m0 = EngramTable(as_values(value_bytes), scales, check_values=False).lookup(hash_ids)
        assert torch.equal(baseline.view(torch.int16), from_e8m0.view(torch.int16))


# ---------------------------------------------------------------------------
# tensor-parallel shards
# ---------------------------------------------------------------------------
def valid_ranks(layout: EngramLayout, world_size: int) -> list[int]:
    per_rank = -(-layout.num_columns // world_size)
    return [rank for rank in range(world_size) if rank * per_rank < layout.num_columns]


@SETTINGS
@given(seed=seeds, name=layout_names, layer_index=st.integers(0, 1), tokens=TOKEN_COUNTS,
       world_size=st.integers(1, 6))
def test_shards_bit_exact_and_gather_to_whole(seed, name, layer_index, tokens, world_size):
    """Each rank reads its columns from its rows (zeros for ids outside them); the ranks'
    outputs side by side equal the whole table's when every id lies in its column's bucket."""
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[name]
    head_dim = layout.spec.head_dim
    value_bytes, scale_bytes = random_table(rng, layout.num_embeddings[layer_index], head_dim)
    mixed_ids = random_hash_ids(rng, layout, layer_index, tokens, anywhere_fraction=0.5)
    bucket_ids = random_hash_ids(rng, layout, layer_index, tokens, anywhere_fraction=0.0)
    whole = EngramTable.from_layout(layout, layer_index, None, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                    check_values=False)

    pieces = []
    for rank in valid_ranks(layout, world_size):
        shard = layout.shard(rank, world_size)
        row_start, row_end = shard.row_ranges[layer_index]
        shard_values, shard_scales = value_bytes[row_start:row_end].copy(), scale_bytes[row_start:row_end].copy()
        shard_values[0], shard_scales[0] = 0x7F, 0xFF  # poison the row out-of-shard ids are clamped to
        table = EngramTable.from_layout(layout, layer_index, shard, as_values(shard_values),
                                        torch.from_numpy(shard_scales), check_values=False)
        assert table.num_rows == row_end - row_start and table.num_rows_total == layout.num_embeddings[layer_index]
        assert (table.column_start, table.column_end) == (shard.column_start, shard.column_end)

        out = table.lookup(torch.from_numpy(mixed_ids))
        assert out.shape == (tokens, shard.num_columns, head_dim)
        expected = expected_lookup_bits(shard_values, shard_scales, mixed_ids, row_start,
                                        shard.column_start, shard.column_end)
        assert np.array_equal(bits_of(out), expected)
        reference = lookup_reference(as_values(shard_values), torch.from_numpy(shard_scales),
                                     torch.from_numpy(mixed_ids), row_start, shard.column_start, shard.column_end)
        assert np.array_equal(bits_of(reference), expected)

        local_ids = mixed_ids[:, shard.column_start:shard.column_end] - row_start
        outside = (local_ids < 0) | (local_ids >= row_end - row_start)
        packed_values, packed_scales = table.lookup_packed(torch.from_numpy(mixed_ids))
        assert np.all(packed_values.view(torch.uint8).numpy()[outside] == 0)
        assert np.all(packed_scales.numpy()[outside] == 0)
        assert np.all(bits_of(out)[outside] == 0)  # +0, not -0 or NaN

        shard_values[0], shard_scales[0] = value_bytes[row_start], scale_bytes[row_start]  # unpoison
        table = EngramTable.from_layout(layout, layer_index, shard, as_values(shard_values),
                                        torch.from_numpy(shard_scales), check_values=False)
        pieces.append(table.lookup(torch.from_numpy(bucket_ids)))
    gathered = torch.cat(pieces, dim=1)
    assert torch.equal(gathered.view(torch.int16), whole.lookup(torch.from_numpy(bucket_ids)).view(torch.int16))


def test_uneven_splits_covered():
    """The geometries above do split unevenly (the last rank holds fewer columns)."""
    widths = {(name, world_size): [LAYOUTS[name].shard(rank, world_size).num_columns
                                   for rank in valid_ranks(LAYOUTS[name], world_size)]
              for name in LAYOUTS for world_size in (2, 3, 4)}
    assert widths[("C10", 3)] == [4, 4, 2]
    assert widths[("C10", 4)] == [3, 3, 3, 1]
    assert widths[("C9", 2)] == [5, 4]


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------
@SETTINGS
@given(seed=seeds, tokens=TOKEN_COUNTS, negative=st.booleans(), sharded=st.booleans())
def test_out_of_table_ids_raise(seed, tokens, negative, sharded):
    rng = np.random.default_rng(seed)
    layout = LAYOUTS["C10"]
    layer_index = int(rng.integers(0, 2))
    total = layout.num_embeddings[layer_index]
    shard = layout.shard(1, 3) if sharded else None
    row_start, row_end = shard.row_ranges[layer_index] if sharded else (0, total)
    value_bytes, scale_bytes = random_table(rng, row_end - row_start, 96)
    table = EngramTable.from_layout(layout, layer_index, shard, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                    check_values=False)
    hash_ids = random_hash_ids(rng, layout, layer_index, tokens, anywhere_fraction=0.5)
    table.lookup(torch.from_numpy(hash_ids))  # in-table ids (also other ranks' rows) pass

    column_start, column_end = table.column_start, table.column_end
    token, column = int(rng.integers(0, tokens)), int(rng.integers(column_start, column_end))
    bad_id = -int(rng.choice([1, rng.integers(2, 1000)])) if negative else total + int(rng.choice([0, rng.integers(1, 1000)]))
    hash_ids[token, column] = bad_id
    message = rf"hash_ids column {column} \(token {token}\): id {bad_id} is outside the layer's table rows \[0, {total}\)"
    with pytest.raises(ValueError, match=message):
        table.lookup(torch.from_numpy(hash_ids))
    with pytest.raises(ValueError, match=message):
        table.lookup_packed(torch.from_numpy(hash_ids).to(torch.int32))

    # a bad id in a column this table does not serve is another rank's business
    if sharded:
        other = hash_ids.copy()
        other[token, column] = layout.column_offsets[layer_index, column]
        other[token, 0] = bad_id
        table.lookup(torch.from_numpy(other))

    # validation off: no error, the id reads zeros
    quiet = EngramTable.from_layout(layout, layer_index, shard, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                    validate=False, check_values=False)
    out = quiet.lookup(torch.from_numpy(hash_ids))
    assert np.all(bits_of(out)[token, column - column_start] == 0)


def test_from_layout_shape_errors():
    layout = LAYOUTS["C6"]
    total = layout.num_embeddings[0]
    shard = layout.shard(1, 2)
    rows = shard.num_rows(0)
    values = torch.zeros(rows, 64, dtype=torch.uint8)
    scales = torch.zeros(rows, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"values: expected shape \[{total}, 64\] for layer index 0 .*found \[{rows}, 64\]"):
        EngramTable.from_layout(layout, 0, None, values, scales)
    with pytest.raises(ValueError, match=rf"values: expected shape \[{rows}, 64\] .*rank 1 of 2.*found \[{rows + 1}, 64\]"):
        EngramTable.from_layout(layout, 0, shard, torch.zeros(rows + 1, 64, dtype=torch.uint8), scales)
    with pytest.raises(ValueError, match=rf"values: expected shape \[{rows}, 64\].*found \[{rows}, 32\]"):
        EngramTable.from_layout(layout, 0, shard, torch.zeros(rows, 32, dtype=torch.uint8), scales)
    with pytest.raises(ValueError, match=rf"scales: expected shape \[{rows}, 2\].*found \[{rows}, 1\]"):
        EngramTable.from_layout(layout, 0, shard, values, torch.zeros(rows, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"layer_index: expected an integer in \[0, 2\), found 2"):
        EngramTable.from_layout(layout, 2, shard, values, scales)
    with pytest.raises(ValueError, match="does not belong to this layout"):
        EngramTable.from_layout(layout, 0, LAYOUTS["C10"].shard(1, 2), values, scales)


def test_constructor_and_lookup_errors():
    values = torch.zeros(10, 64, dtype=torch.uint8)
    scales = torch.zeros(10, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="values: expected dtype torch.float8_e4m3fn"):
        EngramTable(values.float(), scales)
    with pytest.raises(ValueError, match=r"scales: expected shape \[10, 2\].*found \[10, 3\]"):
        EngramTable(values, torch.zeros(10, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="values: head_dim must be a positive multiple of 32"):
        EngramTable(torch.zeros(10, 48, dtype=torch.uint8), scales)
    with pytest.raises(ValueError, match=r"placement: unknown placement 'gpu'; available placements: 'cpu', 'device'"):
        EngramTable(values, scales, placement="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="placement 'device' needs a CUDA device"):
            EngramTable(values, scales, placement="device")
    with pytest.raises(ValueError, match="num_rows_total: expected an integer >= 15"):
        EngramTable(values, scales, row_start=5, num_rows_total=14)
    with pytest.raises(ValueError, match="column_end: expected at most num_columns_total = 4, found 5"):
        EngramTable(values, scales, column_end=5, num_columns_total=4)

    table = EngramTable(values, scales, column_start=1, column_end=3, num_columns_total=4)
    assert table.lookup(torch.zeros(2, 4, dtype=torch.int32)).shape == (2, 2, 64)
    with pytest.raises(ValueError, match=r"hash_ids: expected 4 columns \(shape \[T, 4\]\), found shape \[2, 3\]"):
        table.lookup(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="hash_ids: expected dtype torch.int32 or torch.int64, found torch.float32"):
        table.lookup(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"hash_ids: expected shape \[T, C\], found \[8\]"):
        table.lookup(torch.zeros(8, dtype=torch.int64))
    # a shard with unknown total rows only rejects negative ids
    shard = EngramTable(values, scales, row_start=100, column_start=2, column_end=4)
    assert shard.num_rows_total is None
    assert torch.all(shard.lookup(torch.full((3, 4), 10**9)) == 0)
    with pytest.raises(ValueError, match=r"column 3 \(token 0\): id -1 is outside"):
        shard.lookup(torch.tensor([[0, 0, 100, -1]]))


def test_custom_placement_slots_in(rng):
    """A placement registered later is used by name; gather sees only in-range local ids."""
    seen = []

    @register_placement
    class RecordingPlacement(CpuPlacement):
        name = "test-recording"

        def gather(self, local_row_ids):
            seen.append(local_row_ids.clone())
            return super().gather(local_row_ids)

    try:
        assert "test-recording" in available_placements()
        value_bytes, scale_bytes = random_table(rng, 50, 64)
        table = EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes), row_start=10,
                            num_rows_total=100, placement="test-recording", check_values=False)
        assert table.placement == "test-recording"
        hash_ids = rng.integers(0, 100, size=(11, 3))
        out = table.lookup(torch.from_numpy(hash_ids))
        assert np.array_equal(bits_of(out), expected_lookup_bits(value_bytes, scale_bytes, hash_ids, 10, 0, 3))
        assert len(seen) == 1 and seen[0].dtype == torch.int64 and seen[0].shape == (33,)
        assert int(seen[0].min()) >= 0 and int(seen[0].max()) < 50
    finally:
        table_module._PLACEMENTS.pop("test-recording", None)


# ---------------------------------------------------------------------------
# table bytes that do not decode to finite values
# ---------------------------------------------------------------------------
def finite_table(rng: np.random.Generator, rows: int, head_dim: int = 64):
    """Random rows that decode to finite values: no NaN byte, scale bytes 100..140."""
    value_bytes = rng.integers(0, 256, size=(rows, head_dim), dtype=np.uint8)
    value_bytes[(value_bytes & 0x7F) == 0x7F] = 0x40
    return value_bytes, rng.integers(100, 141, size=(rows, head_dim // 32), dtype=np.uint8)


BAD_BYTES = {   # case: (tensor, byte, the message after "<tensor>: row <r> holds ")
    "value 0x7f": ("values", 0x7F, r"value byte 0x7f \(E4M3 NaN\) at column {column}"),
    "value 0xff": ("values", 0xFF, r"value byte 0xff \(E4M3 NaN\) at column {column}"),
    "scale 255": ("scales", 255, r"scale byte 255 \(UE8M0 NaN\) at column {block}"),
    "scale 0xfe": ("scales", 0xFE, r"scale byte 254 \(2\*\*127\) at column {block}, under which values byte 0x40 "
                                   r"\(2\) at column {column} decodes to 2 \* 2\*\*127 >= 2\*\*128"),
}


def poisoned_table(rng: np.random.Generator, case: str, rows: int, head_dim: int = 64):
    """``finite_table`` with the bad byte of ``case`` in one random row; ``(values, scales, expected message)``."""
    value_bytes, scale_bytes = finite_table(rng, rows, head_dim)
    tensor, byte, tail = BAD_BYTES[case]
    row, column = int(rng.integers(0, rows)), int(rng.integers(0, head_dim))
    block = column // 32
    if tensor == "values":
        value_bytes[row, column] = byte
    else:
        if byte != 255:   # the only value of its block that overflows: 2.0 * 2**127
            block_values = value_bytes[row, block * 32:(block + 1) * 32]
            block_values[:] = block_values & 0x87        # exponent field 0: subnormals, finite under any scale
            block_values[column % 32] = 0x40             # 2.0
        scale_bytes[row, block] = byte
    return value_bytes, scale_bytes, f"{tensor}: row {row} holds " + tail.format(column=column, block=block)


@pytest.mark.parametrize("case", list(BAD_BYTES))
def test_a_table_that_does_not_decode_to_finite_values_is_refused(case, rng):
    """EngramTable and from_layout refuse NaN bytes and infinite products, naming the tensor, row and byte,
    before the placement is built; check_values=False takes the bytes as they are."""
    built = []

    @register_placement
    class WatchedPlacement(CpuPlacement):
        name = "test-watched"

        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    try:
        rows = int(rng.integers(2, 300))
        value_bytes, scale_bytes, message = poisoned_table(rng, case, rows)
        for values in (as_values(value_bytes), torch.from_numpy(value_bytes)):
            with pytest.raises(ValueError, match=message):
                EngramTable(values, torch.from_numpy(scale_bytes), placement="test-watched")
        assert not built   # refused before the placement saw the bytes
        if E8M0_DTYPE is not None:
            with pytest.raises(ValueError, match=message):
                EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes).view(E8M0_DTYPE))
        # a shard: the row is the row of the tensor given (its global row is row_start later)
        with pytest.raises(ValueError, match=message):
            EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes), row_start=1000, column_start=2)
        raw = EngramTable(as_values(value_bytes), torch.from_numpy(scale_bytes), placement="test-watched",
                          check_values=False)
        assert built and raw.num_rows == rows
        hash_ids = rng.integers(0, rows, size=(5, 3))
        assert np.array_equal(bits_of(raw.lookup(torch.from_numpy(hash_ids))),
                              expected_lookup_bits(value_bytes, scale_bytes, hash_ids, 0, 0, 3))
    finally:
        table_module._PLACEMENTS.pop("test-watched", None)

    layout = LAYOUTS["C6"]
    total = layout.num_embeddings[0]
    value_bytes, scale_bytes, message = poisoned_table(rng, case, total)
    with pytest.raises(ValueError, match=message):
        EngramTable.from_layout(layout, 0, None, as_values(value_bytes), torch.from_numpy(scale_bytes))
    EngramTable.from_layout(layout, 0, None, as_values(value_bytes), torch.from_numpy(scale_bytes),
                            check_values=False)


def test_the_table_check_scans_in_chunks_and_passes_a_finite_table(rng):
    """A bad row past the first chunk (65,536 rows) is found; packed rows (strided views) are checked without a
    copy of the table; a finite table passes; check_values takes only a bool."""
    from engram.table.host_memory.rows import pack_rows

    rows = (1 << 16) + 300
    value_bytes, scale_bytes = finite_table(rng, rows, 32)
    EngramTable(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes))
    row = int(rng.integers(1 << 16, rows))
    value_bytes[row, 7] = 0xFF
    with pytest.raises(ValueError, match=rf"values: row {row} holds value byte 0xff \(E4M3 NaN\) at column 7"):
        EngramTable(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes))
    packed = pack_rows(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes))
    assert not packed.values.is_contiguous()
    with pytest.raises(ValueError, match=rf"values: row {row} holds value byte 0xff"):
        EngramTable(packed.values, packed.scales)
    for bad in (None, 1, "yes"):
        with pytest.raises(ValueError, match=rf"check_values: expected True or False, found {bad!r}"):
            EngramTable(torch.from_numpy(value_bytes), torch.from_numpy(scale_bytes), check_values=bad)


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_placement_matches_cpu(rng):
    layout = LAYOUTS["C10"]
    shard = layout.shard(1, 3)
    row_start, row_end = shard.row_ranges[1]
    value_bytes, scale_bytes = random_table(rng, row_end - row_start, 96)
    cpu_table = EngramTable.from_layout(layout, 1, shard, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                        check_values=False)
    gpu_table = EngramTable.from_layout(layout, 1, shard, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                        placement="device", check_values=False)
    assert gpu_table.device.type == "cuda" and not gpu_table.validate
    for tokens in (1, 63, 1000):
        hash_ids = torch.from_numpy(random_hash_ids(rng, layout, 1, tokens, anywhere_fraction=0.5))
        expected = cpu_table.lookup(hash_ids)
        found = gpu_table.lookup(hash_ids.cuda().to(torch.int32))
        assert torch.equal(found.cpu().view(torch.int16), expected.view(torch.int16))
        packed = gpu_table.lookup_packed(hash_ids.cuda())
        expected_packed = cpu_table.lookup_packed(hash_ids)
        assert torch.equal(packed[0].cpu().view(torch.uint8), expected_packed[0].view(torch.uint8))
        assert torch.equal(packed[1].cpu(), expected_packed[1])
    with pytest.raises(ValueError, match="hash_ids: expected device cuda"):
        gpu_table.lookup(hash_ids)
    checked = EngramTable.from_layout(layout, 1, shard, as_values(value_bytes), torch.from_numpy(scale_bytes),
                                      placement="device", validate=True, check_values=False)
    bad = hash_ids.cuda().clone()
    bad[0, shard.column_start] = layout.num_embeddings[1]
    with pytest.raises(ValueError, match=rf"column {shard.column_start} \(token 0\)"):
        checked.lookup(bad)
