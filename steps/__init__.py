"""eaglenest's steps: plain Python (no Prefect), each runnable alone as `python -m steps.<name>`.

The folder is the layer:

    steps/<step>.py   the ten steps (target, datagen, extract, mapping, train, export, verify, serve,
                      benchmark, gate) and the two tools (doctor, convert): each reads its inputs, does its
                      one job and writes one artifact; a step imports only `steps.lib` and `steps.registry`
    steps/registry.py the one table of steps and the CLI every step shares (`step_main`)
    steps/warm_start.py a process started before its step is known (the orchestrator's spare)
    steps/lib/        the library the steps share, in folders named by concern (its __init__ is the map);
                      it imports nothing of `steps` outside `steps/lib/`

`flows/` (Prefect) sits above: it calls steps through `steps.registry` and never touches tensors.
"""
