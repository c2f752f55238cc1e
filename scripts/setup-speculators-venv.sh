#!/usr/bin/env bash
# Create .venv-speculators: speculators 0.9.0 (vLLM's draft trainer) on a CPU torch, for the parity
# harness (benchmarks/quality_parity.py), which trains its Eagle3DraftModel in this venv as a subprocess.
#
# speculators is installed --no-deps: its declared dependencies pull torchvision/torchaudio, openai,
# datasets and hs-connectors, none of which its EAGLE-3 model or training forward uses (the harness
# puts stand-in modules for `openai`/`datasets` on the path). The rest resolves with constraints that
# keep torch on the CPU wheel.
#
# Idempotent: a stamp file records the hash of the inputs; re-running with the same inputs is a no-op.
# Usage: scripts/setup-speculators-venv.sh [VENV_DIR]   (default .venv-speculators; PYTHON=python3.11)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-speculators}"
PYTHON="${PYTHON:-python3}"
REQS=requirements/speculators.txt
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
NO_DEPS='^(speculators|hs-connectors)=='
grep -Ev "$NO_DEPS" "$REQS" | "$VENV/bin/pip" install -q -c "$CONSTRAINTS" -r /dev/stdin
grep -E "$NO_DEPS" "$REQS" | "$VENV/bin/pip" install -q --no-deps -r /dev/stdin
inputs_hash > "$STAMP"
echo "$VENV ready in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
