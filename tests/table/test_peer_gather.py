"""The peer gather (engram.table.kernels.peer_gather): a table whose rows are split over packed shards,
read through a pointer table, equals the one-table gather of the same rows.

* unmarked tests: :class:`PeerShards`' and the launchers' argument errors, :func:`shard_rows`;
* ``interpreter`` tests (``TRITON_INTERPRET=1``; on a GPU without it they run there): 1, 3 and 4 shards
  (shards with no rows included), T = 0, 1, 63, D = 32, 96, 256, column slices, ``row_start > 0``,
  int32/int64 and strided ids, ids outside the table: bf16 rows bit-identical to the device gather's
  kernel over the concatenated shards and within the interpreter's tolerance of ``lookup_reference``,
  packed bytes equal to ``peer_lookup_reference``; outputs poisoned, every access bounds-checked
  (the kernel may touch only its arguments and the shards);
* ``gpu`` tests: ``N`` shards allocated on one GPU (the kernel cannot tell them from peers' memory),
  T = 8192, D = 256, bit-identical to the device gather, and inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

from engram.table import dequantize_rows
from engram.table.host_memory.rows import packed_row_bytes
from engram.table.kernels.reference import peer_lookup_reference
from test_gather_kernel import POISON_BYTE, _assert_bf16_equal, _random_ids, _random_table, _strided_view

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _modules():
    try:
        from engram.table.kernels import gather, peer_gather
    except ImportError:
        from conftest import missing_dependency
        missing_dependency("triton is not installed (pip install -e '.[triton]')")
    return gather, peer_gather


def _kernel_device() -> str:
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("the peer gather kernel needs TRITON_INTERPRET=1 or a CUDA device")
    _modules()
    return "cpu" if INTERPRET else "cuda"


def _split(value_bytes: torch.Tensor, scale_bytes: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """The table's rows packed and split into ``num_shards`` separately allocated shards."""
    from engram.table.kernels.peer_gather import shard_rows

    num_rows, head_dim = value_bytes.shape
    groups = head_dim // 32
    shards = []
    for shard in range(num_shards):
        start, end = shard_rows(num_rows, num_shards, shard)
        packed = torch.full((end - start, packed_row_bytes(head_dim)), POISON_BYTE, dtype=torch.uint8,
                            device=value_bytes.device)  # the padding after the scales is never read
        packed[:, :head_dim] = value_bytes[start:end]
        packed[:, head_dim:head_dim + groups] = scale_bytes[start:end]
        shards.append(packed)
    return shards


# ---------------------------------------------------------------------------
# argument errors (plain torch)
# ---------------------------------------------------------------------------
def test_shard_rows_cover_the_table_once():
    from engram.table.kernels.peer_gather import shard_rows

    for num_rows in (1, 2, 7, 96, 97):
        for num_shards in (1, 2, 3, 4, 8):
            spans = [shard_rows(num_rows, num_shards, s) for s in range(num_shards)]
            covered = [row for start, end in spans for row in range(start, end)]
            assert covered == list(range(num_rows)), (num_rows, num_shards, spans)


def test_peer_shards_argument_errors():
    _, peer_gather = _modules()
    row_bytes = packed_row_bytes(64)
    good = [torch.zeros(5, row_bytes, dtype=torch.uint8), torch.zeros(4, row_bytes, dtype=torch.uint8)]
    peer = peer_gather.PeerShards(good, 9, 64, "cpu")
    assert peer.rows_per_shard == 5 and peer.bases.tolist() == [t.data_ptr() for t in good]
    with pytest.raises(ValueError, match="shards: expected at least one shard"):
        peer_gather.PeerShards([], 9, 64, "cpu")
    with pytest.raises(ValueError, match=r"shards\[1\]: expected uint8 \[4, 80\] \(rows \[5, 9\) of 9 over 2"):
        peer_gather.PeerShards([good[0], torch.zeros(5, row_bytes, dtype=torch.uint8)], 9, 64, "cpu")
    with pytest.raises(ValueError, match=r"shards\[0\]: expected a contiguous, 16-byte aligned tensor"):
        peer_gather.PeerShards([torch.zeros(5, row_bytes + 1, dtype=torch.uint8)[:, 1:], good[1]], 9, 64, "cpu")
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 32, found 48"):
        peer_gather.PeerShards(good, 9, 48, "cpu")
    with pytest.raises(ValueError, match=r"num_rows: expected fewer than 2\*\*31 rows"):
        peer_gather.PeerShards(good, 2**31, 64, "cpu")
    with pytest.raises(ValueError, match="num_rows: expected a positive integer, found 0"):
        peer_gather.PeerShards(good, 0, 64, "cpu")
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"hash_ids: expected an int32 or int64 tensor \[T, C\], found torch.float32"):
        peer_gather.peer_gather_rows(peer, ids.float())
    with pytest.raises(ValueError, match=r"column_start, column_end: expected 0 <= 1 < 5 <= 2"):
        peer_gather.peer_gather_rows(peer, ids, 0, 1, 5)
    with pytest.raises(ValueError, match="row_start: expected an integer >= 0, found -2"):
        peer_gather.peer_gather_rows_packed(peer, ids, -2)
    with pytest.raises(ValueError, match=r"out: expected a contiguous torch.bfloat16 tensor \[3, 2, 64\]"):
        peer_gather.peer_gather_rows(peer, ids, out=torch.empty(3, 2, 64))
    with pytest.raises(ValueError, match="out: expected a pair"):
        peer_gather.peer_gather_rows_packed(peer, ids, out=torch.empty(3, 2, 64))


# ---------------------------------------------------------------------------
# the kernels, small shapes (interpreter, or a GPU)
# ---------------------------------------------------------------------------
# (tokens, columns, column_start, column_end, head_dim, num_rows, row_start, shards)
CASES = [
    (1, 3, 0, 3, 256, 40, 0, 3),        # one token, whole layer
    (0, 3, 0, 3, 64, 20, 0, 2),         # no token
    (7, 5, 1, 4, 64, 37, 100, 4),       # columns [1, 4), rows [100, 137), 37 rows over 4 shards
    (63, 7, 3, 7, 96, 90, 5_000, 3),    # D = 96: 3 scale groups (padded to 4)
    (63, 3, 0, 3, 32, 50, 9, 1),        # D = 32, one shard
    (9, 4, 0, 4, 64, 3, 0, 4),          # fewer rows than shards: the last shard holds none
]


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-C{c[1]}[{c[2]}:{c[3]}]-D{c[4]}-r{c[6]}-W{c[7]}")
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_peer_gather_equals_the_one_table_gather(case, id_dtype, seed):
    from interpreter_bounds import bounds_checked

    device = _kernel_device()
    gather, peer_gather = _modules()
    tokens, columns, column_start, column_end, head_dim, num_rows, row_start, num_shards = case
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(num_rows, head_dim, generator, device)
    layout = ("contiguous", "layer_slice", "column_major")[(tokens + head_dim + id_dtype.itemsize) % 3]
    hash_ids = _strided_view(_random_ids(tokens, columns, row_start, num_rows, generator, id_dtype).to(device), layout)
    shards = _split(value_bytes, scale_bytes, num_shards)
    peer = peer_gather.PeerShards(shards, num_rows, head_dim, device)
    local_columns = column_end - column_start
    expected = gather.gather_rows(value_bytes, scale_bytes, hash_ids, row_start, column_start, column_end)
    reference, (reference_values, reference_scales) = peer_lookup_reference(
        shards, head_dim, hash_ids, row_start, column_start, column_end)
    with bounds_checked(reachable=shards) if device == "cpu" else _no_check() as memory:
        out = torch.full((tokens, local_columns, head_dim), float("nan"), dtype=torch.bfloat16, device=device)
        assert peer_gather.peer_gather_rows(peer, hash_ids, row_start, column_start, column_end, out=out) is out
        out_values = torch.full((tokens, local_columns, head_dim), POISON_BYTE, dtype=torch.uint8, device=device)
        out_scales = torch.full((tokens, local_columns, head_dim // 32), POISON_BYTE, dtype=torch.uint8, device=device)
        returned = peer_gather.peer_gather_rows_packed(peer, hash_ids, row_start, column_start, column_end,
                                                       out=(out_values, out_scales))
        fresh = peer_gather.peer_gather_rows(peer, hash_ids, row_start, column_start, column_end)  # allocating
    assert returned[0] is out_values and returned[1] is out_scales
    # The same decode as the one-table kernel: the same bits, under the interpreter too.
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"seed {seed}"
    assert torch.equal(fresh.view(torch.int16), out.view(torch.int16)), f"seed {seed}"
    exact = dequantize_rows(reference_values, reference_scales, torch.float32)  # fp32 products, unrounded
    _assert_bf16_equal(out, reference, seed, interpret=INTERPRET, exact=exact)
    assert torch.equal(out_values.cpu(), reference_values) and torch.equal(out_scales.cpu(), reference_scales), \
        f"seed {seed}: packed rows differ"
    if device == "cpu" and tokens:
        assert memory.accesses > 0


class _no_check:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_peer_gather_reads_only_through_the_pointer_table(seed):
    """Shards refilled in place are read as they are now (no copy taken at setup), and a pointer table
    whose shard is swapped for other memory reads that memory: the kernel follows the addresses."""
    device = _kernel_device()
    _, peer_gather = _modules()
    generator = torch.Generator().manual_seed(seed)
    value_bytes, scale_bytes = _random_table(30, 64, generator, device)
    shards = _split(value_bytes, scale_bytes, 3)
    peer = peer_gather.PeerShards(shards, 30, 64, device)
    ids = torch.arange(30, device=device).view(10, 3)
    before = peer_gather.peer_gather_rows_packed(peer, ids)
    other_values, other_scales = _random_table(30, 64, generator, device)
    replacement = _split(other_values, other_scales, 3)
    shards[1].copy_(replacement[1])
    after = peer_gather.peer_gather_rows_packed(peer, ids)
    start, end = 10, 20
    flat_before, flat_after = before[0].view(30, 64), after[0].view(30, 64)
    assert torch.equal(flat_after[start:end], other_values[start:end])
    assert torch.equal(flat_after[:start], flat_before[:start]) and torch.equal(flat_after[end:], flat_before[end:])


# ---------------------------------------------------------------------------
# GPU: one GPU's memory split into shards (what a peer's HBM looks like to the kernel)
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("num_shards", [2, 8])
def test_gpu_peer_gather_equals_the_device_gather_at_8192_tokens(num_shards, seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gather, peer_gather = _modules()
    generator = torch.Generator().manual_seed(seed)
    num_rows, head_dim = 100_003, 256
    value_bytes, scale_bytes = _random_table(num_rows, head_dim, generator, "cuda")
    shards = _split(value_bytes, scale_bytes, num_shards)
    peer = peer_gather.PeerShards(shards, num_rows, head_dim, "cuda")
    ids = _random_ids(8192, 2, 7, num_rows, generator, torch.int64).cuda()
    hash_ids = _strided_view(ids, "layer_slice")
    expected = gather.gather_rows(value_bytes, scale_bytes, hash_ids, 7)
    found = peer_gather.peer_gather_rows(peer, hash_ids, 7)
    assert torch.equal(found.view(torch.int16), expected.view(torch.int16)), f"seed {seed}"
    packed = peer_gather.peer_gather_rows_packed(peer, hash_ids, 7)
    expected_packed = gather.gather_rows_packed(value_bytes, scale_bytes, hash_ids, 7)
    assert torch.equal(packed[0], expected_packed[0]) and torch.equal(packed[1], expected_packed[1])
    # Captured in a CUDA graph and replayed on new ids of the same buffer.
    out = torch.full_like(found, float("nan"))
    peer_gather.peer_gather_rows(peer, hash_ids, 7, out=out)  # warm (compiled) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer_gather.peer_gather_rows(peer, hash_ids, 7, out=out)
    hash_ids.copy_(_random_ids(8192, 2, 7, num_rows, generator, torch.int64).cuda())  # new ids, same buffer
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = gather.gather_rows(value_bytes, scale_bytes, hash_ids, 7)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"seed {seed}"

