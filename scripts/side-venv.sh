# Shared by the scripts that build a side venv (setup-sglang-venv.sh, setup-speculators-venv.sh); source it
# after setting VENV, REQS and PYTHON. A stamp file records the hash of the inputs (the requirements, the
# constraints and the calling script), so re-running with the same inputs is a no-op.
# shellcheck shell=bash
CONSTRAINTS=requirements/constraints.txt
STAMP="$VENV/.installed"

inputs_hash() { cat "$REQS" "$CONSTRAINTS" "$0" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(inputs_hash)" ]]; then
    echo "$VENV is up to date (delete $STAMP to reinstall)"
    exit 0
fi

started=$(date +%s)
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"

# call last: stamp the venv and say what it cost
side_venv_done() {
    inputs_hash > "$STAMP"
    echo "$VENV ready in $(( $(date +%s) - started )) s, $(du -sh "$VENV" | cut -f1)"
}
