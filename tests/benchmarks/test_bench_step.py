"""benchmarks/step/bench_step.py on the CPU: the whole script in its --smoke mode (tiny shapes, placement "cpu"
for "device"; for the real-text variants "cpu" with a row cache beside it), the real-text inputs (hash ids
equal to the whole stream's), the host neighbours (started, signalled, stopped, a dead one noticed), the
disk variants (row files written once and reused, their tiers' figures, their pairs), the decoder
stand-in's GEMM forms (fallbacks where torch._scaled_grouped_mm does not run, argument checks of the
grouped forms at V4.1 shapes on the meta device), its routing plan, the report's headline figures and
the C host-gather ceiling, so the one unattended GPU run does not die on a Python error."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
STEP = BENCHMARKS / "step"
HOST = BENCHMARKS / "host"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import bench_step

    return bench_step


@pytest.fixture
def figures(monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import step_figures

    return step_figures


def test_smoke_runs_end_to_end(bench, tmp_path, seed, capsys):
    path = tmp_path / "step.json"
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "1,8", "--prefill-tokens", "16",
                       "--seed", str(seed % 2**62), "--text-stream", str(tmp_path / "absent.npz")]) == 0
    report = json.loads(path.read_text())
    for key in ("device", "torch", "triton", "commit", "date", "host_vs_device_prefill_T8192_pct",
                "host_vs_device_decode_T64_pct", "cached_vs_device_prefill_T8192_pct",
                "common_vs_device_prefill_T8192_pct", "device_over_floor_prefill_T8192_pct",
                "host_gather_vs_ceiling_T8192", "layer_us_T64", "layer_us_T8192", "gemm_forms", "engram",
                "cached_vs_host_decode_T64_pct", "cached_vs_host_prefill_T8192_pct",
                "cached_vs_host_prefill_T8192_realtext_pct", "cached_host_bytes_vs_host_realtext",
                "cached_hit_rate_realtext", "cached_vs_host_prefill_T8192_realtext_neighbors_pct",
                "host_neighbors", "host_neighbors_gbps_T8192"):
        assert key in report, key
    assert report["engram"]["realtext"]["source"] == "synthetic"  # no stored stream: a Zipf stand-in
    assert not report.get("errors"), report.get("errors")
    phases = {(p["mode"], p["T"]): p for p in report["phases"]}
    assert set(phases) == {("decode", 1), ("decode", 8), ("prefill", 16)}
    names = [name for name, _, _ in bench.VARIANTS]
    for phase in phases.values():
        assert list(phase["variants"]) == names  # every variant reported, in order
        for name in ("none", "device"):
            stats = phase["variants"][name]
            assert stats["n"] == 2 and stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"], stats
        assert phase["variants"]["device"]["vs_none_pct"] is not None
        assert phase["floor_us"] > 0 and phase["decoder_layer_us"] > 0 and phase["engram_layer_us"] > 0
        assert phase["variants"]["device_again"]["n"] == 2  # the control runs wherever "device" does
        if phase["mode"] == "prefill":  # eager steps: Engram's spans of the stream, within the step
            stats = phase["variants"]["device"]
            assert 0 < stats["engram_stream_ms"] < stats["max_ms"]
            assert "engram_stream_ms" not in phase["variants"]["none"]
        for name in names[2:-1]:  # host, cached and seed need CUDA; kv ahead is not in this version either way
            if name in bench.REALTEXT and name not in bench.WITH_NEIGHBORS:  # stand-ins on the CPU
                assert phase["variants"][name]["n"] == 2, name
                continue
            assert phase["variants"][name]["status"].startswith(("skipped", "n/a")), (name, phase["variants"][name])
        assert phase["variants"]["cached_prefetch_realtext_neighbors"]["status"] == "n/a (--host-neighbors 0)"
        assert set(phase["pairs"]) == {"cached_prefetch_realtext_vs_host_prefetch_realtext"}
        assert phase["equal_to_device"]["cached_prefetch_realtext"] is True
        assert "nonfinite" not in phase
    assert set(report["layer_us"]) == {"1", "8", "16"}
    printed = capsys.readouterr().out
    assert "Engram in a served decoder step" in printed and "headline:" in printed
    assert "attention core" in printed  # what the stand-in leaves out is said


def test_variant_statuses_follow_the_prefetch_api(bench):
    with_kv = {v.name: v for v in bench.make_variants({}, {"kv_ahead": True, "forward_layer_takes_prefetch": True},
                                                      cuda=True)}
    without = {v.name: v for v in bench.make_variants({}, {"kv_ahead": False, "forward_layer_takes_prefetch": False},
                                                      cuda=True)}
    assert with_kv["host_kv_ahead"].status is None and with_kv["cached_kv_ahead"].form == "kv_ahead"
    assert without["host_kv_ahead"].status == "n/a (not in this version)"
    assert without["seed"].status is None and without["seed"].kind == "seed"
    on_cpu = {v.name: v for v in bench.make_variants({}, {"kv_ahead": False, "forward_layer_takes_prefetch": False},
                                                     cuda=False)}
    assert on_cpu["device"].kind == "cpu" and on_cpu["device"].status is None
    assert on_cpu["host_prefetch"].status.startswith("skipped")
    # Real-text variants run where their tables were built; the neighbours' only with helpers.
    assert without["cached_prefetch_realtext"].status == "skipped (no real-text tables)"
    assert without["cached_prefetch_realtext_neighbors"].status == "n/a (--host-neighbors 0)"
    built = dict.fromkeys(("host_realtext", "cached_realtext", "cached_realtext_neighbors"))
    with_text = {v.name: v for v in bench.make_variants(built, {"kv_ahead": True, "forward_layer_takes_prefetch": True},
                                                        cuda=False, neighbors=2)}
    for name in bench.REALTEXT:
        assert with_text[name].status is None and with_text[name].realtext, name
        assert with_text[name].neighbors == name.endswith("_neighbors")
    assert not with_text["host_prefetch"].realtext and not with_text["host_prefetch"].neighbors


def test_headline_figures_follow_their_definitions(figures):
    def variants(**medians):
        return {name: {"median_ms": value} for name, value in medians.items()}

    report = {
        "phases": [
            {"mode": "prefill", "T": 8192, "floor_us": 4000.0,
             "variants": variants(none=200.0, device=208.0, host_inline=230.0, host_prefetch=214.0,
                                  cached_prefetch=212.0, seed=221.0)},
            {"mode": "decode", "T": 64, "variants": variants(none=20.0, device=20.5, host_prefetch=20.9)},
        ],
        "host_gather_ceiling": {"best_GBps": 25.0},
        "host_path_T8192": {"GBps": 10.0},
        "layer_us": {"64": 60.0, "8192": 2600.0},
    }
    keys = figures.headline(report)
    assert keys["host_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (214 - 208) / 208)  # best prefetched
    assert keys["host_vs_device_decode_T64_pct"] == pytest.approx(100 * (20.9 - 20.5) / 20.5)
    assert keys["cached_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (212 - 208) / 208)
    assert keys["common_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (221 - 208) / 208)
    assert keys["device_over_floor_prefill_T8192_pct"] == pytest.approx(100 * (208 - 200 - 4.0) / 200)
    assert keys["host_gather_vs_ceiling_T8192"] == pytest.approx(0.4)
    assert keys["layer_us_T64"] == 60.0 and keys["layer_us_T8192"] == 2600.0
    assert all(value is None for value in figures.headline({}).values())
    # The late prefetch is one of the host key's forms, and each form is reported on its own with its interval.
    prefill = report["phases"][0]["variants"]
    prefill["host_prefetch_late"] = {"median_ms": 210.0}
    prefill["host_prefetch"]["paired_vs_device_ci95_pct"] = [1.5, 4.0]
    keys = figures.headline(report)
    assert keys["host_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (210 - 208) / 208)
    assert keys["host_prefetch_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (214 - 208) / 208)
    assert keys["host_prefetch_late_vs_device_prefill_T8192_pct"] == pytest.approx(100 * (210 - 208) / 208)
    assert keys["host_prefetch_vs_device_prefill_T8192_ci95_pct"] == [1.5, 4.0]
    assert keys["host_prefetch_late_vs_device_prefill_T8192_ci95_pct"] is None  # no per-round figures here


def test_spread_reports_quartiles(figures, rng):
    samples = list(rng.uniform(1.0, 2.0, size=21))
    stats = figures.spread(samples)
    assert stats["median_ms"] == statistics.median(samples) and stats["n"] == 21
    assert stats["min_ms"] <= stats["p25_ms"] <= stats["median_ms"] <= stats["p75_ms"] <= stats["max_ms"]


def test_routing_plan_spreads_pairs_evenly(monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import step_decoder

    shape = step_decoder.V41_FLASH
    for tokens in (1, 64, 100):
        plan = step_decoder.routing_plan(shape, tokens, "cpu")
        assert plan.pairs == 6 * tokens and len(plan.counts) == 48
        assert max(plan.counts) - min(plan.counts) <= 1
        assert plan.offs.dtype == torch.int32 and plan.offs.tolist() == torch.tensor(plan.counts).cumsum(0).tolist()
        assert plan.route.tolist() == [pair // 6 for pair in range(6 * tokens)]
    assert step_decoder.routing_plan(shape, 1, "cpu").counts[:7] == [1] * 6 + [0]


def test_gemm_forms_fall_back_to_loops_where_grouped_gemms_do_not_run(monkeypatch, seed):
    monkeypatch.syspath_prepend(str(STEP))
    import step_decoder

    if not step_decoder.fp8_gemm_available("cpu"):
        pytest.skip("this torch has no CPU torch._scaled_mm")
    generator = torch.Generator().manual_seed(seed)
    decoder = step_decoder.Decoder(step_decoder.SMOKE, step_decoder.Gemms(fp8=True), generator, "cpu")
    notes = step_decoder.choose_forms(decoder, generator)
    # Each form was checked against fp32 before it was kept.
    assert notes["expert_form"] == "loop" and notes["o_form"] == "loop", notes
    assert notes["linear_rel_error"] < 2e-2 and notes["expert_rel_error"] < 2e-2 and notes["o_rel_error"] < 0.1
    assert any(error.startswith("experts grouped") for error in notes["errors"])
    plan = step_decoder.routing_plan(decoder.shape, 5, "cpu")
    hidden = torch.randn(5, decoder.shape.hc, decoder.shape.hidden, generator=generator).to(torch.bfloat16)
    out = decoder.layer(hidden, plan)
    assert out.shape == hidden.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("expert_form, o_form", [("grouped", "grouped"), ("grouped", "grouped_copy"),
                                                 ("loop", "loop")])
def test_stand_in_layer_arguments_at_v41_shapes(monkeypatch, expert_form, o_form):
    """torch's meta kernels check _scaled_mm / _scaled_grouped_mm arguments (dtypes, layouts, scale shapes)
    as the CUDA ones do: the full-size layer, without a GPU."""
    monkeypatch.syspath_prepend(str(STEP))
    import step_decoder

    shape = step_decoder.DecoderShape(**{**step_decoder.V41_FLASH.__dict__, "local_experts": 4})
    gemms = step_decoder.Gemms(fp8=True)
    gemms.expert_form, gemms.o_form = expert_form, o_form
    decoder = step_decoder.Decoder(shape, gemms, None, "meta")
    assert decoder.q_b.w.dtype == torch.float8_e4m3fn and decoder.experts_up.scale.shape == (4, 2 * 2304)
    for tokens in (1, 64, 8192):
        plan = step_decoder.routing_plan(shape, tokens, "meta")
        out = decoder.layer(torch.empty(tokens, 4, 5120, dtype=torch.bfloat16, device="meta"), plan)
        assert out.shape == (tokens, 4, 5120) and out.dtype == torch.bfloat16


def test_ceiling_output_is_parsed(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    text = ("sequential read of 8 GiB, 16 threads: 76.9 GB/s\n\n threads  distance        ms    min ms      GB/s\n"
            "      14         0     2.505     2.348      21.3\n      16        16     2.710     2.086      19.7\n")
    rows = common.parse_ceiling_output(text)
    assert [(r["threads"], r["distance"], r["median_ms"], r["min_ms"], r["printed_GBps"]) for r in rows] == [
        (14, 0, 2.505, 2.348, 21.3), (16, 16, 2.71, 2.086, 19.7)]
    for row in rows:  # the rate from the median ms agrees with the printed one
        assert row["GBps"] == pytest.approx(196_608 * 272 / (row["median_ms"] * 1e-3) / 1e9)
        assert abs(row["GBps"] - row["printed_GBps"]) < 0.06


@pytest.mark.slow
def test_ceiling_program_builds_and_runs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import common

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    found = common.host_gather_ceiling(1, "1,2", "0")
    assert "skipped" not in found, found
    assert [(row["threads"], row["distance"]) for row in found["rows"]] == [(1, 0), (2, 0)]
    assert found["best_GBps"] == max(row["GBps"] for row in found["rows"]) > 0
    best = found["best"]
    assert abs(best["GBps"] - best["printed_GBps"]) < 0.06 + 0.01 * best["GBps"]


def test_prefetched_step_equals_the_inline_step(bench, seed):
    """The step with ``memory.prefetch`` (its handle passed to forward_layer where this version returns
    one) computes what the inline step computes, on the CPU placement."""
    import step_decoder
    import step_engram

    generator = torch.Generator().manual_seed(seed)
    spec = step_engram.make_spec(None, smoke=True)
    layout = step_engram.EngramLayout(spec)
    tables, _, _ = step_engram.build_tables(spec, layout, ["cpu"], "cpu", distinct_rows=0, generator=generator)
    memory = step_engram.build_memories(spec, layout, step_engram.synthetic_vocab(spec), tables,
                                        step_engram.layer_weights(spec, generator, "cpu"), "cpu")["cpu"]
    api = step_engram.prefetch_api(memory)
    decoder = step_decoder.Decoder(step_decoder.SMOKE, step_decoder.Gemms(fp8=False), generator, "cpu")
    inputs = step_engram.StepInputs(spec, 24, decode=False, device="cpu", generator=generator, chunk=10)
    plan = step_decoder.routing_plan(decoder.shape, 24, "cpu")
    inline, ids = bench.engram_step(decoder, plan, inputs, memory, "inline", api["forward_layer_takes_prefetch"])
    prefetched, ids_again = bench.engram_step(decoder, plan, inputs, memory, "prefetch",
                                              api["forward_layer_takes_prefetch"])
    assert torch.equal(ids, ids_again) and torch.equal(inline, prefetched)
    calls = []  # the late prefetch: called once the decoder layers before the first Engram layer are enqueued
    layer, prefetch = decoder.layer, memory.prefetch
    decoder.layer = lambda h, plan: (calls.append("decoder"), layer(h, plan))[1]
    memory.prefetch = lambda hash_ids, **kw: (calls.append("prefetch"), prefetch(hash_ids, **kw))[1]
    late, ids_late = bench.engram_step(decoder, plan, inputs, memory, "prefetch_late",
                                       api["forward_layer_takes_prefetch"])
    del decoder.layer, memory.prefetch
    first = min(memory.layer_ids)
    assert calls.index("prefetch") == first and calls.count("prefetch") == 1, calls
    assert torch.equal(ids, ids_late) and torch.equal(inline, late)
    none, no_ids = bench.engram_step(decoder, plan, inputs, None, None, False)
    assert no_ids is None and not torch.equal(none, inline)  # Engram's layers changed the stream
    assert list(inputs.query_start_loc) == [0, 10, 20, 24]
    before = inputs.input_ids.clone()
    inputs.refresh()
    assert not torch.equal(before, inputs.input_ids)


def test_stand_in_keeps_fp8_operands_in_range_through_40_layers(monkeypatch, seed):
    """Every activation the stand-in casts to E4M3 stays below its largest value (448; on the GPU anything
    beyond becomes NaN) through a V4.1-deep stack, also after an Engram-sized kick to the residual."""
    monkeypatch.syspath_prepend(str(STEP))
    import step_decoder

    generator = torch.Generator().manual_seed(seed)
    shape = step_decoder.DecoderShape(**{**step_decoder.SMOKE.__dict__, "layers": 40})
    decoder = step_decoder.Decoder(shape, step_decoder.Gemms(fp8=step_decoder.fp8_gemm_available("cpu")),
                                   generator, "cpu")
    step_decoder.choose_forms(decoder, generator)
    largest = []
    cast = decoder.gemms.cast
    monkeypatch.setattr(decoder.gemms, "cast", lambda x: (largest.append(float(x.float().abs().max())), cast(x))[1])
    plan = step_decoder.routing_plan(shape, 4, "cpu")
    h = (torch.randn(4, shape.hc, shape.hidden, generator=generator) * 30).to(torch.bfloat16)
    for _ in range(shape.layers):
        h = decoder.layer(h, plan)
    assert len(largest) == 40 * 7 and max(largest) < 448, max(largest)
    assert bool(torch.isfinite(h).all())


def test_watchdog_writes_the_report_and_ends_a_stalled_run(tmp_path):
    """A step stuck inside CUDA never returns to Python: the watchdog thread writes what finished and exits."""
    import subprocess
    import sys

    path = tmp_path / "stalled.json"
    code = (f"import sys, time; sys.path.insert(0, {str(STEP)!r}); import bench_step\n"
            f"report = bench_step.Report(__import__('pathlib').Path({str(path)!r}), device='cpu', torch='-', "
            "triton='-', commit='-', date='-', phases=[])\n"
            "dog = bench_step.Watchdog(report, limit_s=1.0, deadline=time.perf_counter() + 60)\n"
            "dog.arm('a stuck step'); time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(BENCHMARKS.parent / "src")})
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads(path.read_text())
    assert report["stalled"]["what"] == "a stuck step" and report["stalled"]["seconds"] >= 1.0
    assert "STALLED: a stuck step" in done.stdout


def test_bad_token_counts_are_one_clear_error(bench, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--decode-tokens", "1,x"])
    assert stopped.value.code == 2
    assert "--decode-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--prefill-tokens", "0"])


def test_paired_comparison_cancels_a_drift_that_medians_keep(figures):
    # A clock drift over the run: round r's steps all take 1 + r/10 of the first round's; "host"
    # costs 1% over "device" in every round, but its steps fall late in half the rounds.
    device = [100.0 * (1 + r / 10) for r in range(10)]
    host = [d * 1.01 for d in device]
    assert figures.paired_pct(host, device) == pytest.approx(1.0)
    assert figures.paired_pct([], []) is None
    phase = {"mode": "prefill", "T": 8192, "floor_us": 2000.0,
             "variants": {"none": {"median_ms": 120.0}, "device": {"median_ms": 140.0, "paired_vs_none_pct": 3.0},
                          "host_prefetch": {"median_ms": 150.0, "paired_vs_device_pct": 0.2},
                          "host_kv_ahead": {"median_ms": 141.0, "paired_vs_device_pct": 0.5}}}
    keys = figures.headline({"phases": [phase]})
    assert keys["host_vs_device_prefill_T8192_pct"] == pytest.approx(0.2)  # paired, not from the medians
    assert keys["device_over_floor_prefill_T8192_pct"] == pytest.approx(3.0 - 100 * 2.0 / 120.0)


def test_median_interval_takes_the_sign_test_order_statistics(figures, rng):
    """The 95% interval of a median from n values: (x_(k), x_(n-k+1)) with the binomial tails below 2.5%
    (n = 20: the 6th and 15th; n = 6: min and max; n = 5: none); it always holds the median."""
    for n, k in ((6, 1), (10, 2), (20, 6), (27, 8), (40, 14)):
        values = list(rng.normal(size=n))
        ordered = sorted(values)
        low, high = figures.median_interval(values)
        assert (low, high) == (ordered[k - 1], ordered[n - k]), n
        assert low <= statistics.median(values) <= high
        below = sum(math.comb(n, i) for i in range(k)) / 2**n  # the tail the interval leaves out
        assert below <= 0.025 < below + math.comb(n, k) / 2**n, n
    assert figures.median_interval(list(rng.normal(size=5))) is None
    base = [100.0] * 8
    assert figures.paired_pct_interval([101.0] * 8, base) == pytest.approx((1.0, 1.0))


def test_variants_option_keeps_the_bases_and_names_unknown_ones(bench, tmp_path, capsys):
    assert bench.variant_names("host_prefetch, host_prefetch_late") == {"none", "device", "host_prefetch",
                                                                        "host_prefetch_late"}
    path = tmp_path / "step.json"
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "", "--prefill-tokens", "16",
                       "--variants", "device_again"]) == 0
    variants = json.loads(path.read_text())["phases"][0]["variants"]
    assert {name for name, stats in variants.items() if "median_ms" in stats} == {"none", "device", "device_again"}
    assert variants["seed"]["status"].startswith("skipped")  # what could not run anyway says why
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--variants", "host_prefetched"])
    assert stopped.value.code == 2
    assert "unknown variants ['host_prefetched']" in capsys.readouterr().err


def test_stream_occupancy_takes_the_union_of_each_streams_operations(monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import step_trace

    def op(stream, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [op(7, 0, 10), op(7, 5, 10), op(7, 30, 5, "gpu_memcpy"), op(7, 34, 2, "gpu_memset"),  # busy 15 + 6
              op(9, 100, 4), {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 500, "args": {}},
              {"ph": "i", "cat": "kernel", "ts": 3, "args": {"stream": 7}}]
    streams = step_trace.stream_occupancy(events)
    assert set(streams) == {7, 9}
    assert streams[7]["busy_us"] == 21 and streams[7]["span_us"] == 36 and streams[7]["idle_us"] == 15
    assert streams[7]["ops"] == 4 and streams[9]["busy_us"] == 4 and streams[9]["idle_us"] == 0
    main = step_trace.main_stream_figures(events)
    assert main["main_stream"] == 7 and main["main_idle_ms"] == pytest.approx(0.015)
    assert step_trace.main_stream_figures([])["main_stream"] is None


def test_trace_option_profiles_one_step_per_traced_variant(bench, tmp_path, monkeypatch):
    """On the CPU the profiler sees no CUDA stream: the figures say so, and each trace is kept, gzipped."""
    import gzip

    monkeypatch.delenv("OUT", raising=False)
    path = tmp_path / "step.json"
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "", "--prefill-tokens", "8,16",
                       "--trace"]) == 0
    phases = {p["T"]: p for p in json.loads(path.read_text())["phases"]}
    assert "trace" not in phases[8]  # the largest prefill T only
    traced = phases[16]["trace"]
    assert set(traced) == {"none", "device"}  # the others need CUDA
    for name, figures in traced.items():
        assert figures["main_stream"] is None and figures["trace"] == f"step-trace-{name}-T16.json.gz"
        with gzip.open(tmp_path / figures["trace"], "rt") as trace:
            assert "traceEvents" in json.load(trace)
    assert phases[16]["variants"]["device"]["n"] == 2  # the traced step is not a sample


# ---------------------------------------------------------------------------
# cached against host: real text, row caches, host neighbours
# ---------------------------------------------------------------------------
def _write_stream(path: Path, rng, tokens: int, raw: int = 600, compressed: int = 500) -> None:
    """A stream in ``real_text.py stream``'s format: raw ids and a token map onto ``compressed`` ids."""
    token_map = rng.integers(0, compressed, raw).astype(np.int32)
    np.savez(path, tokens=rng.integers(0, raw, tokens).astype(np.int32),
             file_starts=np.array([0, tokens], dtype=np.int64), token_map=token_map, corpus=np.array("tiny"))


def test_smoke_measures_cached_against_host_on_text_with_neighbours(bench, tmp_path, rng, capsys):
    """The real-text variants on a stored stream (96 tokens: after 48 of warm-up, 3 steps of 16 at prefill,
    so they stop after 2 timed rounds of 4), their pairs, hit rates and host bytes, and one helper process
    started, signalled with each neighbour variant's step, reported and stopped."""
    import os

    stream, path = tmp_path / "stream.npz", tmp_path / "step.json"
    _write_stream(stream, rng, 96)
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    variants = ",".join(bench.REALTEXT)
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "8", "--prefill-tokens", "16", "--steps", "4",
                       "--variants", variants, "--host-neighbors", "1", "--text-stream", str(stream)]) == 0
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads  # given back
    report = json.loads(path.read_text())
    assert not report.get("errors"), report.get("errors")
    setup = report["host_neighbors_setup"]
    assert setup["count"] == 1 and len(setup["helpers"]) == 1 and report["host_neighbors"] == 1
    pid = setup["helpers"][0]["pid"]
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped
    assert set(setup["helper_cores"][0]).isdisjoint(setup["step_cores"])
    assert report["engram"]["realtext"]["corpus"] == "tiny" and report["engram"]["realtext"]["folded"] is False
    for phase in report["phases"]:
        label = f"{phase['mode']}_T{phase['T']}"
        for name in bench.REALTEXT:
            assert phase["variants"][name]["n"] == 2, (label, name)  # the text held 2 steps after the warm-up's
            assert phase["text_steps_cut"][name] == 2
        assert phase["variants"]["device"]["n"] == 4
        assert all(phase["equal_to_device"][name] for name in bench.REALTEXT)
        pairs = phase["pairs"]
        assert set(pairs) == {f"{a}_vs_{b}" for a, b in bench_figures().PAIRS if a in bench.REALTEXT}
        for pair in pairs.values():
            assert pair["rounds"] == 2 and pair["min_pct"] <= pair["pct"] <= pair["max_pct"]
        reads = 2 * phase["T"] * 6 * 2  # steps x T x columns x layers
        for kind in ("cached_realtext", "cached_realtext_neighbors"):
            cache = phase["row_cache"][kind]
            assert cache["reads"] == reads and cache["steps"] == 2 and 0 <= cache["hit_rate"] <= 1, cache
            assert cache["host_bytes_ratio"] == pytest.approx(1 - cache["hit_rate"])  # the CPU stand-in: direct reads
        assert phase["text"]["warm_updates"] >= 1
        neighbors = phase["host_neighbors"]
        assert neighbors["steps"] == 4 and neighbors["GBps"] > 0  # 2 neighbour variants x 2 steps
        assert neighbors["bytes_per_step"] == phase["T"] * 6 * 2 * setup["row_bytes"]
        assert report[f"host_neighbors_gbps_{label}"] == neighbors["GBps"]
    printed = capsys.readouterr().out
    assert "host neighbours (1):" in printed and "GB/s together" in printed


def bench_figures():
    import step_figures

    return step_figures


@pytest.mark.parametrize("value", ["-1", "x", "65", "2.5"])
def test_bad_host_neighbors_are_one_clear_error(bench, capsys, value):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--host-neighbors", value])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "--host-neighbors" in err and repr(value) in err, err


def test_flags_that_contradict_each_other_are_refused(bench, capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--variants", "cached_prefetch_realtext_neighbors"])
    assert stopped.value.code == 2 and "--host-neighbors 1 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # off the smoke, real-text variants need the stored stream
        bench.main(["--variants", "cached_prefetch_realtext", "--text-stream", str(tmp_path / "absent.npz")])
    assert stopped.value.code == 2 and "--text-stream" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--host-neighbors", "2", "--neighbor-table-gib", "100000"])
    assert stopped.value.code == 2 and "--neighbor-table-gib" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke", "--neighbor-table-gib", "0"])
    assert stopped.value.code == 2 and "--neighbor-table-gib" in capsys.readouterr().err


def test_neighbour_cores_leave_the_steps_own(monkeypatch):
    monkeypatch.syspath_prepend(str(HOST))
    import host_neighbors

    cores = list(range(16))
    assert host_neighbors.default_step_threads(7, 16) == 8
    step, helpers = host_neighbors.plan_cores(7, 8, cores)
    assert step == list(range(9)) and helpers == [[c] for c in range(9, 16)]  # 8 gather threads + the main thread
    step, helpers = host_neighbors.plan_cores(2, 8, cores)
    assert helpers == [[9, 10, 11, 12], [13, 14, 15]]
    assert host_neighbors.plan_cores(3, 13, cores)[1] == [[14, 15]] * 3  # fewer cores than helpers: shared
    assert host_neighbors.plan_cores(0, 16, cores) == (cores, [])
    with pytest.raises(ValueError, match=r"--host-neighbors 7: .* pass --gather-threads 14 or fewer"):
        host_neighbors.plan_cores(7, 16, cores)


def test_a_neighbour_that_dies_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.syspath_prepend(str(HOST))
    import os
    import signal
    import time

    import host_neighbors

    cores = sorted(os.sched_getaffinity(0))
    neighbors = host_neighbors.HostNeighbors([cores[-1:]], 1 << 20, 80, timeout_s=10.0)
    try:
        (facts,) = neighbors.start()
        assert facts["rows"] == (1 << 20) // 80 and facts["cores"] == cores[-1:]
        neighbors.signal(500)
        record = neighbors.collect()
        assert record.bytes == 500 * 80 and record.gbps > 0
        os.kill(facts["pid"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(host_neighbors.NeighborError, match=r"host neighbour 0 \(pid \d+"):
            neighbors.signal(500)
            neighbors.collect()
        assert time.monotonic() - started < 10.0
        with pytest.raises(host_neighbors.NeighborError):  # stays refused
            neighbors.signal(500)
    finally:
        neighbors.close()
    assert neighbors.alive == [False]
    neighbors.close()  # idempotent


def test_real_text_inputs_hash_like_the_whole_stream(bench, seed):
    """Each step's hash ids (prefill requests continuing the stream, decode requests at their cursors) and
    a warm-up piece's equal those of the whole stream hashed at once; the stand-in cache counts its reads."""
    import engram
    import step_engram

    generator = torch.Generator().manual_seed(seed)
    spec = step_engram.make_spec(None, smoke=True)
    layout = step_engram.EngramLayout(spec)
    vocab = step_engram.synthetic_vocab(spec)
    rows = {}
    tables, _, _ = step_engram.build_tables(spec, layout, ["cpu"], "cpu", distinct_rows=0, generator=generator,
                                            cpu_rows=rows)
    memory = step_engram.build_memories(spec, layout, vocab, tables, step_engram.layer_weights(spec, generator, "cpu"),
                                        "cpu")["cpu"]
    text = step_engram.TextStream(step_engram.synthetic_text(600, spec.compressed_vocab_size, seed % 1000), "z", "-")
    whole = torch.from_numpy(engram.hash_ngrams(text.ids, layout, vocab).astype(np.int64))
    for decode, tokens in ((False, 24), (True, 5)):
        plan = step_engram.text_plan(len(text), tokens, decode, 100, prompt_tokens=7)
        inputs = step_engram.RealTextInputs(spec, tokens, decode, "cpu", generator, text, plan, chunk=10)
        for step in range(3):
            if step:
                inputs.refresh()
            expected = whole[inputs.positions.long()]
            assert torch.equal(inputs.hash(memory).long(), expected), (decode, step)
            assert torch.equal(inputs.input_ids, torch.from_numpy(text.ids)[inputs.positions.long()])
        while not inputs.exhausted:
            inputs.refresh()
        with pytest.raises(RuntimeError, match="all are used"):
            inputs.refresh()
    assert torch.equal(step_engram.hash_text(memory, text, 37, 50, "cpu").long(), whole[37:87])
    plan = step_engram.text_plan(len(text), 5, True, 100, prompt_tokens=7)
    assert step_engram.warm_segments(plan) == [(0, 100)] + [(c - 7, 7) for c in plan.cursors]
    stand_in = step_engram.StandInCachedMemory(memory, rows, 0.5)
    updates = step_engram.warm_cache(stand_in, text, plan, "cpu", 64)
    assert updates == 2 + 5  # 100 tokens in pieces of 64, then the 5 prompts
    counts = step_engram.cache_counts(stand_in)
    assert counts["reads"] == (100 + 5 * 7) * spec.num_columns * len(spec.layer_ids) and counts["hits"] > 0
    step_engram.zero_cache_counts(stand_in)
    assert step_engram.cache_counts(stand_in)["reads"] == 0
    with pytest.raises(ValueError, match="holds no step"):
        step_engram.text_plan(40, 64, False, 16)


def test_stored_stream_is_read_through_its_token_map(tmp_path, rng, monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import step_engram

    spec = step_engram.make_spec(None, smoke=True)
    path = tmp_path / "s.npz"
    _write_stream(path, rng, 50, compressed=800)  # compressed ids beyond the smoke's 500: folded
    with np.load(path) as stored:
        expected = stored["token_map"][stored["tokens"]].astype(np.int64) % spec.compressed_vocab_size
    text = step_engram.load_text_stream(path, spec)
    assert text.folded and text.corpus == "tiny" and np.array_equal(text.ids, expected)
    synthetic = step_engram.load_text_stream(tmp_path / "absent.npz", spec, synthetic_tokens=300)
    assert synthetic.source == "synthetic" and len(synthetic) == 300 and synthetic.ids.max() < 500
    with pytest.raises(FileNotFoundError):
        step_engram.load_text_stream(tmp_path / "absent.npz", spec)


def test_pairs_and_cache_figures_follow_their_definitions(figures):
    base = [100.0, 200.0, 400.0, 100.0, 100.0, 100.0, 100.0]
    cached = [101.0, 204.0, 396.0, 102.0, 103.0, 100.0, 100.0]  # +1, +2, -1, +2, +3, 0, 0 %
    pairs = figures.pair_figures({"cached_prefetch": cached, "host_prefetch": base, "host_prefetch_realtext": base})
    assert set(pairs) == {"cached_prefetch_vs_host_prefetch"}  # only pairs whose two variants ran
    pair = pairs["cached_prefetch_vs_host_prefetch"]
    assert pair["pct"] == pytest.approx(1.0) and pair["rounds"] == 7
    assert (pair["min_pct"], pair["max_pct"]) == (pytest.approx(-1.0), pytest.approx(3.0))
    assert pair["ci95_pct"] == [pytest.approx(-1.0), pytest.approx(3.0)]  # n = 7: min and max
    counts = {"reads": 1000, "hits": 400, "distinct": 700, "distinct_missed": 350}
    gathered = figures.cache_figures(counts, 4, 8192 * 24, 6144, 272)
    assert gathered["path"] == "host_gather" and gathered["hit_rate"] == 0.4
    assert gathered["host_bytes_ratio"] == pytest.approx(0.5)  # distinct misses over distinct rows
    assert gathered["host_bytes_per_step"] == 700 * 272 / 4 and gathered["cached_rows_per_step"] == 350 / 4
    direct = figures.cache_figures(counts, 4, 64 * 24, 6144, 272)
    assert direct["path"] == "direct" and direct["host_bytes_ratio"] == pytest.approx(0.6)  # misses over reads
    report = {"host_neighbors_setup": {"count": 7}, "phases": [
        {"mode": "prefill", "T": 8192, "variants": {}, "pairs": {
            "cached_prefetch_vs_host_prefetch": {"pct": 2.0, "ci95_pct": [1.0, 3.0]},
            "cached_prefetch_realtext_vs_host_prefetch_realtext": {"pct": -0.5, "ci95_pct": None},
            "cached_prefetch_realtext_neighbors_vs_host_prefetch_realtext_neighbors": {"pct": -1.5}},
         "row_cache": {"cached_realtext": gathered}, "host_neighbors": {"GBps": 9.5}},
        {"mode": "decode", "T": 64, "variants": {"cached_prefetch": {"median_ms": 33.0},
                                                 "host_prefetch": {"median_ms": 30.0}}}]}
    keys = figures.headline(report)
    assert keys["cached_vs_host_prefill_T8192_pct"] == 2.0 and keys["cached_vs_host_prefill_T8192_ci95_pct"] == [1.0, 3.0]
    assert keys["cached_vs_host_prefill_T8192_realtext_pct"] == -0.5
    assert keys["cached_vs_host_prefill_T8192_realtext_neighbors_pct"] == -1.5
    assert keys["cached_vs_host_decode_T64_pct"] == pytest.approx(10.0)  # no pairs: the ratio of medians
    assert keys["cached_hit_rate_realtext"] == 0.4 and keys["cached_host_bytes_vs_host_realtext"] == pytest.approx(0.5)
    assert keys["host_neighbors"] == 7 and keys["host_neighbors_gbps_T8192"] == 9.5
    assert keys["host_neighbors_gbps_T64"] is None and keys["cached_hit_rate_realtext_decode_T64"] is None


# ---------------------------------------------------------------------------
# placement disk: row files, tiers, pairs
# ---------------------------------------------------------------------------
DISK_VARIANTS = ("disk_prefetch_realtext_ram10", "disk_prefetch_realtext_ram30")


def test_smoke_runs_disk_variants_beside_device(bench, tmp_path, monkeypatch, capsys):
    """--write-disk-tables writes one row file per layer and then reuses them; the smoke run on them: the disk
    variants (eager, real text) return device's outputs, pair with device_eager at decode and device at
    prefill, and their tiers' figures agree with each other and with the rows read from disk."""
    from engram.table.disk.cached_reads import CachedRowReader

    directory, path = tmp_path / "rows", tmp_path / "step.json"
    directory.mkdir()
    assert bench.main(["--smoke", "--write-disk-tables", "--disk-directory", str(directory), "--json", str(path)]) == 0
    files = sorted(directory.glob("*.engram-rows"))
    assert len(files) == 2 and not path.exists()  # row files only, no report
    written = {f: f.stat().st_mtime_ns for f in files}
    assert capsys.readouterr().out.count(": wrote ") == 2
    assert bench.main(["--smoke", "--write-disk-tables", "--disk-directory", str(directory)]) == 0
    assert capsys.readouterr().out.count(": reused ") == 2
    assert {f: f.stat().st_mtime_ns for f in sorted(directory.glob("*.engram-rows"))} == written

    read_rows = []  # every row read from disk, warm-ups included
    read_disk = CachedRowReader._read_disk
    monkeypatch.setattr(CachedRowReader, "_read_disk",
                        lambda self, ids, out: (read_rows.append(len(ids)), read_disk(self, ids, out))[1])
    variants = ",".join(("device_again", "host_prefetch_realtext") + DISK_VARIANTS)
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "64", "--prefill-tokens", "16",
                       "--steps", "3", "--disk-steps", "2", "--variants", variants, "--disk-directory", str(directory),
                       "--text-stream", str(tmp_path / "absent.npz")]) == 0
    report = json.loads(path.read_text())
    assert not report.get("errors"), report.get("errors")
    assert [f["written"] for f in report["engram"]["disk_row_files"]] == [False, False]  # reused
    timed_reads = 0
    for phase in report["phases"]:
        decode = phase["mode"] == "decode"
        variants = phase["variants"]
        assert variants["device"]["n"] == 3 and phase["disk_steps"] == 2
        for name in DISK_VARIANTS:
            assert variants[name]["n"] == 2 and phase["equal_to_device"][name] is True, name
            base = "device_eager" if decode else "device"
            for other in (base, "host_prefetch_realtext"):
                assert phase["pairs"][f"{name}_vs_{other}"]["rounds"] == 2
        if decode:
            assert variants["device_eager"]["n"] == 3 and phase["equal_to_device"]["device_eager"] is True
        else:
            assert variants["device_eager"]["status"].startswith("n/a")
        tiers = phase["disk_tiers"]
        assert set(tiers) == {"disk_realtext_ram10", "disk_realtext_ram30"}
        for kind, figures in tiers.items():
            assert figures["steps"] == 2 and figures["hbm_slots"] > 0 and figures["hbm_lookups"] > 0, kind
            assert 0 <= figures["hbm_hit_rate"] <= 1 and 0 <= figures["ram_hit_rate"] <= 1, figures
            assert figures["disk_rows"] == figures["ram_misses"] == figures["disk_reads_per_step"] * 2
            assert figures["ram_lookups"] >= figures["hbm_misses"]  # the RAM cache serves the HBM misses
            assert figures["ram_hits"] + figures["ram_misses"] == figures["ram_lookups"]
            assert phase["disk_warm"][kind]["lookups"] >= 1
            timed_reads += figures["disk_rows"]
        assert tiers["disk_realtext_ram10"]["ram_slots"] < tiers["disk_realtext_ram30"]["ram_slots"]
    assert sum(read_rows) >= timed_reads > 0
    decode64 = next(p for p in report["phases"] if p["mode"] == "decode")
    tiers = decode64["disk_tiers"]["disk_realtext_ram10"]
    assert report["disk_hbm_hit_rate_realtext_ram10_T64"] == tiers["hbm_hit_rate"]
    assert report["disk_ram_hit_rate_realtext_ram10_T64"] == tiers["ram_hit_rate"]
    assert report["disk_reads_per_step_realtext_ram30_T64"] == decode64["disk_tiers"]["disk_realtext_ram30"][
        "disk_reads_per_step"]
    assert report["disk_vs_device_decode_T64_realtext_ram10_pct"] == decode64["pairs"][
        "disk_prefetch_realtext_ram10_vs_device_eager"]["pct"]
    assert report["disk_vs_host_decode_T64_realtext_ram30_pct"] == decode64["pairs"][
        "disk_prefetch_realtext_ram30_vs_host_prefetch_realtext"]["pct"]
    assert report["disk_vs_device_prefill_T8192_realtext_ram10_pct"] is None  # no such phase here
    assert "disk_realtext_ram10: HBM hits" in capsys.readouterr().out


def test_disk_variants_say_why_they_do_not_run(bench, tmp_path):
    api = {"kv_ahead": True, "forward_layer_takes_prefetch": True}
    plain = {v.name: v for v in bench.make_variants({}, api, cuda=True)}
    for name in DISK_VARIANTS:
        assert plain[name].status == "skipped (no --disk-directory)" and plain[name].eager and plain[name].realtext
    assert plain["device_eager"].status.startswith("skipped") and plain["device_eager"].eager
    assert not plain["device"].eager and not plain["device_again"].eager
    built = {v.name: v for v in bench.make_variants({"disk_realtext_ram30": None}, api, cuda=True,
                                                    disk_status={"disk_realtext_ram10": "skipped (x)"})}
    assert built["disk_prefetch_realtext_ram30"].status is None and built["device_eager"].status is None
    assert built["disk_prefetch_realtext_ram10"].status == "skipped (x)"
    assert bench.ram_fractions("0.3, 0.1") == ["disk_realtext_ram30", "disk_realtext_ram10"]
    path = tmp_path / "step.json"  # no --disk-directory: the default run skips them, saying why
    assert bench.main(["--smoke", "--json", str(path), "--decode-tokens", "", "--prefill-tokens", "16",
                       "--variants", "device_again"]) == 0
    variants = json.loads(path.read_text())["phases"][0]["variants"]
    assert variants["disk_prefetch_realtext_ram10"]["status"] == "skipped (no --disk-directory)"


@pytest.mark.parametrize("flags, named", [
    (["--disk-ram-fractions", "0.2"], "--disk-ram-fractions"),
    (["--disk-ram-fractions", "x"], "--disk-ram-fractions"),
    (["--disk-directory", "{tmp}/absent"], "--disk-directory"),
    (["--write-disk-tables"], "--disk-directory"),
    (["--variants", "disk_prefetch_realtext_ram10"], "--disk-directory"),
    (["--disk-directory", "{tmp}", "--disk-ram-fractions", "0.1", "--variants", "disk_prefetch_realtext_ram30"],
     "--disk-ram-fractions"),
    (["--disk-steps", "0"], "--disk-steps"),
    (["--disk-read-threads", "-1"], "--disk-read-threads"),
    (["--disk-hbm-fraction", "1.5"], "--disk-hbm-fraction"),
])
def test_bad_disk_options_are_one_clear_error(bench, capsys, tmp_path, flags, named):
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--smoke"] + [flag.format(tmp=tmp_path) for flag in flags])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert named in err and err.count("error:") == 1, err


def test_the_hbm_fraction_option_sizes_the_disk_tables_caches(monkeypatch):
    monkeypatch.syspath_prepend(str(STEP))
    import step_engram

    default = step_engram.disk_options(1000, 0, 0.1, "/d", 8, smoke=True)
    given = step_engram.disk_options(1000, 0, 0.1, "/d", 8, smoke=True, hbm_fraction=0.02)
    assert default["cache_fraction"] == step_engram.realtext_cache_fraction(1000, 0, True)
    assert given == {**default, "cache_fraction": 0.02}


def test_row_files_are_checked_against_the_rows_they_name(monkeypatch, tmp_path):
    """A row file is reused only where it holds the rows: a digest naming other bytes is caught by the sample
    of rows compared; without writing, a missing file is FileNotFoundError naming --write-disk-tables."""
    monkeypatch.syspath_prepend(str(STEP))
    import step_engram

    values, scales = step_engram.cpu_table_rows(300, 64, seed=1)
    with pytest.raises(FileNotFoundError, match="--write-disk-tables"):
        step_engram.disk_row_file(values, scales, tmp_path, 1, digest="rows-a", write=False)
    row_file, _, written = step_engram.disk_row_file(values, scales, tmp_path, 1, digest="rows-a")
    assert written and row_file.layout.num_rows == 300
    assert step_engram.disk_row_file(values, scales, tmp_path, 1, digest="rows-a", write=False)[2] is False
    other_values, other_scales = step_engram.cpu_table_rows(300, 64, seed=2)
    with pytest.raises(ValueError, match="differs from the table's rows"):
        step_engram.disk_row_file(other_values, other_scales, tmp_path, 1, digest="rows-a")
    plan = step_engram.TextPlan(warm=100, cursors=(120, 140), prompt=20, steps=5)
    assert step_engram.disk_warm_segments(plan, 16, False, 4) == [(36, 64)]  # the 4 x 16 tokens before the steps
    assert step_engram.disk_warm_segments(plan, 16, False, 0) == []
    assert step_engram.disk_warm_segments(plan, 2, True, 1) == [(100, 20), (120, 20)]  # whole prompts: 8192 / 2
    monkeypatch.setattr(step_engram, "DISK_WARM_PIECE", 16)
    assert step_engram.disk_warm_segments(plan, 2, True, 1) == [(112, 8), (132, 8)]  # each prompt's last 16 / 2


def test_disk_figures_and_keys_follow_their_definitions(figures):
    before = {"hbm_calls": 2, "hbm_hits": 10, "hbm_misses": 30, "hbm_admitted": 30, "ram_calls": 2, "ram_hits": 5,
              "ram_misses": 25, "ram_admitted": 25, "prefetched_rows": 0, "reread_rows": 0, "direct_reads": 2,
              "hbm_slots": 100, "ram_slots": 500}
    after = {**before, "hbm_hits": 70, "hbm_misses": 90, "ram_hits": 25, "ram_misses": 65, "hbm_calls": 6,
             "ram_calls": 6, "prefetched_rows": 60}
    tiers = figures.disk_figures(before, after, 4, 272)
    assert tiers["hbm_lookups"] == 120 and tiers["hbm_hit_rate"] == pytest.approx(0.5)
    assert tiers["ram_lookups"] == 60 and tiers["ram_hit_rate"] == pytest.approx(20 / 60)
    assert tiers["disk_rows"] == 40 and tiers["disk_reads_per_step"] == 10 and tiers["disk_bytes_per_step"] == 2720
    assert tiers["hbm_slots"] == 100 and tiers["steps"] == 4 and tiers["prefetched_rows"] == 60
    assert figures.disk_figures(before, {**after, "hbm_slots": 0}, 4, 272)["hbm_hit_rate"] is None  # no HBM cache

    def pair(pct):
        return {"pct": pct, "ci95_pct": [pct - 1, pct + 1]}

    name = "disk_prefetch_realtext_ram10"
    report = {"phases": [
        {"mode": "decode", "T": 64, "variants": {}, "disk_tiers": {"disk_realtext_ram10": tiers},
         "pairs": {f"{name}_vs_device_eager": pair(30.0), f"{name}_vs_device": pair(35.0),
                   f"{name}_vs_host_prefetch_realtext": pair(29.0), "device_eager_vs_device": pair(4.0)}},
        {"mode": "prefill", "T": 8192, "variants": {},
         "pairs": {f"{name}_vs_device": pair(250.0), f"{name}_vs_device_eager": pair(1.0)}}]}
    keys = figures.headline(report)
    assert keys["disk_vs_device_decode_T64_realtext_ram10_pct"] == 30.0  # the eager control at decode
    assert keys["disk_vs_device_decode_T64_realtext_ram10_ci95_pct"] == [29.0, 31.0]
    assert keys["disk_vs_device_prefill_T8192_realtext_ram10_pct"] == 250.0  # device, eager there
    assert keys["disk_vs_host_decode_T64_realtext_ram10_pct"] == 29.0
    assert keys["device_eager_vs_device_decode_T64_pct"] == 4.0
    assert keys["disk_hbm_hit_rate_realtext_ram10_T64"] == pytest.approx(0.5)
    assert keys["disk_reads_per_step_realtext_ram10_T64"] == 10
    assert keys["disk_reads_per_step_realtext_ram10_T8192"] is None
    assert keys["disk_vs_device_decode_T64_realtext_ram30_pct"] is None
