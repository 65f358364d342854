"""EngramMemory.from_pretrained end to end on synthetic checkpoints: hash ids against the
whole-sequence reference, layer outputs against the float64 reference computed from the
file bytes, tensor parallelism over gloo (2 processes, each loading its own shard) bit
for bit equal to one process, placements, errors, progress output."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_group import end_group
from engram.hashing import hash_ngrams
from engram.layer import Engram, reference_engram
from engram.memory import EngramMemory, resolve_placement
from engram.tools.testing import write_synthetic_checkpoint

from test_checkpoint import dequantize_raw, decode_bf16, raw_table, raw_wkv_weight, read_raw_tensors

SEED = 11
TP_WORLD = 2


def make_batch(vocab_size: int, seed: int, lengths=(37, 1, 22)):
    """A flat batch of whole requests: raw token ids, positions, query_start_loc, dead mask."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, vocab_size, n) for n in lengths]
    dead = [rng.random(n) < 0.15 for n in lengths]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return {
        "token_ids": tokens,
        "dead": dead,
        "input_ids": torch.from_numpy(np.concatenate(tokens)),
        "positions": torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])),
        "query_start_loc": torch.from_numpy(starts.astype(np.int32)),
        "dead_mask": torch.from_numpy(np.concatenate(dead)),
    }


def run_layers(memory: EngramMemory, seed: int) -> dict:
    """Hash a batch with the memory's hasher and run every layer on random bf16 hidden states
    (on the memory's device); everything returned is on the CPU."""
    batch = make_batch(memory.vocab.vocab_size, seed)
    device = memory.device
    hash_ids = memory.hasher(batch["input_ids"].to(device), batch["positions"].to(device),
                             batch["query_start_loc"].to(device), dead_mask=batch["dead_mask"].to(device))
    generator = torch.Generator().manual_seed(seed)
    tokens = hash_ids.shape[0]
    hidden = torch.randn(tokens, memory.spec.hc_mult, memory.spec.hidden_size, generator=generator).to(torch.bfloat16)
    mask = ~batch["dead_mask"]
    outputs = {layer_id: memory.forward_layer(layer_id, hidden.to(device), hash_ids, mask.to(device)).cpu()
               for layer_id in memory.layer_ids}
    return {"batch": batch, "hash_ids": hash_ids.cpu(), "hidden": hidden, "mask": mask, "outputs": outputs}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "fp8": write_synthetic_checkpoint(tmp_path_factory.mktemp("fp8"), seed=SEED, tokenizer="word", num_shards=3),
        "bf16": write_synthetic_checkpoint(tmp_path_factory.mktemp("bf16"), seed=SEED, tokenizer="word",
                                           wkv_dtype="bf16", num_shards=1, with_index=False),
    }


# ---------------------------------------------------------------------------
# one process
# ---------------------------------------------------------------------------
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("placement", ["cpu", pytest.param("device", marks=CUDA)])
@pytest.mark.parametrize("wkv", ["fp8", "bf16"])
def test_from_pretrained_matches_the_reference(checkpoints, wkv, placement):
    synthetic = checkpoints[wkv]
    spec = synthetic.spec
    memory = EngramMemory.from_pretrained(synthetic.directory, placement=placement, progress=False)
    device_type = "cpu" if placement == "cpu" else "cuda"
    assert memory.placement == placement and memory.device.type == device_type
    assert memory.spec == spec and memory.layer_ids == (1, 14) and memory.shard is None
    assert memory.hasher.device.type == device_type
    for layer_id in memory.layer_ids:
        assert memory.table(layer_id).storage.value_bytes.device.type == device_type
        assert memory.layer(layer_id).q_weight.device.type == device_type
    assert memory.nbytes == sum(memory.layout.table_bytes)
    for layer_id in memory.layer_ids:
        assert isinstance(memory.layer(layer_id), Engram) and memory.layer(layer_id).mode == "single"
        assert memory.table(layer_id).num_rows == memory.layout.num_embeddings[spec.layer_index(layer_id)]

    result = run_layers(memory, seed=3)
    batch, hash_ids = result["batch"], result["hash_ids"]
    assert hash_ids.shape == (60, 2, spec.num_columns)
    for k, (tokens, dead) in enumerate(zip(batch["token_ids"], batch["dead"])):
        start = int(batch["query_start_loc"][k])
        expected = hash_ngrams(tokens, memory.layout, memory.vocab, dead)
        assert np.array_equal(hash_ids[start:start + len(tokens)].numpy(), expected)

    raw = read_raw_tensors(synthetic.directory)
    hidden, mask = result["hidden"], result["mask"]
    assert 0 < int((~mask).sum()) < len(mask)
    for index, layer_id in enumerate(memory.layer_ids):
        name = f"layers.{layer_id}.engram"
        ids = hash_ids[:, index, :].numpy()
        rows = dequantize_raw(raw_table(raw, f"{name}.embed.weight")[ids], raw_table(raw, f"{name}.embed.scale")[ids])
        weight = raw_wkv_weight(raw, "", layer_id, spec.weight_block_size)
        q_weight, k_weight = (torch.from_numpy(decode_bf16(raw[f"{name}.{kind}"][2]).reshape(spec.hc_mult, -1))
                              for kind in ("q_weight", "k_weight"))
        reference = reference_engram(hidden, torch.from_numpy(rows), torch.from_numpy(weight), q_weight, k_weight,
                                     spec.rms_norm_eps, mask)
        out = result["outputs"][layer_id]
        assert out.dtype == torch.bfloat16 and out.shape == hidden.shape
        update = (out.double() - hidden.double())[mask]
        reference_update = (reference - hidden.double())[mask]
        assert float((update - reference_update).norm() / reference_update.norm()) < 1e-2
        assert torch.equal(out[~mask].view(torch.int16), hidden[~mask].view(torch.int16))


def test_layer_errors_name_the_id_and_the_valid_ones(checkpoints):
    memory = EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="cpu", progress=False)
    with pytest.raises(ValueError, match=r"layer_id 2 is not an Engram layer of this model; expected one of \[1, 14\]"):
        memory.layer(2)
    with pytest.raises(ValueError, match=r"layer_id '1' is not an Engram layer"):
        memory.table("1")
    hidden = torch.zeros(5, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"hash_ids: expected shape \[T, 2, 6\] \(tokens, Engram layers, hash "
                                         r"columns\), found \[5, 6\]"):
        memory.forward_layer(14, hidden, torch.zeros(5, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"layer_id 3 is not an Engram layer"):
        memory.forward_layer(3, hidden, torch.zeros(5, 2, 6, dtype=torch.int32))


def test_placements(checkpoints, monkeypatch):
    if not torch.cuda.is_available():
        assert resolve_placement("auto") == ("cpu", torch.device("cpu"))
        with pytest.raises(ValueError, match="placement 'device' needs a CUDA device"):
            resolve_placement("device")
    assert resolve_placement("auto", "cpu") == ("cpu", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"device: placement 'cpu' runs on the CPU, found device 'cuda:0'"):
        resolve_placement("cpu", "cuda:0")
    with pytest.raises(ValueError, match=r"placement: expected 'auto' or one of \['cpu', 'device'.*found 'hbm'"):
        resolve_placement("hbm")
    # A placement that cannot be used fails before any table row is read.
    import engram.checkpoint

    monkeypatch.setattr(engram.checkpoint.SafetensorsCheckpoint, "read_rows_into",
                        lambda *args, **kwargs: pytest.fail("a table was read"))
    with pytest.raises(ValueError, match="placement"):
        EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="hbm", progress=False)


def test_progress_bar_without_a_terminal(checkpoints, capsys):
    memory = EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="cpu", progress=True)
    captured = capsys.readouterr()
    assert "engram tables" in captured.err and "100%" in captured.err and "B/s" in captured.err
    assert memory.nbytes > 0


def test_run_layer_demo_on_a_given_checkpoint(checkpoints):
    """The demo's layer part, on an existing checkpoint (used as found, not rewritten)."""
    from rich.console import Console

    from engram.tools.demo import run_layer_demo

    directory = checkpoints["fp8"].directory
    before = {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}
    console = Console(record=True, width=120)
    texts = [("a", "The table of the memory . " * 40), ("b", "Engine hash token row column . " * 5)]
    assert run_layer_demo(texts, checkpoint=str(directory), console=console)
    out = console.export_text()
    for stage in ("hash", "lookup", "wkv", "gate", "total"):
        assert stage in out
    assert out.count("match") >= 3 and "(as found)" in out
    assert {p.name: p.stat().st_mtime_ns for p in directory.iterdir()} == before


# ---------------------------------------------------------------------------
# tensor parallel over gloo: each rank loads its own shard
# ---------------------------------------------------------------------------
def _worker(rank: int, world_size: int, init_file: str, directory: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        parallel = EngramMemory.from_pretrained(directory, placement="cpu", tp_group=dist.group.WORLD, progress=False)
        results = {"parallel": run_layers(parallel, seed=5), "shard": parallel.shard,
                   "modes": [parallel.layer(layer_id).mode for layer_id in parallel.layer_ids],
                   "tables": {layer_id: (table.storage.value_bytes.clone(), table.storage.scale_bytes.clone(),
                                         table.row_start, table.column_start, table.column_end)
                              for layer_id, table in parallel.tables.items()}}
        single = EngramMemory.from_pretrained(directory, placement="cpu", progress=False)
        results["single"] = run_layers(single, seed=5)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        end_group()


@pytest.fixture(scope="module")
def parallel_results(checkpoints, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(TP_WORLD, str(out_dir / "init"), str(checkpoints["fp8"].directory), str(out_dir)),
             nprocs=TP_WORLD, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(TP_WORLD)]


def test_tensor_parallel_loads_only_its_shard(checkpoints, parallel_results):
    synthetic = checkpoints["fp8"]
    raw = read_raw_tensors(synthetic.directory)
    for index, layer_id in enumerate(synthetic.spec.layer_ids):
        values = raw_table(raw, f"layers.{layer_id}.engram.embed.weight")
        scales = raw_table(raw, f"layers.{layer_id}.engram.embed.scale")
        covered = 0
        for rank, results in enumerate(parallel_results):
            shard = results["shard"]
            assert (shard.rank, shard.world_size) == (rank, TP_WORLD)
            assert results["modes"] == ["tensor", "tensor"]
            value_bytes, scale_bytes, row_start, column_start, column_end = results["tables"][layer_id]
            assert (row_start, column_start, column_end) == (shard.row_ranges[index][0], 3 * rank, 3 * rank + 3)
            assert row_start == covered  # the ranks' rows tile the table
            covered = row_start + len(value_bytes)
            assert np.array_equal(value_bytes.numpy(), values[row_start:covered])
            assert np.array_equal(scale_bytes.numpy(), scales[row_start:covered])
        assert covered == len(values)


def test_tensor_parallel_equals_one_process_bit_for_bit(parallel_results):
    for results in parallel_results:
        parallel, single = results["parallel"], results["single"]
        assert torch.equal(parallel["hash_ids"], single["hash_ids"])
        for layer_id, out in parallel["outputs"].items():
            assert torch.equal(out.view(torch.int16), single["outputs"][layer_id].view(torch.int16))
            assert torch.equal(out.view(torch.int16), parallel_results[0]["single"]["outputs"][layer_id].view(torch.int16))


def test_forward_layer_refuses_an_id_of_another_column(checkpoints, rng):
    """A row id of another hash column (or another layer) would read the wrong embedding silently."""
    memory = EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="cpu", progress=False)
    layout = memory.layout
    tokens = 4
    low = torch.from_numpy(np.asarray(layout.column_offsets, dtype=np.int64))          # [L, C]
    primes = torch.from_numpy(np.asarray(layout.column_primes, dtype=np.int64))
    hash_ids = low[None] + torch.from_numpy(rng.integers(0, 2**40, (tokens, *low.shape))) % primes[None]
    hidden = torch.zeros(tokens, memory.spec.hc_mult, memory.spec.hidden_size, dtype=torch.bfloat16)
    memory.forward_layer(14, hidden, hash_ids)  # every id in its own column's rows
    swapped = hash_ids.clone()
    swapped[2, 1, 3] = hash_ids[2, 1, 4]
    with pytest.raises(ValueError, match=rf"hash_ids\[2, 1, 3\] = {int(hash_ids[2, 1, 4])}: column 3 of layer 14 "
                                         r"owns rows \[\d+, \d+\); it is a row of column 4"):
        memory.forward_layer(14, hidden, swapped)
    beyond = hash_ids.clone()
    beyond[0, 0, 5] = layout.num_embeddings[0]
    with pytest.raises(ValueError, match=r"hash_ids\[0, 0, 5\] = \d+: column 5 of layer 1 owns rows .* outside the "
                                         r"layer's \d+ table rows"):
        memory.forward_layer(1, hidden, beyond)


def test_one_backend_argument_for_every_stage(checkpoints):
    memory = EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="cpu", progress=False,
                                          backend="torch")
    assert memory.hasher.backend == "torch"
    for layer_id in memory.layer_ids:
        assert memory.table(layer_id).backend == "torch" and memory.layer(layer_id).gate_backend == "torch"
    with pytest.raises(ValueError, match=r"backend: expected one of 'auto', 'triton', 'torch', found 'fast'"):
        EngramMemory.from_pretrained(checkpoints["fp8"].directory, placement="cpu", progress=False, backend="fast")
