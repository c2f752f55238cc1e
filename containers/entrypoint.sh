#!/bin/sh
# Entrypoint of every eaglenest image (cpu, gpu, serve).
#
#   <eaglenest command> [args]  -> eaglenest <command> [args]        e.g. `mapping --config ...`; the
#                                  commands are `eaglenest --commands` (steps/registry.py), not a list here
#   sglang [serve args]         -> exec the exact command `eaglenest serve --print-command [serve args]`
#                                  prints (preflight-checked; SGLang becomes PID 1 and gets the signals)
#   anything else               -> exec'd as given: Prefect's docker and kubernetes workers pass their
#                                  own command (`prefect flow-run execute`), and `python -m steps.x` works
#
# EAGLENEST_DRY_RUN=1 prints the argv that would be exec'd, one argument per line, and exits 0:
# how a machine without a GPU checks what the serve image would start (tests/containers).
set -eu

run() {
    if [ -n "${EAGLENEST_DRY_RUN:-}" ]; then
        printf '%s\n' "$@"
        exit 0
    fi
    exec "$@"
}

if [ "$#" -eq 0 ]; then
    run eaglenest --help
fi

case "$1" in
    sglang)
        shift
        # `eaglenest serve` refuses a command that fails preflight (F1, F4, F5, F7) with exit 1
        command_line=$(eaglenest serve --print-command "$@")
        # the printed line is shlex.join output: POSIX shell quoting, so eval splits it back exactly
        eval "set -- $command_line"
        run "$@"
        ;;
    -*)
        run eaglenest "$@"
        ;;
esac

# one Python start (the registry only, no torch) per container start: a new step needs no edit here
case " $(eaglenest --commands) " in
    *" $1 "*) run eaglenest "$@" ;;
    *) run "$@" ;;
esac
