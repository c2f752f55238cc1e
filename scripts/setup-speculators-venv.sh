#!/usr/bin/env bash
# Create .venv-speculators: speculators 0.9.0 (vLLM's draft trainer) on a CPU torch, for the parity
# harness (benchmarks/quality_parity.py), which trains its Eagle3DraftModel in this venv as a subprocess.
#
# speculators is installed --no-deps: its declared dependencies pull torchvision/torchaudio, openai,
# datasets and hs-connectors, none of which its EAGLE-3 model or training forward uses (the harness
# puts stand-in modules for `openai`/`datasets` on the path). The rest resolves with constraints that
# keep torch on the CPU wheel.
#
# Idempotent (scripts/side-venv.sh): re-running with the same inputs is a no-op.
# Usage: scripts/setup-speculators-venv.sh [VENV_DIR]   (default .venv-speculators; PYTHON=python3.11)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${1:-.venv-speculators}"
PYTHON="${PYTHON:-python3}"
REQS=requirements/speculators.txt
# shellcheck source=scripts/side-venv.sh
source scripts/side-venv.sh
NO_DEPS='^(speculators|hs-connectors)=='
grep -Ev "$NO_DEPS" "$REQS" | "$VENV/bin/pip" install -q -c "$CONSTRAINTS" -r /dev/stdin
grep -E "$NO_DEPS" "$REQS" | "$VENV/bin/pip" install -q --no-deps -r /dev/stdin
side_venv_done
