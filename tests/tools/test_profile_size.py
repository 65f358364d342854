"""engram profile size: its hit rates are profile eval's, its HBM bytes the row cache's own, its search finds
the smallest fraction, and bad flags are refused (exit 2, the flag named). Real text (the Python sources or
documentation found on the machine, drawn by the test's seed), the DeepSeek-V4 tokenizer."""

from __future__ import annotations

import json
import os

import pytest
import torch

import engram
from engram.table.host_memory.rows import packed_row_bytes
from engram.table.placements.row_cache import RowCache
from engram.tools.cli import main
from engram.tools.corpus import english_texts
from engram.tools.profile_size import candidate_fractions, layer_cache_bytes, smallest_fraction

from conftest import PACKAGED_CONFIG, small_config

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def texts(tmp_path, seed):
    """Three real texts (about 1,000 tokens each), one file each, under ``tmp_path / "texts"``."""
    folder = tmp_path / "texts"
    folder.mkdir()
    for k, (_, text) in enumerate(english_texts(3, 4000, seed=seed)):
        (folder / f"{k}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture
def few_rows_config(tmp_path):
    """V4.1's geometry and compressed vocabulary with tables of ~24k rows (primes from 1009): a short text's
    hit rate then grows with the cached fraction."""
    config = small_config(layer_ids=(1, 14), n_heads=8, head_dim=256, vocab_size=1009, compressed_vocab_size=99092,
                          hidden_size=64, hc_mult=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def _size(args, tokenizer, capsys, tmp_path) -> dict:
    out = tmp_path / "size.json"
    assert main(["profile", "size", *args, "--tokenizer", str(tokenizer), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cache_fraction" in printed and "HBM" in printed and "host / step" in printed
    return json.loads(out.read_text())


def _eval(args, tokenizer, capsys) -> dict:
    assert main(["profile", "eval", *args, "--tokenizer", str(tokenizer), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_size_gives_eval_hit_rates(texts, few_rows_config, deepseek_tokenizer_path, tmp_path, rng, capsys):
    """Every (policy, fraction, step size) of size is what eval reports for it; host bytes follow eval's fetches."""
    hot = tmp_path / "hot.npz"
    assert main(["profile", "build", "--corpus", str(texts / "0.txt"), "--config", str(few_rows_config),
                 "--tokenizer", str(deepseek_tokenizer_path), "--fraction", "0.05", "--out", str(hot)]) == 0
    capsys.readouterr()
    fractions = sorted({round(float(f), 4) for f in rng.uniform(0.002, 0.05, size=2)})
    steps = sorted({int(s) for s in rng.integers(4, 64, size=2)})
    common = ["--corpus", str(texts / "1.txt"), str(texts / "2.txt"), "--config", str(few_rows_config)]
    figures = _size([*common, "--hot", str(hot), "--fractions", *map(str, fractions), "--step-tokens",
                     *map(str, steps), "--policies", "set-lru", "dynamic", "static"],
                    deepseek_tokenizer_path, capsys, tmp_path)
    assert len(figures["sizes"]) == 3 * len(fractions) * len(steps)
    row_bytes = packed_row_bytes(256)
    assert figures["row_bytes"] == row_bytes
    host = {entry["step_tokens"]: entry for entry in figures["host"]}
    for entry in figures["sizes"]:
        expected = _eval([*common, "--hot", str(hot), "--fraction", str(entry["fraction"]), "--policy",
                          entry["policy"], "--step-tokens", str(entry["step_tokens"])], deepseek_tokenizer_path, capsys)
        assert entry["hit_rate"] == expected["hit_rate"] and entry["ceiling"] == expected["ceiling"]
        for layer_id, layer in entry["layers"].items():
            assert layer["hit_rate"] == expected["layers"][layer_id]["hit_rate"]
        steps_run = entry["steps"]
        assert steps_run == -(-figures["tokens"] // entry["step_tokens"])
        assert expected["reads"] == figures["tokens"] * 48   # 2 layers of 24 columns
        assert entry["host_bytes_per_step"] * steps_run == pytest.approx(
            (expected["fetches"] - expected["fetch_hits"]) * row_bytes)
        assert entry["host_read_bytes_per_step"] * steps_run == pytest.approx(
            (expected["reads"] - expected["hits"]) * row_bytes)
        assert host[entry["step_tokens"]]["host_bytes_per_step"] * steps_run == pytest.approx(
            expected["fetches"] * row_bytes)
    assert len({entry["hit_rate"] for entry in figures["sizes"]}) > 1   # the figures say something


def test_size_hbm_bytes_are_the_row_caches(seed, rng):
    """V4.1's tables: each layer's bytes are a RowCache's as the placement sizes it (slots rounded down to
    whole sets), with the update's work buffers for the step's ids (none for static)."""
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(PACKAGED_CONFIG))
    for fraction, step_tokens in ((float(rng.uniform(1e-4, 0.2)), int(rng.integers(1, 9000))), (1.0, 1)):
        for policy in ("set-lru", "dynamic", "static"):
            layers = layer_cache_bytes(layout, fraction, policy, step_tokens)
            for rows, layer in zip(layout.num_embeddings, layers):
                slots = max(1, int(rows * fraction) // 8) * 8
                assert layer["slots"] == slots
                assert layer["cache_bytes"] == (slots + 1) * (packed_row_bytes(256) + 8 + 4)  # + the trash slot
                cache = RowCache(max(1, int(rows * fraction)), 256, "meta", recency=policy == "set-lru")
                assert layer["cache_bytes"] == cache.nbytes
                if policy == "static":
                    assert layer["update_bytes"] == 0
                elif layer["update_bytes"] is not None:
                    buffers = cache.admission_buffers(step_tokens * layout.spec.num_columns)
                    assert layer["update_bytes"] == sum(t.untyped_storage().nbytes() for t in vars(buffers).values()
                                                        if isinstance(t, torch.Tensor))
                    assert layer["update_bytes"] > 9 * slots   # a per-slot top list and a stamp per set
                assert layer["hbm_bytes"] == layer["cache_bytes"] + (layer["update_bytes"] or 0)


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["set-lru", "dynamic", "static"])
def test_size_bytes_equal_a_cached_tables(policy, rng):
    """Placement "cached" itself (CPU form, under the interpreter): its cache's bytes, and the work buffers its
    update made for a step, are what size reports."""
    if not INTERPRET:
        pytest.skip("the CPU form of placement 'cached' exists only under TRITON_INTERPRET=1")
    layout = engram.EngramLayout(engram.EngramSpec.from_hf_config(small_config()))
    rows, head_dim, columns = layout.num_embeddings[0], layout.spec.head_dim, layout.spec.num_columns
    fraction, step_tokens = float(rng.uniform(0.01, 0.3)), int(rng.integers(1, 40))
    values = torch.from_numpy(rng.integers(0, 120, (rows, head_dim), dtype="uint8"))
    scales = torch.full((rows, head_dim // 32), 127, dtype=torch.uint8)
    table = engram.EngramTable(values, scales, placement="cached", device="cpu", validate=False, check_values=False,
                               placement_options={"cache_fraction": fraction, "policy": policy,
                                                  **({"hot_rows": torch.arange(4)} if policy == "static" else {})})
    cache = table.storage.cache
    if policy != "static":  # the placement's update, without its CUDA-only bookkeeping
        cache.update(torch.from_numpy(rng.integers(0, rows, (step_tokens, columns))), *table.storage.backing)
    (layer, _) = layer_cache_bytes(layout, fraction, policy, step_tokens)
    assert layer["slots"] == cache.num_slots and layer["cache_bytes"] == table.storage.cache_nbytes
    buffers = cache._admission
    made = 0 if buffers is None else sum(t.untyped_storage().nbytes() for t in vars(buffers).values()
                                         if isinstance(t, torch.Tensor))
    assert layer["update_bytes"] == made and (made > 0) == (policy != "static")


def test_smallest_fraction_bisects_the_two_digit_fractions(rng):
    """With a hit rate that grows with the fraction, the answer is the smallest two-digit fraction reaching
    the target, found in few evaluations; the listed fractions bound the search."""
    threshold = float(rng.uniform(0.011, 0.049))
    asked = []

    def evaluate_at(fraction):
        asked.append(fraction)
        return {"fraction": fraction, "hit_rate": 0.6 if fraction >= threshold else 0.4}

    listed = [evaluate_at(f) for f in (0.005, 0.01, 0.05, 0.1)]
    asked.clear()
    answer = smallest_fraction(listed, 0.5, evaluate_at)
    expected = min(f for f in candidate_fractions(0.01, 0.05) + [0.05] if f >= threshold)
    assert answer["reached"] and answer["searched"] and answer["entry"]["fraction"] == expected
    assert len(asked) <= 6 and all(0.01 < f < 0.05 for f in asked)
    assert smallest_fraction(listed, 0.3, evaluate_at) == {"reached": True, "searched": False, "entry": listed[0]}
    assert smallest_fraction(listed, 0.7, evaluate_at) == {"reached": False, "searched": False, "entry": listed[-1]}
    assert candidate_fractions(0.01, 0.02) == [0.011, 0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019]
    assert candidate_fractions(0.0095, 0.011) == [0.0096, 0.0097, 0.0098, 0.0099, 0.01]


def test_target_hit_rate_end_to_end(texts, few_rows_config, deepseek_tokenizer_path, tmp_path, capsys):
    """The answer reaches the target, the two-digit fraction below it does not, and both figures are eval's."""
    common = ["--corpus", str(texts), "--config", str(few_rows_config), "--step-tokens", "16"]
    listed = _size([*common, "--fractions", "0.01", "0.1", "--policies", "set-lru"], deepseek_tokenizer_path, capsys,
                   tmp_path)
    low, high = (entry["hit_rate"] for entry in listed["sizes"])
    assert low < high
    target = round((low + high) / 2, 4)
    figures = _size([*common, "--fractions", "0.01", "0.1", "--policies", "set-lru", "--target-hit-rate",
                     str(target)], deepseek_tokenizer_path, capsys, tmp_path)
    (answer,) = figures["targets"]
    assert answer["reached"] and answer["searched"] and answer["policy"] == "set-lru"
    found = answer["entry"]["fraction"]
    assert 0.01 < found <= 0.1 and answer["entry"]["hit_rate"] >= target
    assert _eval([*common, "--fraction", str(found), "--policy", "set-lru"], deepseek_tokenizer_path,
                 capsys)["hit_rate"] == answer["entry"]["hit_rate"]
    below = candidate_fractions(0.01, found)[-1:]
    if below:
        assert _eval([*common, "--fraction", str(below[0]), "--policy", "set-lru"], deepseek_tokenizer_path,
                     capsys)["hit_rate"] < target
    assert main(["profile", "size", *common, "--fractions", "0.01", "0.1", "--policies", "set-lru",
                 "--target-hit-rate", str(target), "--tokenizer", str(deepseek_tokenizer_path)]) == 0
    assert f"cache_fraction {found:g}" in capsys.readouterr().out


@pytest.mark.parametrize("flag, value", [("--fractions", "0"), ("--fractions", "1.5"), ("--fractions", "half"),
                                         ("--step-tokens", "0"), ("--step-tokens", "99999999999"),
                                         ("--target-hit-rate", "0"), ("--target-hit-rate", "1.2"),
                                         ("--target-hit-rate", "nan"), ("--target-hit-rate", "most"),
                                         ("--policies", "lru"), ("--max-tokens", "-3")])
def test_bad_flags_are_refused_by_the_parser(flag, value, texts, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "size", "--corpus", str(texts), flag, value, "--json", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and flag in captured.err and repr(value) in captured.err
    assert "Traceback" not in captured.err and list(tmp_path.glob("*.json")) == []


@pytest.mark.parametrize("case", ["static without --hot", "missing corpus", "json in a missing directory"])
def test_bad_inputs_exit_2_naming_the_flag(case, texts, tmp_path, deepseek_tokenizer_path, capsys):
    args = {"static without --hot": ["--corpus", str(texts), "--policies", "static"],
            "missing corpus": ["--corpus", str(tmp_path / "nowhere")],
            "json in a missing directory": ["--corpus", str(texts), "--json", str(tmp_path / "no" / "out.json")]}[case]
    flag = {"static without --hot": "--policies static", "missing corpus": "--corpus",
            "json in a missing directory": "--json"}[case]
    assert main(["profile", "size", *args, "--tokenizer", str(deepseek_tokenizer_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and flag in captured.err and "Traceback" not in captured.err
