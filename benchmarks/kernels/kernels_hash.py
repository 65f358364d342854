"""Hash benchmark (GPU): the Triton kernel against the torch path of NgramHasher,
V4.1-Flash geometry (2 layers x 24 columns), history from the slot cache.

Each call is captured in a CUDA graph and its replays are timed, as an engine
runs its decode steps; eager times are reported beside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.testing

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent  # common.py, real_text.py, results/
sys.path[:0] = [str(HERE), str(BENCHMARKS), str(BENCHMARKS.parent / "src")]

import engram  # noqa: E402
from common import captured_graph  # noqa: E402

CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"
BLOCK_SIZE = 16
HISTORY_START = 4096  # every request continues a sequence of this many tokens


def _random_vocab(spec) -> engram.TokenCompressor:
    rng = np.random.default_rng(0)
    token_map = np.concatenate([np.arange(spec.compressed_vocab_size),
                                rng.integers(0, spec.compressed_vocab_size, 129280 - spec.compressed_vocab_size)])
    _, first, inverse = np.unique(token_map, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first)] = np.arange(len(first))
    return engram.TokenCompressor(rank[inverse].astype(np.int32))


def _time(function, graph: bool, flush: bool = True) -> float:
    """Median microseconds of ``function`` (eager) or of replaying its CUDA graph; with
    ``flush`` (do_bench's default) the L2 is cleared before each run, as the rest of a
    model's step would leave it, else back-to-back replays with a warm L2."""
    if graph and not flush:
        return triton.testing.do_bench_cudagraph(function, rep=200, return_mode="median") * 1e3
    if graph:
        replay = captured_graph(function)[0].replay
        return triton.testing.do_bench(replay, warmup=25, rep=200, return_mode="median") * 1e3
    return triton.testing.do_bench(function, warmup=25, rep=200, return_mode="median") * 1e3


# (name, backend, fused_write, request history bound too)
VARIANTS = (("triton", "triton", False, False), ("torch", "torch", False, False),
            ("triton_fused", "triton", True, False), ("triton_history", "triton", False, True))


def hash_call(layout, vocab, num_tokens: int, rng, backend: str = "triton", fused: bool = False,
              with_history: bool = False):
    """A hasher and a batch of ``num_tokens`` on the GPU, as the benchmarks time them:
    64 requests (fewer at small T), each continuing a 4096-token sequence whose history
    is in the slot cache (and the request history bound too, with ``with_history``).
    Returns the call that hashes the batch."""
    num_requests = min(num_tokens, 64)
    counts = [num_tokens // num_requests] * num_requests
    counts[-1] += num_tokens - sum(counts)
    blocks_per_request = (HISTORY_START + max(counts)) // BLOCK_SIZE + 1
    hasher = engram.NgramHasher(layout, vocab, device="cuda", validate=False, backend=backend)
    hasher.bind_slot_cache(num_requests * blocks_per_request * BLOCK_SIZE, BLOCK_SIZE, fused_write=fused)
    rows = None
    if with_history:
        hasher.bind_request_history(num_requests)
        rows = hasher.request_rows(range(num_requests))
    table = torch.from_numpy(rng.permutation(num_requests * blocks_per_request).astype(np.int32))
    table = table.reshape(num_requests, blocks_per_request).cuda()
    hasher.slot_cache.values[:-1] = torch.randint(0, layout.spec.compressed_vocab_size, (hasher.slot_cache.num_slots,),
                                                  dtype=torch.int32, device="cuda")
    request_of_token = torch.repeat_interleave(torch.arange(num_requests), torch.tensor(counts)).cuda()
    starts = torch.zeros(num_requests + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(counts), 0)
    starts = starts.cuda()
    positions = HISTORY_START + torch.arange(num_tokens, device="cuda") - starts.long()[request_of_token]
    slots = table.long()[request_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    input_ids = torch.randint(0, 129280, (num_tokens,), device="cuda")
    return lambda: hasher(input_ids, positions, starts, slot_mapping=slots, block_table=table, request_rows=rows)


def bench_hash(token_counts=(1, 64, 1024, 8192, 32768), variants=VARIANTS, warm=True) -> list[dict]:
    """Per batch size: ``<name>_graph_us`` (cold L2), ``<name>_graph_warm_us`` and
    ``<name>_eager_us`` for each variant, on the batches of :func:`hash_call`."""
    spec = engram.EngramSpec.from_hf_config(CONFIG)
    layout = engram.EngramLayout(spec)
    vocab = _random_vocab(spec)
    rng = np.random.default_rng(1)
    results = []
    for num_tokens in token_counts:
        row = {"T": num_tokens, "requests": min(num_tokens, 64)}
        for name, backend, fused, with_history in variants:
            call = hash_call(layout, vocab, num_tokens, rng, backend, fused, with_history)
            row[f"{name}_graph_us"] = _time(call, graph=True)
            if warm:
                row[f"{name}_graph_warm_us"] = _time(call, graph=True, flush=False)
                row[f"{name}_eager_us"] = _time(call, graph=False)
        # Bytes: ids and positions read, slots written, hash ids written (the minimum).
        row["bytes"] = num_tokens * (8 + 8 + 8 + 4 + spec.num_layers * spec.num_columns * 4)
        if "torch_graph_us" in row:
            row["speedup_vs_torch"] = row["torch_graph_us"] / row["triton_graph_us"]
        results.append(row)
    return results


@triton.jit
def _empty_kernel(pointer):
    pass


def empty_kernel_floor() -> dict:
    """The harness's floor: one empty Triton launch, timed as the hash is (graph replay)."""
    buffer = torch.zeros(1, device="cuda")
    return {"cold_us": _time(lambda: _empty_kernel[(1,)](buffer), graph=True),
            "warm_us": _time(lambda: _empty_kernel[(1,)](buffer), graph=True, flush=False)}


def compiled_variants() -> list[dict]:
    """Registers and spills of every compiled variant of the hash kernel (best effort:
    the JIT cache's layout differs across Triton versions)."""
    from engram.hashing.kernels import ngram_hash_kernel

    found = []
    for cache in getattr(ngram_hash_kernel, "device_caches", {}).values():
        kernels = next((part for part in (cache if isinstance(cache, tuple) else (cache,)) if isinstance(part, dict)), {})
        for kernel in kernels.values():
            constants = getattr(getattr(kernel, "src", None), "constants", {}) or {}
            names = ngram_hash_kernel.arg_names
            flags = {(names[k[0]] if isinstance(k, tuple) else str(k)): v for k, v in constants.items()}
            entry = {"registers": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None)}
            entry.update({name: flags[name] for name in ("BLOCK_TOKENS", "READ_SLOTS", "WRITE_SLOTS_HERE",
                                                         "SLOTS_BEFORE_READS", "WRITE_HISTORY_AFTER") if name in flags})
            found.append(entry)
    return found


def sweep(token_counts=(1, 64, 1024, 8192, 32768)) -> None:
    """Time launch shapes of the hash kernel (default mode, graph replays, flushed L2)."""
    from engram.hashing import launch

    print(f"empty-kernel floor: {empty_kernel_floor()}", flush=True)
    for block_tokens, num_warps in ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (16, 4)):
        launch.LAUNCH_OVERRIDE.update(block_tokens=block_tokens, num_warps=num_warps)
        rows = bench_hash(token_counts, variants=VARIANTS[:1], warm=False)
        print(f"block {block_tokens:4d} warps {num_warps}: "
              + "  ".join(f"T={r['T']}: {r['triton_graph_us']:.1f} us" for r in rows), flush=True)
    launch.LAUNCH_OVERRIDE.clear()
    for variant in compiled_variants():
        print(variant)


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    else:
        for row in bench_hash():
            print(row)
