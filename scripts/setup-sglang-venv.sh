#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 with only what `sglang.srt.server_args` needs, on a CPU.
#
# tests/integration/test_sglang_parser.py runs our launch commands through SGLang's own parser and
# ServerArgs resolution in this venv, so a flag SGLang renamed (--cuda-graph-max-bs) or an algorithm
# it resolves differently fails a test here instead of a GPU server start. sglang is installed
# --no-deps from a fully pinned list (requirements/sglang-parser.txt): its declared dependencies
# would pull a CUDA torch and ~11 GB of GPU kernels.
#
# Idempotent (scripts/side-venv.sh): re-running with the same inputs is a no-op.
# Usage: scripts/setup-sglang-venv.sh [VENV_DIR]   (default .venv-sglang; PYTHON=python3.11 to choose)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
REQS=requirements/sglang-parser.txt
# shellcheck source=scripts/side-venv.sh
source scripts/side-venv.sh
# --no-deps: the list is complete and pinned; constraints keep torch on the CPU wheel
"$VENV/bin/pip" install -q --no-deps -c "$CONSTRAINTS" -r "$REQS"
# the import that the parser test needs (also creates ~/.cache/sglang on first use)
"$VENV/bin/python" -c "from sglang.srt.server_args import ServerArgs; import sglang; print('sglang', sglang.__version__)"
side_venv_done
