"""The library the steps share; it imports nothing of `steps` outside `steps/lib/`. Where each concern lives:

    errors.py       the expected errors every layer raises (a bad config, a bad input file, a missing artifact)
    layer_ids.py    layer-id conventions (F4): internal ↔ each engine's ids, the default aux ids
    metrics.py      τ from raw accept counts (the one place it is computed)
    http.py         the one JSON-over-HTTP client (credentials kept out of errors)
    files.py        small files that survive a kill or a full disk: atomic writes, JSON-lines logs (torn last line)
    config/         the pipeline config: schema, overrides, derived values
    store/          the artifact store: ids, manifests, backends (file://, s3://), the commit protocol
    artifacts.py    one reader per artifact kind (what a step reads of another step's output)
    data/           prompt sources and held-out prompts, seeded topics, hidden-state shards
    model/          the EAGLE-3 draft, batched decoding with the target, the reference engine
    formats/        each serving engine's draft directory (one module per engine), SGLang's loading rules
    checks/         the failure catalogue F1–F9, one module per row, and export's strict checker
    layouts.py      any EAGLE-3 draft directory recognised, read back and converted
    diagnose.py     doctor's engine: every row on a directory (and a live server)
    extraction/     capture backends (hooks, SGLang) and the shard writer under the disk budget
    training/       the batch plan, the TTT unroll and loss, the loop, checkpoints, τ while training
    reference/      the reference server: the reference engine behind SGLang's HTTP API subset
    serving/        the launch command, preflight, start with the F6 fallback, server processes
    runtime/        background processes, torchrun/DDP, progress listeners, credential redaction
"""
