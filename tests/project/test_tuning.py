"""Tuned constants as data (engram.tuning): every key of every device file is known, typed and cites its
measurement; the modules read their tuned values from the loader (no literal left); the file is chosen by
the device's name; a bad file is refused naming the file, the key and the value; the files ship with the
package."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engram import tuning as tuning_module
from engram.tuning import (DEFAULT_KIND, DIRECTORY, NOTES_SOURCE, UNMEASURED, TuningError, device_files, device_kind,
                           kind_for_name, load, tuned, tuning)

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "engram"
DEFAULT = DIRECTORY / "default.toml"
DEVICE_FILES = sorted(path for path in DIRECTORY.glob("*.toml") if path.stem != DEFAULT_KIND)

# The tuned names each module reads from the loader (module-level, once at import).
TUNED_NAMES = {
    "hashing/launch.py": {"_BLOCK_TOKENS_BY_BATCH", "_BLOCK_TOKENS_LARGEST", "_NUM_WARPS", "_REQUEST_CHUNK_LARGEST",
                          "_WRITE_BLOCK", "_HISTORY_BLOCK"},
    "table/host_memory/gather.py": {"_MIN_WAVE_ROWS", "_MAX_WAVES", "_MAX_WAVES_NATIVE", "_WAVE_SHRINK",
                                    "_DEDUP_MIN_REPEATS", "_DEDUP_REMEASURE"},
    "table/host_memory/row_copy.py": {"MIN_ROWS_PER_THREAD"},
    "table/kernels/gather.py": {"_GPU_BF16_CONFIG", "_GPU_PACKED_CONFIG"},
    "table/kernels/gather_kernels.py": set(),
    "table/kernels/peer_gather.py": {"_BF16_SHAPE", "_PACKED_SHAPE"},
    "table/placements/cached.py": {"DEFAULT_CACHE_FRACTION"},
    "layer/module.py": set(),
    "layer/scaled_mm.py": {"MIN_ACTIVATION_ROWS"},
    "layer/gate.py": {"_COPIES_PER_PROGRAM", "_ELEMENTS_PER_THREAD", "_MAX_NUM_WARPS", "_EARLY_VALUE", "_CACHE_HINTS"},
    "layer/wkv_gemm.py": {"_SMALL_M_GPU_CONFIGS", "_GPU_CONFIGS", "_FUSED_EXTRA_STAGES", "SMALL_T_QUANTIZE_MAX_TOKENS",
                          "_QUANTIZE_SMALL", "_QUANTIZE_LARGE"},
    "options.py": {"DEFAULT_DIRECT_MAX_ROWS", "DEFAULT_CACHE_FRACTION", "DEFAULT_PREFETCH_DIRECT_MAX_ROWS"},
    "triton_launch.py": set(),
}
# Numbers these modules keep as literals: facts of a layout, a protocol or a safety bound, not measurements.
FACTS = {
    "table/host_memory/gather.py": {"_ID_BUFFERS",            # pinned id buffers in the native worker's ring
                                    "WAIT_IDLE_TIMEOUT_S",    # a wait that long is an error, not a hang
                                    "REPLAY_BOUND_S"},        # a replay waits no longer for the worker
    "table/kernels/gather_kernels.py": {"_SCALE_GROUP",       # values per UE8M0 scale byte (OCP MX)
                                        "_TWO_POW_120"},      # an exact fp32 constant of the E4M3 decode
    "table/kernels/peer_gather.py": {"_INTERPRETED_BLOCK_ROWS"},  # the interpreter's shape, CPU tests' speed
    "layer/scaled_mm.py": {"_TOKEN_PADDING"},                 # cuBLASLt's 16-byte alignment of the scale
    "layer/wkv_gemm.py": {"ACTIVATION_GROUP",                 # 1 x 128 scale groups, the FP8 recipe
                          "SMALL_M_MAX_TOKENS"},              # one 128-row tile of the split-K GEMM
}
LOADER_NAMES = {"_TUNED", "tuning", "tuned"}


def _entries(path: Path) -> dict[str, dict]:
    import tomllib

    with open(path, "rb") as handle:
        document = tomllib.load(handle)
    return {f"{area}.{key}": entry for area, keys in document.items() if area != "device" for key, entry in keys.items()}


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# ---- the files ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [DEFAULT, *DEVICE_FILES], ids=lambda p: p.name)
def test_every_key_is_known_and_typed(path):
    loaded = load(path) if path == DEFAULT else load(path, base=DEFAULT)
    default = load(DEFAULT)
    for name, entry in _entries(path).items():
        area, key = name.split(".")
        assert hasattr(getattr(loaded, area), key), name
        assert tuned(name, device="cpu") == getattr(getattr(default, area), key)  # the CPU reads default.toml


@pytest.mark.parametrize("path", [DEFAULT, *DEVICE_FILES], ids=lambda p: p.name)
def test_every_value_cites_its_measurement(path):
    """Each source is a heading of benchmarks/NOTES.md, or says that the value was never measured (and then
    a note says what it is); each measured value's note names the figure."""
    headings = {line.lstrip("#").strip() for line in (ROOT / "benchmarks" / "NOTES.md").read_text().splitlines()
                if line.startswith("#")}
    for name, entry in _entries(path).items():
        source = entry["source"]
        if source == UNMEASURED:
            assert entry.get("note"), f"{path.name}: {name} is unmeasured and says nothing of what it is"
            continue
        assert source.startswith(NOTES_SOURCE) and source[len(NOTES_SOURCE):] in headings, f"{path.name}: {name}: {source}"
        assert re.search(r"\d", entry.get("note", "")), f"{path.name}: {name}: no figure in its note"


def test_default_holds_every_key_and_devices_claim_names():
    every = {f"{area}.{key}" for area, values in vars(load(DEFAULT)).items() for key in vars(values)}
    assert set(_entries(DEFAULT)) == every
    files = device_files()
    assert "h200" in files and files["h200"][1] == ("NVIDIA H200",) and files["h200"][2] == (9, 0)


# ---- the modules read the loader ----------------------------------------------------------------------------
def _module_assignments(path: Path):
    """``(name, value node)`` of every module-level assignment of ``path``."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ([target] if isinstance(target, ast.Name) else getattr(target, "elts", [])):
                    if isinstance(name, ast.Name):
                        yield name.id, node.value


def _is_numeric_literal(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(_is_numeric_literal(element) for element in node.elts)
    if isinstance(node, ast.BinOp):
        return _is_numeric_literal(node.left) and _is_numeric_literal(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_numeric_literal(node.operand)
    if isinstance(node, ast.Call):  # a launch shape built of literals: GatherConfig(block_rows=8, ...)
        arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
        return bool(arguments) and all(_is_numeric_literal(argument) for argument in arguments)
    return False


@pytest.mark.parametrize("module", sorted(TUNED_NAMES))
def test_tuned_names_come_from_the_loader(module):
    path = SRC / module
    assignments = list(_module_assignments(path))
    found = {name for name, _ in assignments}
    assert TUNED_NAMES[module] <= found, f"{module} no longer defines {sorted(TUNED_NAMES[module] - found)}"
    for name, value in assignments:
        if name in TUNED_NAMES[module]:
            used = {node.id for node in ast.walk(value) if isinstance(node, ast.Name)}
            assert used & LOADER_NAMES, f"{module}: {name} is not read from engram.tuning"
        elif name == "_TUNED":
            assert isinstance(value, ast.Attribute) and isinstance(value.value, ast.Call) and \
                getattr(value.value.func, "id", None) == "tuning" and not value.value.args, f"{module}: _TUNED"
        else:
            assert not _is_numeric_literal(value) or name in FACTS.get(module, set()), (
                f"{module}: {name} is a number set in code; a tuned one belongs in src/engram/tuning/*.toml, a "
                "fact in this test's FACTS")


def test_modules_hold_the_loaders_values():
    from engram import options
    from engram.hashing import launch
    from engram.layer import gate, scaled_mm, wkv_gemm
    from engram.table.host_memory import gather as host_gather, row_copy
    from engram.table.kernels import gather, peer_gather
    from engram.table.placements import cached

    values = tuning()
    assert launch._BLOCK_TOKENS_BY_BATCH == tuple((b.max_tokens, b.block_tokens) for b in values.hash.block_tokens_by_batch)
    assert launch.block_tokens_for(10**6) == values.hash.block_tokens_largest
    assert (host_gather._MAX_WAVES_NATIVE, host_gather._WAVE_SHRINK) == (values.host_gather.max_waves_native,
                                                                        values.host_gather.wave_shrink)
    assert row_copy.MIN_ROWS_PER_THREAD == values.row_copy.min_rows_per_thread
    assert gather._GPU_BF16_CONFIG.block_rows == peer_gather._BF16_SHAPE[0] == values.gather.bf16_block_rows
    assert cached.DEFAULT_CACHE_FRACTION == options.DEFAULT_CACHE_FRACTION == values.serving.cache_fraction
    assert options.ServingOptions().direct_max_rows == values.serving.direct_max_rows
    assert scaled_mm.padded_tokens(1) == values.wkv.min_activation_rows
    assert gate.gate_launch_config(8192, 4, 5120).num_warps == 8
    assert wkv_gemm.SMALL_T_QUANTIZE_MAX_TOKENS == values.wkv.quantize_small_max_tokens
    assert wkv_gemm._GPU_CONFIGS[-1][1].block_m == values.wkv.gemm_largest.block_m


# ---- which file ----------------------------------------------------------------------------------------------
def test_the_h200_file_for_an_h200_and_default_for_others():
    assert kind_for_name("NVIDIA H200") == kind_for_name("nvidia  h200", (9, 0)) == "h200"
    assert kind_for_name("NVIDIA H200", (8, 0)) == DEFAULT_KIND  # the name, but not the chip the file is for
    for other in ("NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "", None):
        assert kind_for_name(other) == DEFAULT_KIND
    assert device_kind("cpu") == DEFAULT_KIND


def test_the_process_device_picks_the_file(monkeypatch):
    monkeypatch.setattr(tuning_module, "_process_device", lambda: ("NVIDIA H200", (9, 0)))
    assert device_kind() == "h200" and tuning() is tuning_module._tuning_of_kind("h200")
    monkeypatch.setattr(tuning_module, "_process_device", lambda: ("NVIDIA B200", (10, 0)))
    assert device_kind() == DEFAULT_KIND and tuning() is tuning_module._tuning_of_kind(DEFAULT_KIND)
    monkeypatch.setattr(tuning_module, "_process_device", lambda: None)
    assert tuned("gather.bf16_block_rows") == load(DEFAULT).gather.bf16_block_rows


def test_a_device_file_overrides_default_and_inherits_the_rest(tmp_path):
    path = _write(tmp_path / "b200.toml", '[device]\nnames = ["NVIDIA B200"]\n\n[gather.bf16_block_rows]\n'
                                          'value = 32\nsource = "unmeasured"\nnote = "a guess"\n')
    loaded = load(path, base=DEFAULT)
    assert loaded.gather.bf16_block_rows == 32
    assert loaded.gather.packed_block_rows == load(DEFAULT).gather.packed_block_rows
    assert kind_for_name("NVIDIA B200", directory=tmp_path) == "b200"


def test_no_cuda_is_started_to_choose():
    """Choosing the process's file starts no CUDA context (the engine may fork or pick devices later)."""
    torch = pytest.importorskip("torch")
    tuning_module._process_device()
    assert not torch.cuda.is_initialized()


# ---- bad files -------------------------------------------------------------------------------------------------
DEVICE_HEADER = '[device]\nnames = ["NVIDIA X1"]\n\n'


@pytest.mark.parametrize("body, key, value", [
    ('[gather.bf16_blok_rows]\nvalue = 8\nsource = "unmeasured"\n', "gather.bf16_blok_rows", "8"),
    ('[gather.bf16_block_rows]\nvalue = "8"\nsource = "unmeasured"\n', "gather.bf16_block_rows", "'8'"),
    ('[gather.bf16_block_rows]\nvalue = 8.0\nsource = "unmeasured"\n', "gather.bf16_block_rows", "8.0"),
    ('[gather.bf16_block_rows]\nvalue = true\nsource = "unmeasured"\n', "gather.bf16_block_rows", "True"),
    ('[gather.bf16_block_rows]\nvalue = 6\nsource = "unmeasured"\n', "gather.bf16_block_rows", "6"),
    ('[host_gather.wave_shrink]\nvalue = 1.5\nsource = "unmeasured"\n', "host_gather.wave_shrink", "1.5"),
    ('[wkv.quantize_small]\nvalue = { block_t = 8, warps = 2 }\nsource = "unmeasured"\n', "wkv.quantize_small.warps",
     "2"),
    ('[hash.block_tokens_by_batch]\nvalue = [{ max_tokens = 64, block_tokens = 1 }, { max_tokens = 32, '
     'block_tokens = 4 }]\nsource = "unmeasured"\n', "hash.block_tokens_by_batch", "[64, 32]"),
    ('[gather.bf16_block_rows]\nvalue = 8\nsource = "measured somewhere"\n', "gather.bf16_block_rows",
     "'measured somewhere'"),
    ('[gather.bf16_block_rows]\nvalue = 8\n', "gather.bf16_block_rows", "None"),
    ('[gather.bf16_block_rows]\nvalue = 8\nsource = "unmeasured"\nwhy = "x"\n', "gather.bf16_block_rows", "'why'"),
    ('[gpu.threads]\nvalue = 8\nsource = "unmeasured"\n', "gpu", "8"),
])
def test_a_bad_file_is_refused_naming_file_key_and_value(tmp_path, body, key, value):
    path = _write(tmp_path / "x1.toml", DEVICE_HEADER + body)
    with pytest.raises(TuningError) as error:
        load(path, base=DEFAULT)
    message = str(error.value)
    assert str(path) in message and key in message and value in message, message


def test_default_must_hold_every_key(tmp_path):
    text = DEFAULT.read_text(encoding="utf-8")
    cut = re.sub(r"\[row_copy\.min_rows_per_thread\]\n(?:.+\n)+", "", text)
    path = _write(tmp_path / "default.toml", cut)
    with pytest.raises(TuningError, match=r"default\.toml: row_copy\.min_rows_per_thread: missing key"):
        load(path)


def test_a_bad_device_table_or_a_name_claimed_twice_is_refused(tmp_path):
    with pytest.raises(TuningError, match=r"x1\.toml: device\.names: expected"):
        load(_write(tmp_path / "x1.toml", '[device]\nnames = "NVIDIA X1"\n'), base=DEFAULT)
    with pytest.raises(TuningError, match=r"x1\.toml: device: expected"):
        load(_write(tmp_path / "x1.toml", '[gather.bf16_block_rows]\nvalue = 8\nsource = "unmeasured"\n'), base=DEFAULT)
    _write(tmp_path / "x1.toml", DEVICE_HEADER)
    _write(tmp_path / "x2.toml", '[device]\nnames = ["nvidia x1"]\n')
    with pytest.raises(TuningError, match=r"x2\.toml: device\.names: 'nvidia x1' is claimed by .*x1\.toml"):
        device_files(tmp_path)
    with pytest.raises(TuningError, match=r"broken\.toml: cannot be read"):
        load(_write(tmp_path / "broken.toml", "[gather\n"))


def test_unknown_name_for_tuned():
    with pytest.raises(KeyError, match="gather.nothing"):
        tuned("gather.nothing")


# ---- shipped with the package ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_files_ship_with_the_package(tmp_path):
    """A wheel built from the project holds every tuning file, and the loader installed from it reads them
    from its own directory (no source tree on the path)."""
    tree = tmp_path / "project"
    shutil.copytree(SRC, tree / "src" / "engram", ignore=shutil.ignore_patterns("__pycache__", "_native_gather*"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(tree)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("engram-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.startswith("engram/tuning/")}
        assert {f"engram/tuning/{path.name}" for path in [DEFAULT, *DEVICE_FILES]} <= shipped
        archive.extractall(tmp_path / "installed")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import engram.tuning as t, pathlib; "
             "assert pathlib.Path(t.__file__).is_relative_to(pathlib.Path(sys.argv[1])), t.__file__; "
             "assert t.load(t.DIRECTORY / 'default.toml') == t._tuning_of_kind('default'); "
             "assert sorted(t.device_files()) == sorted(sys.argv[2:]); print(t.DIRECTORY)")
    # -S -E: neither this checkout (an editable install's path file) nor the environment on the path.
    run = subprocess.run([sys.executable, "-S", "-E", "-c", probe, str(tmp_path / "installed"),
                          *(path.stem for path in DEVICE_FILES)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
