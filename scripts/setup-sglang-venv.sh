#!/usr/bin/env bash
# Create .venv-sglang: SGLang 0.5.23 with only what `sglang.srt.server_args` needs, on a CPU.
#
# tests/integration/test_sglang_parser.py runs our launch commands through SGLang's own parser and
# ServerArgs resolution in this venv, so a flag SGLang renamed (--cuda-graph-max-bs) or an algorithm
# it resolves differently fails a test here instead of a GPU server start. sglang is installed
# --no-deps from a fully pinned list (requirements/sglang-parser.txt): its declared dependencies
# would pull a CUDA torch and ~11 GB of GPU kernels.
#
# Idempotent: a stamp file records the hash of the inputs; re-running with the same inputs is a no-op.
# Usage: scripts/setup-sglang-venv.sh [VENV_DIR]   (default .venv-sglang; PYTHON=python3.11 to choose)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
REQS=requirements/sglang-parser.txt
CONSTRAINTS=requirements/constraints.txt
STAMP="$VENV/.installed"

inputs_hash() { cat "$REQS" "$CONSTRAINTS" "$0" | sha256sum | cut -d' ' -f1; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(inputs_hash)" ]]; then
    echo "$VENV is up to date (delete $STAMP to reinstall)"
    exit 0
fi

started=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# --no-deps: the list is complete and pinned; constraints keep torch on the CPU wheel
"$VENV/bin/pip" install -q --no-deps -c "$CONSTRAINTS" -r "$REQS"
# the import that the parser test needs (also creates ~/.cache/sglang on first use)
"$VENV/bin/python" -c "from sglang.srt.server_args import ServerArgs; import sglang; print('sglang', sglang.__version__)"
inputs_hash > "$STAMP"
echo "$VENV ready in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
