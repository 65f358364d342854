"""The Triton row-gather kernels (engram.table.kernels.gather / kernels) against lookup_reference.

* ``interpreter`` tests: small shapes, run in their own process with
  ``TRITON_INTERPRET=1`` (``bash scripts/dev.sh test`` does it); on a CUDA machine
  without the interpreter they run on the GPU, bit-exact.
* ``gpu`` tests: T up to 8192, D = 256, a table past 2**31 bytes, CUDA graphs,
  EngramTable dispatch; CUDA only.
* unmarked tests: argument checks, on the CPU.

Tables hold every E4M3 byte (NaN patterns 0x7F/0xFF included) and every finite
scale byte 0..254; hash ids include ids below and above the shard's rows; outputs
are poisoned (bf16 NaN, bytes 0xAA) before each launch and checked in full.
Inputs are fresh random every run; the seed is in each failure message.
"""

from __future__ import annotations

import os

import pytest
import torch

from engram.table import EngramTable, dequantize_rows, lookup_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BF16_MIN_NORMAL = 2.0 ** -126
POISON_BYTE = 0xAA


def _gather_module():
    try:
        from engram.table.kernels import gather
    except ImportError:
        from conftest import missing_dependency
        missing_dependency("triton is not installed (pip install -e '.[triton]')")
    return gather


def _kernel_device() -> str:
    """'cpu' under the interpreter, 'cuda' on a GPU, else skip."""
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("the Triton gather kernel needs TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest -m interpreter) "
                    "or a CUDA device")
    _gather_module()
    return "cpu" if INTERPRET else "cuda"


def _cuda_device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _gather_module()
    return "cuda"


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------
def _random_table(num_rows: int, head_dim: int, generator: torch.Generator, device: str):
    """``(values uint8 [rows, D], scales uint8 [rows, D // 32])``: every one of the 256 E4M3 bytes
    in each run of 256 values, every scale byte 0..254 in each run of 255 scales, shuffled."""
    value_count, scale_count = num_rows * head_dim, num_rows * (head_dim // 32)
    value_bytes = torch.arange(value_count) % 256
    value_bytes = value_bytes[torch.randperm(value_count, generator=generator)].to(torch.uint8)
    scale_bytes = torch.arange(scale_count) % 255
    scale_bytes = scale_bytes[torch.randperm(scale_count, generator=generator)].to(torch.uint8)
    return (value_bytes.reshape(num_rows, head_dim).to(device),
            scale_bytes.reshape(num_rows, head_dim // 32).to(device))


def _random_ids(tokens: int, columns: int, row_start: int, num_rows: int, generator: torch.Generator,
                dtype: torch.dtype, outside_fraction: float = 0.2) -> torch.Tensor:
    """``[T, C]`` global ids: every local row once where ``T * C`` allows, the rest random inside;
    ``outside_fraction`` of them below ``row_start`` or at/after ``row_start + num_rows``."""
    count = tokens * columns
    local = torch.randint(0, num_rows, (count,), generator=generator)
    covered = min(count, num_rows)
    local[torch.randperm(count, generator=generator)[:covered]] = torch.randperm(num_rows, generator=generator)[:covered]
    ids = local + row_start
    outside = torch.rand(count, generator=generator) < outside_fraction
    below = torch.randint(0, max(row_start, 1), (count,), generator=generator)
    above = row_start + num_rows + torch.randint(0, 1000, (count,), generator=generator)
    far = torch.where(torch.rand(count, generator=generator) < 0.5, below, above)
    if row_start == 0:
        far = above
    ids = torch.where(outside, far, ids)
    return ids.reshape(tokens, columns).to(dtype)


def _strided_view(ids: torch.Tensor, layout: str) -> torch.Tensor:
    """The same ids [T, C] as a contiguous tensor, a layer slice of [T, L, C], or column-major."""
    if layout == "contiguous":
        return ids.contiguous()
    if layout == "layer_slice":  # the hasher's [T, L, C] output, one layer taken
        stacked = torch.full((ids.shape[0], 3, ids.shape[1]), -7, dtype=ids.dtype, device=ids.device)
        stacked[:, 1] = ids
        return stacked[:, 1]
    if layout == "column_major":
        return ids.t().contiguous().t()
    raise ValueError(layout)


# ---------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------
def _assert_bf16_equal(found: torch.Tensor, expected: torch.Tensor, seed: int, *, interpret: bool,
                       exact: torch.Tensor | None = None) -> None:
    """NaN exactly where expected; every other element bit-identical on the GPU.

    Under TRITON_INTERPRET=1 within 1 bf16 ulp (same sign), and elements whose exact fp32 value
    ``exact`` is subnormal (0 < |x| < 2**-126) are not compared: the interpreter's fp32 -> bf16
    cast truncates instead of rounding and mis-converts fp32 subnormals (2**-132 comes out 0);
    the fp32 products it computes are right, and the GPU tests check those elements exactly.
    """
    found, expected = found.cpu(), expected.cpu()
    assert found.dtype == torch.bfloat16 and found.shape == expected.shape, f"seed {seed}"
    found_nan, expected_nan = torch.isnan(found), torch.isnan(expected)
    assert torch.equal(found_nan, expected_nan), (
        f"seed {seed}: NaN at {int((found_nan != expected_nan).sum())} wrong places "
        f"(first {torch.nonzero(found_nan != expected_nan)[0].tolist()})")
    found_bits = found.view(torch.int16).to(torch.int32) & 0xFFFF
    expected_bits = expected.view(torch.int16).to(torch.int32) & 0xFFFF
    compared = ~expected_nan
    if interpret:
        magnitude = (expected.float() if exact is None else exact.cpu()).abs()
        compared &= (magnitude >= BF16_MIN_NORMAL) | (magnitude == 0)
        same_sign = (found_bits >> 15) == (expected_bits >> 15)
        close = same_sign & ((found_bits & 0x7FFF) - (expected_bits & 0x7FFF)).abs().le(1)
    else:
        close = found_bits == expected_bits
    bad = compared & ~close
    if bool(bad.any()):
        index = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(f"seed {seed}: {int(bad.sum())} elements differ; first at {index}: "
                             f"found {found[index].item()!r} (0x{int(found_bits[index]):04x}), "
                             f"expected {expected[index].item()!r} (0x{int(expected_bits[index]):04x})")


def _expected_packed(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end):
    """Reference packed rows: the stored bytes of each named row, zeros outside the shard."""
    local = hash_ids[:, column_start:column_end].long() - row_start
    inside = (local >= 0) & (local < value_bytes.shape[0])
    safe = torch.where(inside, local, torch.zeros_like(local))
    values = torch.where(inside[..., None], value_bytes[safe], torch.zeros((), dtype=torch.uint8, device=local.device))
    scales = torch.where(inside[..., None], scale_bytes[safe], torch.zeros((), dtype=torch.uint8, device=local.device))
    return values, scales


def _check_case(gather, device, *, tokens, columns, column_start, column_end, head_dim, num_rows, row_start,
                id_dtype, layout, seed, config=None, interpret=INTERPRET):
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(num_rows, head_dim, generator, device)
    ids = _random_ids(tokens, columns, row_start, num_rows, generator, id_dtype).to(device)
    hash_ids = _strided_view(ids, layout)
    local_columns = column_end - column_start
    expected = lookup_reference(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end)
    expected_values, expected_scales = _expected_packed(value_bytes, scale_bytes, hash_ids, row_start,
                                                        column_start, column_end)
    exact = dequantize_rows(expected_values, expected_scales, torch.float32)  # fp32 products, unrounded

    out = torch.full((tokens, local_columns, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
    returned = gather.gather_rows(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end,
                                  out=out, config=config)
    assert returned is out
    _assert_bf16_equal(out, expected, seed, interpret=interpret, exact=exact)

    out_values = torch.full((tokens, local_columns, head_dim), POISON_BYTE, dtype=torch.uint8, device=device)
    out_scales = torch.full((tokens, local_columns, head_dim // 32), POISON_BYTE, dtype=torch.uint8, device=device)
    gather.gather_rows_packed(value_bytes.view(torch.float8_e4m3fn), scale_bytes, hash_ids, row_start,
                              column_start, column_end, out=(out_values, out_scales), config=config)
    assert torch.equal(out_values, expected_values), f"seed {seed}: packed values differ"
    assert torch.equal(out_scales, expected_scales), f"seed {seed}: packed scales differ"

    # Allocating launchers give the same bytes.
    assert torch.equal(gather.gather_rows_packed(value_bytes, scale_bytes, hash_ids, row_start, column_start,
                                                 column_end, config=config)[0], expected_values)


# ---------------------------------------------------------------------------
# interpreter (CPU) or GPU: small shapes
# ---------------------------------------------------------------------------
# (tokens, columns, column_start, column_end, head_dim, num_rows, row_start)
SMALL_CASES = [
    (1, 3, 0, 3, 256, 40, 0),           # one token, whole layer
    (7, 5, 1, 4, 64, 37, 100),          # shard: columns [1, 4), rows [100, 137)
    (63, 7, 3, 7, 256, 90, 5_000),      # last columns, every row and scale byte read
    (63, 4, 0, 2, 64, 30, 1),           # first columns, row_start 1
    (7, 6, 2, 6, 96, 25, 77),           # D = 96: 3 scale groups (padded to 4)
    (63, 3, 0, 3, 32, 50, 9),           # D = 32: one scale group
]


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: f"T{c[0]}-C{c[1]}[{c[2]}:{c[3]}]-D{c[4]}-r{c[6]}")
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_gather_matches_reference(case, id_dtype, seed):
    device = _kernel_device()
    gather = _gather_module()
    tokens, columns, column_start, column_end, head_dim, num_rows, row_start = case
    layout = ("contiguous", "layer_slice", "column_major")[(tokens + head_dim + id_dtype.itemsize) % 3]
    _check_case(gather, device, tokens=tokens, columns=columns, column_start=column_start, column_end=column_end,
                head_dim=head_dim, num_rows=num_rows, row_start=row_start, id_dtype=id_dtype, layout=layout,
                seed=seed)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("layout", ["layer_slice", "column_major"])
def test_gather_launch_shapes(layout, seed):
    """Blocks smaller than the work (tails), 16-byte vectors, the fp8-converter decode."""
    device = _kernel_device()
    gather = _gather_module()
    configs = [gather.GatherConfig(block_rows=8, num_warps=2),
               gather.GatherConfig(block_rows=16, num_warps=4, vector=16),
               gather.GatherConfig(block_rows=16, num_warps=4, chunk_outer=True, decode="fp8_nan_select"),
               gather.GatherConfig(block_rows=4, num_warps=2, chunk_outer=True, vector=16)]
    configs.append(gather.GatherConfig(block_rows=16, num_warps=4, decode="fp8_nan_select"))
    if not INTERPRET:  # the interpreter's float8e4nv cast knows no E4M3 NaN; the GPU's converter does
        configs.append(gather.GatherConfig(block_rows=16, num_warps=4, decode="fp8"))
    for config in configs:
        seed += 1  # a fresh stream per case, derived from the test's seed
        _check_case(gather, device, tokens=9, columns=5, column_start=1, column_end=5, head_dim=256, num_rows=20,
                    row_start=3, id_dtype=torch.int32, layout=layout, seed=seed, config=config)


@pytest.mark.interpreter
def test_empty_and_single_row(seed):
    device = _kernel_device()
    gather = _gather_module()
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(4, 64, generator, device)
    empty = torch.empty((0, 3), dtype=torch.int32, device=device)
    assert gather.gather_rows(value_bytes, scale_bytes, empty).shape == (0, 3, 64)
    packed = gather.gather_rows_packed(value_bytes, scale_bytes, empty, column_start=1)
    assert packed[0].shape == (0, 2, 64) and packed[1].shape == (0, 2, 2)
    ids = torch.tensor([[2]], dtype=torch.int64, device=device)
    expected = lookup_reference(value_bytes, scale_bytes, ids)
    exact = dequantize_rows(value_bytes[ids], scale_bytes[ids], torch.float32)
    _assert_bf16_equal(gather.gather_rows(value_bytes, scale_bytes, ids), expected, 0, interpret=INTERPRET,
                       exact=exact)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_row_start_past_int32(seed):
    """A shard of a table past 2**31 rows: int64 ids and row_start, ids on both sides of the shard."""
    device = _kernel_device()
    gather = _gather_module()
    _check_case(gather, device, tokens=7, columns=4, column_start=1, column_end=4, head_dim=64, num_rows=21,
                row_start=3_000_000_000, id_dtype=torch.int64, layout="layer_slice", seed=seed)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_misaligned_out_view_after_an_aligned_call(monkeypatch, seed):
    """A given ``out`` that is a misaligned view, after calls of the same structure with aligned
    ones: the launch's variant key differs in that output pointer's alignment alone (a binary
    compiled for 16-byte-aligned stores is not reused for it), and the bytes equal the reference."""
    from engram.triton_launch import CompiledLaunch
    from engram.triton_variants import PreparedVariant

    device = _kernel_device()
    gather = _gather_module()
    keys = []
    original = CompiledLaunch._launch

    def recording(self, grid, variant, args, *options):
        if isinstance(variant, tuple) and len(variant) == 2 and isinstance(variant[0], PreparedVariant):
            full = variant[0].expand(variant[1])
        else:
            full = variant
        keys.append(dict(zip([name for name, *_ in self.rule.rules], full)))
        return original(self, grid, variant, args, *options)

    monkeypatch.setattr(CompiledLaunch, "_launch", recording)
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(30, 64, generator, device)
    hash_ids = _random_ids(5, 3, 0, 30, generator, torch.int32).to(device)
    expected = lookup_reference(value_bytes, scale_bytes, hash_ids)
    expected_values, expected_scales = _expected_packed(value_bytes, scale_bytes, hash_ids, 0, 0, 3)
    exact = dequantize_rows(expected_values, expected_scales, torch.float32)

    shape, count = (5, 3, 64), 5 * 3 * 64
    storage = torch.empty(count + 8, dtype=torch.bfloat16, device=device)
    for out in (storage[:count].view(shape), storage[1:count + 1].view(shape)):  # 16-byte aligned, then 2 bytes off
        out.fill_(float("nan"))
        gather.gather_rows(value_bytes, scale_bytes, hash_ids, out=out)
        _assert_bf16_equal(out, expected, seed, interpret=INTERPRET, exact=exact)
    aligned, misaligned = keys
    assert [name for name in aligned if aligned[name] != misaligned[name]] == ["out_ptr"]
    assert aligned["out_ptr"] == (torch.bfloat16, True) and misaligned["out_ptr"] == (torch.bfloat16, False)

    keys.clear()
    byte_storage = torch.full((2 * count + 64,), POISON_BYTE, dtype=torch.uint8, device=device)
    values_out = byte_storage[:count].view(shape)
    for offset in (count + 16, count + 17):  # the scales output aligned, then 1 byte off
        scales_out = byte_storage[offset:offset + 5 * 3 * 2].view(5, 3, 2)
        values_out.fill_(POISON_BYTE)
        scales_out.fill_(POISON_BYTE)
        gather.gather_rows_packed(value_bytes, scale_bytes, hash_ids, out=(values_out, scales_out))
        assert torch.equal(values_out, expected_values) and torch.equal(scales_out, expected_scales), f"seed {seed}"
    aligned, misaligned = keys
    assert [name for name in aligned if aligned[name] != misaligned[name]] == ["out_scale_ptr"]


# ---------------------------------------------------------------------------
# argument checks (no kernel runs)
# ---------------------------------------------------------------------------
def test_argument_errors():
    gather = _gather_module()
    values = torch.zeros((8, 64), dtype=torch.uint8)
    scales = torch.zeros((8, 2), dtype=torch.uint8)
    ids = torch.zeros((3, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="hash_ids: expected an int32 or int64 tensor"):
        gather.gather_rows(values, scales, ids.float())
    with pytest.raises(ValueError, match="hash_ids: expected an int32 or int64 tensor"):
        gather.gather_rows(values, scales, ids[0])
    with pytest.raises(ValueError, match="scales: expected shape"):
        gather.gather_rows(values, scales[:, :1], ids)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 32"):
        gather.gather_rows(values[:, :48], scales, ids)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        gather.gather_rows(torch.zeros((64, 8), dtype=torch.uint8).t(), scales, ids)
    with pytest.raises(ValueError, match="column_start, column_end"):
        gather.gather_rows(values, scales, ids, column_start=2, column_end=5)
    with pytest.raises(ValueError, match="GatherConfig.decode"):
        gather.GatherConfig(decode="float")
    with pytest.raises(ValueError, match="GatherConfig.block_rows: expected a power of two"):
        gather.GatherConfig(block_rows=12)
    with pytest.raises(ValueError, match="row_start"):
        gather.gather_rows(values, scales, ids, row_start=-1)
    with pytest.raises(ValueError, match="out: expected a contiguous torch.bfloat16 tensor"):
        gather.gather_rows(values, scales, ids, out=torch.empty((3, 4, 64), dtype=torch.float32))
    with pytest.raises(ValueError, match=r"out\[1\]: expected a contiguous torch.uint8 tensor"):
        gather.gather_rows_packed(values, scales, ids, out=(torch.empty((3, 4, 64), dtype=torch.uint8),
                                                            torch.empty((3, 4, 3), dtype=torch.uint8)))


# ---------------------------------------------------------------------------
# GPU: the full sweep, large tables, graphs, dispatch
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 63, 1024, 8192])
@pytest.mark.parametrize("shard", ["whole", "middle", "last"])
def test_gpu_sweep_bit_exact(tokens, shard, seed):
    device = _cuda_device()
    gather = _gather_module()
    columns, head_dim = 24, 256
    column_start, column_end, row_start = {"whole": (0, 24, 0), "middle": (6, 12, 70_001),
                                           "last": (18, 24, 123_457)}[shard]
    for id_dtype, layout in ((torch.int32, "layer_slice"), (torch.int64, "contiguous")):
        seed += 1  # a fresh stream per case, derived from the test's seed
        _check_case(gather, device, tokens=tokens, columns=columns, column_start=column_start,
                    column_end=column_end, head_dim=head_dim, num_rows=50_000, row_start=row_start,
                    id_dtype=id_dtype, layout=layout, seed=seed, interpret=False)


@pytest.mark.gpu
def test_gpu_launch_shapes_bit_exact(seed):
    """Every launch shape the benchmark sweeps gives the same bits."""
    device = _cuda_device()
    gather = _gather_module()
    configs = [gather.GatherConfig(block_rows=rows, num_warps=warps, vector=vector, decode=decode,
                                   chunk_outer=chunk_outer)
               for rows, warps, vector, decode, chunk_outer in (
                   (4, 1, 8, "integer", False), (8, 2, 16, "integer", False), (16, 4, 8, "fp8", False),
                   (32, 8, 16, "fp8", False), (64, 8, 8, "fp8_nan_select", False), (16, 4, 16, "fp8_nan_select", False),
                   (16, 4, 8, "fp8", True), (32, 4, 8, "integer", True), (64, 8, 8, "fp8", True),
                   (16, 2, 8, "fp8", True))]
    for config in configs:
        seed += 1  # a fresh stream per case, derived from the test's seed
        _check_case(gather, device, tokens=300, columns=24, column_start=3, column_end=21, head_dim=256,
                    num_rows=9_000, row_start=500, id_dtype=torch.int32, layout="layer_slice", seed=seed,
                    config=config, interpret=False)


@pytest.mark.gpu
def test_gpu_table_past_int32_offsets(seed):
    """A table of 8.5M rows x 256 B (2.2 GB): row offsets past 2**31 bytes need int64 arithmetic."""
    device = _cuda_device()
    gather = _gather_module()
    generator = torch.Generator().manual_seed(seed)
    num_rows, head_dim, tokens, columns = 8_500_000, 256, 512, 24
    value_bytes = torch.empty((num_rows, head_dim), dtype=torch.uint8, device=device)
    scale_bytes = torch.empty((num_rows, head_dim // 32), dtype=torch.uint8, device=device)
    # ids near the end of the table (offsets > 2**31) and a few anywhere
    local = num_rows - 1 - torch.randint(0, 200_000, (tokens, columns), generator=generator)
    local[::7] = torch.randint(0, num_rows, local[::7].shape, generator=generator)
    rows = torch.unique(local.flatten()).to(device)
    value_bytes[rows] = torch.randint(0, 256, (rows.numel(), head_dim), generator=generator,
                                      dtype=torch.uint8).to(device)
    scale_bytes[rows] = torch.randint(100, 150, (rows.numel(), head_dim // 32), generator=generator,
                                      dtype=torch.uint8).to(device)
    hash_ids = (local + 1000).to(torch.int32).to(device)
    expected = lookup_reference(value_bytes, scale_bytes, hash_ids, row_start=1000)
    _assert_bf16_equal(gather.gather_rows(value_bytes, scale_bytes, hash_ids, row_start=1000), expected, seed,
                       interpret=False)
    packed_values, _ = gather.gather_rows_packed(value_bytes, scale_bytes, hash_ids, row_start=1000)
    assert torch.equal(packed_values, value_bytes[local.to(device)]), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(seed):
    """Capture both launchers once; new ids copied into the captured input give the new rows."""
    device = _cuda_device()
    gather = _gather_module()
    generator = torch.Generator().manual_seed(seed)
    num_rows, row_start, tokens = 20_000, 4_000, 256
    value_bytes, scale_bytes = _random_table(num_rows, 256, generator, device)
    static_ids = torch.full((tokens, 2, 24), -1, dtype=torch.int32, device=device)
    layer_ids = static_ids[:, 1]

    def launch():
        rows = gather.gather_rows(value_bytes, scale_bytes, layer_ids, row_start, 4, 20)
        packed = gather.gather_rows_packed(value_bytes, scale_bytes, layer_ids, row_start, 4, 20)
        return rows, packed

    static_ids[:, 1] = _random_ids(tokens, 24, row_start, num_rows, generator, torch.int32).to(device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, (packed_values, packed_scales) = launch()
    for _ in range(3):
        new_ids = _random_ids(tokens, 24, row_start, num_rows, generator, torch.int32).to(device)
        static_ids[:, 1].copy_(new_ids)
        rows.fill_(float("nan"))
        packed_values.fill_(POISON_BYTE)
        graph.replay()
        torch.cuda.synchronize()
        expected = lookup_reference(value_bytes, scale_bytes, new_ids, row_start, 4, 20)
        _assert_bf16_equal(rows, expected, seed, interpret=False)
        expected_values, expected_scales = _expected_packed(value_bytes, scale_bytes, new_ids, row_start, 4, 20)
        assert torch.equal(packed_values, expected_values) and torch.equal(packed_scales, expected_scales), \
            f"seed {seed}"


@pytest.mark.gpu
def test_gpu_engram_table_dispatch(monkeypatch, seed):
    """A device table's lookups run the Triton kernel; backend='torch' gives the same bits."""
    device = _cuda_device()
    gather = _gather_module()
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(5_000, 256, generator, "cpu")
    table = EngramTable(value_bytes.view(torch.float8_e4m3fn), scale_bytes, column_start=6, column_end=12,
                        row_start=1_000, num_columns_total=24, num_rows_total=10_000, placement="device",
                        check_values=False)  # every byte, NaN and infinite products included
    ids = _random_ids(100, 24, 1_000, 5_000, generator, torch.int64).to(device)
    calls = []
    original = gather.gather_rows

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gather, "gather_rows", counting)
    found = table.lookup(ids)
    assert calls, "the device table did not use the Triton kernel"
    packed_values, packed_scales = table.lookup_packed(ids)
    assert packed_values.dtype == torch.float8_e4m3fn and packed_scales.dtype == torch.uint8
    assert table.backend == "triton"
    torch_table = EngramTable(value_bytes.view(torch.float8_e4m3fn), scale_bytes, column_start=6, column_end=12,
                              row_start=1_000, num_columns_total=24, num_rows_total=10_000, placement="device",
                              backend="torch", check_values=False)
    assert torch_table.backend == "torch"
    torch_rows = torch_table.lookup(ids)
    torch_values, torch_scales = torch_table.lookup_packed(ids)
    assert len(calls) == 1
    _assert_bf16_equal(found, torch_rows, seed, interpret=False)
    assert torch.equal(packed_values.view(torch.uint8), torch_values.view(torch.uint8))
    assert torch.equal(packed_scales, torch_scales)
