"""Host-side checks of a batch's metadata before the hasher touches any state.

Each failure raises ``ValueError`` naming the argument, the offending index and
value, and what was expected. Checks copy metadata to the CPU, so on a GPU they
cost a sync: the hasher runs them by default only for CPU inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Token indices and positions are int32 in the hash kernel.
MAX_POSITION = 2**31 - 1

__all__ = ["BatchMetadata", "validate_batch"]


@dataclass
class BatchMetadata:
    """The tensors of one hasher call (all on the hasher's device)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    dead_mask: torch.Tensor | None
    lookback_token_ids: torch.Tensor | None
    lookback_dead_mask: torch.Tensor | None
    slot_mapping: torch.Tensor | None
    block_table: torch.Tensor | None
    request_rows: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_requests(self) -> int:
        return self.query_start_loc.shape[0] - 1


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


_INTEGER_DTYPES = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
_TENSOR_FIELDS = ("input_ids", "positions", "query_start_loc", "dead_mask", "lookback_token_ids",
                  "lookback_dead_mask", "slot_mapping", "block_table", "request_rows")


def _check_integer(name: str, tensor: torch.Tensor, shape: tuple[int, ...] | None, ndim: int | None = None) -> None:
    if tensor.dtype not in _INTEGER_DTYPES:
        raise ValueError(f"{name}: expected an integer tensor, found dtype {tensor.dtype}")
    if shape is not None and tensor.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, found {list(tensor.shape)}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, found shape {list(tensor.shape)}")


def _check_bool(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tensor.dtype != torch.bool:
        raise ValueError(f"{name}: expected a bool tensor, found dtype {tensor.dtype}")
    if tensor.shape != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, found {list(tensor.shape)}")


def check_shapes(batch: BatchMetadata, history_length: int, device_index: int = -1,
                 device: torch.device | None = None) -> None:
    """Dtypes, shapes and devices (no sync), on every call: what the kernels index by
    must have the shape they assume, so that no value can take a read out of bounds.
    ``device_index``: the hasher's CUDA device index, -1 for the CPU."""
    for name in _TENSOR_FIELDS:
        value = getattr(batch, name)
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, found {type(value).__module__}.{type(value).__qualname__}"
                             f" (convert it with torch.as_tensor)")
    input_ids = batch.input_ids
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids: expected a 1-D tensor [T], found shape {list(input_ids.shape)}")
    num_tokens = input_ids.shape[0]
    if num_tokens > MAX_POSITION:
        raise ValueError(f"input_ids: {num_tokens} tokens exceed {MAX_POSITION} "
                         "(the hash kernel indexes batch tokens in int32)")
    for name in _TENSOR_FIELDS:
        tensor = getattr(batch, name)
        if tensor is not None and (tensor.get_device() != device_index if device_index >= 0 else not tensor.is_cpu):
            raise ValueError(f"{name}: expected a tensor on {device}, found one on {tensor.device}")
    _check_integer("input_ids", input_ids, None, 1)
    _check_integer("positions", batch.positions, (num_tokens,))
    _check_integer("query_start_loc", batch.query_start_loc, None, 1)
    if batch.query_start_loc.shape[0] < 1:
        raise ValueError("query_start_loc: expected R + 1 >= 1 entries, found 0")
    num_requests = batch.query_start_loc.shape[0] - 1
    if batch.dead_mask is not None:
        _check_bool("dead_mask", batch.dead_mask, (num_tokens,))
    if batch.lookback_token_ids is not None:
        _check_integer("lookback_token_ids", batch.lookback_token_ids, (num_requests, history_length))
    if batch.lookback_dead_mask is not None:
        if batch.lookback_token_ids is None:
            raise ValueError("lookback_dead_mask: given without lookback_token_ids")
        _check_bool("lookback_dead_mask", batch.lookback_dead_mask, (num_requests, history_length))
    if batch.slot_mapping is not None:
        _check_integer("slot_mapping", batch.slot_mapping, (num_tokens,))
    if batch.block_table is not None:
        _check_integer("block_table", batch.block_table, None, 2)
        if batch.block_table.shape[0] < num_requests:
            raise ValueError(
                f"block_table: expected one row per request (>= {num_requests} rows), found shape {list(batch.block_table.shape)}"
            )
        if batch.block_table.shape[1] < 1:
            raise ValueError(f"block_table: expected at least one block per row, found shape {list(batch.block_table.shape)}")
    if batch.request_rows is not None:
        _check_integer("request_rows", batch.request_rows, (num_requests,))


def _check_slots_follow_block_table(slots: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                                    token_request: torch.Tensor, num_requests: int, block_size: int) -> None:
    """Every token with a slot (``slot_mapping[t] >= 0``) and a block-table entry for its
    position ``p`` (request ``r``) must write ``block_table[r, p // B] * B + p % B``: a slot
    that disagrees would overwrite another request's history. All int64 ``[T]`` / ``[R, W]``."""
    block_index = positions // block_size
    has_both = (slots >= 0) & (token_request < num_requests) & (block_index < table.shape[1])
    tokens = has_both.nonzero().flatten()
    if tokens.numel() == 0:
        return
    requests, indices = token_request[tokens], block_index[tokens]
    expected = table[requests, indices] * block_size + positions[tokens] % block_size
    wrong = (slots[tokens] != expected).nonzero().flatten()
    if wrong.numel():
        j = int(wrong[0])
        t, k, index = int(tokens[j]), int(requests[j]), int(indices[j])
        raise ValueError(
            f"slot_mapping[{t}] = {int(slots[t])} disagrees with block_table: token {t} (request {k}, position "
            f"{int(positions[t])}) is slot {int(expected[j])} = block_table[{k}, {index}] = {int(table[k, index])} "
            f"* block_size {block_size} + {int(positions[t]) % block_size}; a slot the block table does not give "
            f"would overwrite another request's history"
        )


def validate_batch(
    batch: BatchMetadata,
    *,
    token_vocab_size: int,
    history_length: int,
    num_slots: int | None,
    block_size: int | None,
    max_requests: int | None,
    fused_slot_write: bool = False,
) -> None:
    """Full checks of values (copies metadata to the host)."""
    input_ids = batch.input_ids.cpu().long()
    positions = batch.positions.cpu().long()
    starts = batch.query_start_loc.cpu().long()
    num_tokens, num_requests = batch.num_tokens, batch.num_requests

    bad = (input_ids < 0) | (input_ids >= token_vocab_size)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"input_ids[{i}] = {int(input_ids[i])} is outside the tokenizer's range [0, {token_vocab_size})")
    if starts[0] != 0:
        raise ValueError(f"query_start_loc[0] = {int(starts[0])}: expected 0")
    steps = starts[1:] - starts[:-1]
    if (steps < 0).any():
        k = _first(steps < 0)
        raise ValueError(
            f"query_start_loc is not monotone: query_start_loc[{k + 1}] = {int(starts[k + 1])} < "
            f"query_start_loc[{k}] = {int(starts[k])}"
        )
    if starts[-1] > num_tokens:
        raise ValueError(f"query_start_loc[-1] = {int(starts[-1])} exceeds the {num_tokens} tokens of input_ids")
    if (positions < 0).any():
        i = _first(positions < 0)
        raise ValueError(f"positions[{i}] = {int(positions[i])} is negative")
    if (positions > MAX_POSITION).any():
        i = _first(positions > MAX_POSITION)
        raise ValueError(f"positions[{i}] = {int(positions[i])} exceeds {MAX_POSITION} "
                         "(the hash kernel computes positions in int32)")

    # Inside a request positions go up by exactly one per token: the hash reads a token's
    # history at the tokens before it, and the request history stores one token per position
    # (a token tree's drafts share or skip positions).
    token_request = torch.searchsorted(starts[1:], torch.arange(num_tokens), right=True)
    follows = torch.zeros(num_tokens, dtype=torch.bool)
    if num_tokens > 1:
        follows[1:] = token_request[1:] == token_request[:-1]
    follows &= token_request < num_requests
    jumps = follows.clone()
    jumps[1:] &= positions[1:] != positions[:-1] + 1
    if jumps.any():
        i = _first(jumps)
        k = int(token_request[i])
        direction = ("repeats" if positions[i] == positions[i - 1] else
                     "goes backwards" if positions[i] < positions[i - 1] else "skips")
        raise ValueError(
            f"positions {direction} inside request {k}: positions[{i - 1}] = {int(positions[i - 1])}, "
            f"positions[{i}] = {int(positions[i])} (expected {int(positions[i - 1]) + 1}); each request's tokens "
            f"must be at consecutive positions (token-tree drafts are not supported: pass one branch)"
        )

    if batch.lookback_token_ids is not None:
        lookback = batch.lookback_token_ids.cpu().long()
        bad = (lookback < -1) | (lookback >= token_vocab_size)
        if bad.any():
            k, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"lookback_token_ids[{k}, {j}] = {int(lookback[k, j])}: expected a token id in "
                f"[0, {token_vocab_size}) or -1 (unknown)"
            )

    if batch.slot_mapping is not None:
        if num_slots is None:
            raise ValueError("slot_mapping: given, but no slot cache is bound (call bind_slot_cache first)")
        slots = batch.slot_mapping.cpu().long()
        bad = (slots < -1) | (slots >= num_slots)
        if bad.any():
            i = _first(bad)
            raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is beyond the bound cache of {num_slots} slots (-1 = no slot)")
        tokens = (slots >= 0).nonzero().flatten()
        ordered, order = slots[tokens].sort(stable=True)
        repeats = (ordered[1:] == ordered[:-1]).nonzero().flatten()
        if repeats.numel():
            j = int(repeats[0])
            first, second = int(tokens[order[j]]), int(tokens[order[j + 1]])
            first, second = min(first, second), max(first, second)
            raise ValueError(f"slot_mapping[{second}] = {int(slots[second])} is also slot_mapping[{first}]: a slot "
                             f"appears twice in one batch (each token writes its own KV slot)")

    if batch.block_table is not None:
        if num_slots is None or block_size is None:
            raise ValueError("block_table: given, but no slot cache is bound (call bind_slot_cache first)")
        table = batch.block_table.cpu().long()[:num_requests]
        num_blocks = num_slots // block_size
        written = {}
        if batch.slot_mapping is not None and fused_slot_write:
            written = {int(slot): i for i, slot in enumerate(batch.slot_mapping.cpu().tolist()) if slot >= 0}
        lookback = batch.lookback_token_ids.cpu() if batch.lookback_token_ids is not None else None
        # Only the blocks holding the N-1 positions before each request are read.
        for k in range(num_requests):
            if starts[k + 1] == starts[k]:
                continue
            first = int(positions[starts[k]])
            for position in range(max(0, first - history_length), first):
                if lookback is not None and int(lookback[k, first - 1 - position]) >= 0:
                    continue  # known from the lookback window: the cache is not read
                index = position // block_size
                if index >= table.shape[1]:
                    raise ValueError(
                        f"block_table[{k}] has {table.shape[1]} blocks; position {position} needs block index {index}"
                    )
                block = int(table[k, index])
                if not 0 <= block < num_blocks:
                    raise ValueError(
                        f"block_table[{k}, {index}] = {block} (the block of position {position}, history of request "
                        f"{k}): expected a block id in [0, {num_blocks}) of the bound cache"
                    )
                slot = block * block_size + position % block_size
                if slot in written:
                    # With fused_write one launch reads and writes the cache: history must be older.
                    raise ValueError(
                        f"block_table[{k}]: position {position} (history of request {k}) is slot {slot}, which this "
                        f"batch writes (slot_mapping[{written[slot]}]); a cache bound with fused_write=True needs "
                        f"history from earlier steps"
                    )

    if batch.slot_mapping is not None and batch.block_table is not None:
        _check_slots_follow_block_table(batch.slot_mapping.cpu().long(), batch.block_table.cpu().long()[:num_requests],
                                        positions, token_request, num_requests, block_size)

    if batch.request_rows is not None:
        if max_requests is None:
            raise ValueError("request_rows: given, but no request history is bound (call bind_request_history first)")
        rows = batch.request_rows.cpu().long()
        bad = (rows < 0) | (rows >= max_requests)
        if bad.any():
            k = _first(bad)
            raise ValueError(f"request_rows[{k}] = {int(rows[k])} is outside the bound history of {max_requests} rows")
        if rows.unique().numel() != rows.numel():
            raise ValueError(f"request_rows: a row appears twice in one batch: {rows.tolist()}")
