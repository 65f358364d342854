"""Sizing the disk tier's caches (engram.tools.profile_tiers): the tiers' replay against a plain per-step
loop of set-associative LRU caches (the HBM cache over every read, the RAM cache over the rows it missed),
the stream of given steps, and the report's sums."""

from __future__ import annotations

import numpy as np
import pytest

from engram.tools.cache_policy import CompactStream, capacity_for, replay
from engram.tools.profile_tiers import rows_per_page, tier_steps

from test_profile_size import few_rows_config, texts  # noqa: F401  (fixtures)


def _set_lru_misses(steps, capacity, ways=8):
    """Per step, the distinct rows a set-associative LRU cache (module rules of cache_policy, recency scores,
    no initial content) did not hold at the step's start; the cache then admits every missed row of the step
    into its set's least recently read way (not one filled in this step), in ascending row order."""
    ways = min(ways, capacity)
    num_sets = max(1, capacity // ways)
    sets = [dict() for _ in range(num_sets)]  # row -> step + 1 of its last read or insertion
    missed_per_step = []
    for k, step in enumerate(steps):
        rows = sorted(set(int(r) for r in step))
        cached = {r for s in sets for r in s}
        missed = [r for r in rows if r not in cached]
        missed_per_step.append(np.array(missed, dtype=np.int64))
        for r in rows:
            if r in cached:
                sets[r % num_sets][r] = k + 1
        inserted = set()
        for r in missed:
            s = sets[r % num_sets]
            if len(s) < ways:
                s[r] = k + 1
                inserted.add(r)
                continue
            old = [x for x in s if x not in inserted]
            if not old:
                continue
            victim = min(old, key=lambda x: s[x])
            inserted.add(r)
            sets[r % num_sets] = {(r if x == victim else x): (k + 1 if x == victim else v) for x, v in s.items()}
    return missed_per_step


def test_given_steps_make_the_stream_they_say(rng):
    steps = [rng.integers(0, 50, int(rng.integers(0, 20))) for _ in range(9)]
    steps[3] = np.zeros(0, dtype=np.int64)  # a step that reads nothing
    stream = CompactStream.from_steps(steps)
    assert stream.num_steps == 9 and stream.num_reads == sum(len(s) for s in steps)
    for k, step in enumerate(steps):
        ids, counts, _ = stream.step(k)
        np.testing.assert_array_equal(stream.rows[ids], np.unique(step))
        assert counts.sum() == len(step)


def test_replay_lists_each_steps_misses(rng):
    reads = (rng.zipf(1.3, 4000) * 7919 % 600).astype(np.int64)
    stream = CompactStream(reads, 250)
    misses = []
    result = replay(stream, 40, "set-lru", misses=misses)
    expected = _set_lru_misses([reads[i:i + 250] for i in range(0, len(reads), 250)], 40)
    assert len(misses) == len(expected) == stream.num_steps
    for k, (got, want) in enumerate(zip(misses, expected)):
        np.testing.assert_array_equal(got, want, err_msg=f"step {k}")
    assert result.fetches - result.fetch_hits == sum(len(m) for m in misses)


@pytest.mark.parametrize("hbm_fraction", [0.0, 0.02, 0.1])
@pytest.mark.parametrize("ram_fraction", [0.05, 0.3])
def test_tiers_equal_two_plain_caches(rng, ram_fraction, hbm_fraction):
    num_rows, step_reads, page_rows = 2000, 300, 15
    reads = (rng.zipf(1.2, 9000) * 7919 % num_rows).astype(np.int64)
    steps = [reads[i:i + step_reads] for i in range(0, len(reads), step_reads)]
    upper = (_set_lru_misses(steps, capacity_for(hbm_fraction, num_rows)) if hbm_fraction > 0
             else [np.unique(step) for step in steps])
    lower = _set_lru_misses(upper, capacity_for(ram_fraction, num_rows))
    got = tier_steps(CompactStream(reads, step_reads), num_rows, ram_fraction, hbm_fraction, "set-lru", page_rows)
    assert got["steps"] == len(steps) and got["reads"] == len(reads)
    assert got["ram_reads"] == sum(len(u) for u in upper)
    assert got["ram_hits"] == got["ram_reads"] - sum(len(m) for m in lower)
    assert got["disk_rows"] == sum(len(m) for m in lower)
    assert got["disk_pages"] == sum(len(np.unique(m // page_rows)) for m in lower)
    hbm_hits = sum(len(step) - sum(1 for r in step if r in set(u.tolist())) for step, u in zip(steps, upper))
    assert got["hbm_hits"] == (hbm_hits if hbm_fraction > 0 else 0)
    if hbm_fraction == 0.0:
        assert got["ram_reads"] == sum(len(np.unique(step)) for step in steps)


def test_a_page_holds_whole_rows():
    assert rows_per_page(272) == 15
    assert rows_per_page(5000) == 1


def test_profile_tiers_cli_hbm_rates_are_evals(texts, few_rows_config, deepseek_tokenizer_path, tmp_path, capsys):
    """``engram profile tiers`` on real text: its HBM hit rate is ``profile eval``'s for the same policy, fraction
    and step size; without an HBM cache every step's distinct rows reach RAM; more RAM never reads more pages."""
    import json

    from engram.tools.cli import main
    from test_profile_size import _eval

    common = ["--corpus", str(texts / "0.txt"), str(texts / "1.txt"), "--config", str(few_rows_config)]
    out = tmp_path / "tiers.json"
    assert main(["profile", "tiers", *common, "--ram-fractions", "0.02", "0.2", "--hbm-fractions", "0", "0.01",
                 "--step-tokens", "16", "--tokenizer", str(deepseek_tokenizer_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "disk reads / step" in printed and "HBM hit rate" in printed
    figures = json.loads(out.read_text())
    assert figures["rows_per_page"] == 15 and len(figures["tiers"]) == 4
    expected = _eval([*common, "--fraction", "0.01", "--policy", "set-lru", "--step-tokens", "16"],
                     deepseek_tokenizer_path, capsys)
    by_key = {(e["ram_fraction"], e["hbm_fraction"]): e for e in figures["tiers"]}
    assert by_key[(0.02, 0.01)]["hbm_hit_rate"] == pytest.approx(expected["hit_rate"])
    assert by_key[(0.02, 0.0)]["hbm_hit_rate"] == 0
    for hbm in (0.0, 0.01):
        assert by_key[(0.2, hbm)]["disk_pages_per_step"] <= by_key[(0.02, hbm)]["disk_pages_per_step"]
        assert by_key[(0.02, hbm)]["disk_pages_per_step"] > 0


@pytest.mark.parametrize("flag,value", [("--ram-fractions", "0"), ("--hbm-fractions", "-0.1"), ("--hbm-fractions", "x")])
def test_profile_tiers_refuses_bad_fractions_by_name(flag, value, tmp_path, capsys):
    from engram.tools.cli import main

    (tmp_path / "t.txt").write_text("some text\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "tiers", "--corpus", str(tmp_path / "t.txt"), flag, value])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and flag in captured.err and repr(value) in captured.err
