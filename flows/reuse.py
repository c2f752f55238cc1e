"""Steps resolved in the parent: a rerun whose artifacts exist starts no child run for them.

Every step is reusable by design (same inputs → same artifact id → not recomputed), but as a deployment
run each call still cost a child run: a worker pick-up, a fresh Python process, Prefect's start-up
(15-20 s each on a small machine; a fully reused tiny rerun took minutes). So the orchestrator keeps a
**call index** in the store: `calls/<key>.json` holds the record a step call returned, the key a hash of
(step, the resolved config, input ids, options, the artifact id schema). The same schema `artifact_id`
uses, not the git commit: a step called again after a commit returns its stored artifact all the same
(ids do not change with the code), so the index answers exactly what the child run would have. A later
call with the same key whose artifact still exists (its manifest is there) is answered from the index in
the parent, marked `"reused": true` with 0 seconds, without starting a child.

Which calls may be answered so:
- target, extract, mapping, train, export, verify: their artifact is a function of the key;
- never datagen: its artifact also depends on where it runs (a GPU's target writes in bf16, a CPU's in
  float32: other texts, another id, `steps.datagen.decoding`), which the parent does not know. Its child
  plans the id on its own device and returns the stored dataset when there is one;
- benchmark without `spec_url` / `baseline_url` (servers the step starts itself; an external server
  may change behind the same URL, so it is always measured), first attempt only;
- serve, only when that benchmark is answered from the index: serve's artifact is a fresh server start
  (its id holds the start time), whose purpose is to fail early before a measurement. With the
  measurement already stored there is nothing to protect;
- never the gate: its decision depends on the `production` alias at the time it runs. When its benchmark
  was answered from the index, though, the gate has no live server to examine and only reads the store:
  the pipeline then runs it in its own process (`mode="local"` for that call) instead of a child run.
The pipeline's `reuse=False` parameter turns this off (every step a child run; steps still reuse their
artifacts themselves).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from steps.lib.store import ID_SCHEMA, Store, canonical_json

INDEX_PREFIX = "calls"
#: steps whose record is a function of the call key
PURE = frozenset({"target", "extract", "mapping", "train", "export", "verify"})


def deciding_call(step: str, options: dict[str, Any],
                  inputs: dict[str, str]) -> tuple[str, dict[str, Any], dict[str, str]] | None:
    """The call whose index entry decides whether this one is answered in the parent (see the module
    docstring), or None when it must run."""
    if step in PURE:
        return step, options, inputs
    external = any(options.get(k) for k in ("spec_url", "baseline_url"))
    if step == "benchmark" and not external and options.get("attempt", 1) == 1:
        return step, options, inputs
    if step == "serve":
        return "benchmark", {"spec_url": None, "baseline_url": None}, inputs
    return None


def call_key(step: str, config: dict[str, Any], inputs: dict[str, str], options: dict[str, Any]) -> str:
    blob = canonical_json({"step": step, "config": config, "inputs": inputs,
                           "options": {k: v for k, v in options.items() if v is not None}, "schema": ID_SCHEMA})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def resolve(store: Store, step: str, config: dict[str, Any], inputs: dict[str, str],
            options: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(the indexed record for this call, or None; the key to remember its result under, or None when this
    call is never answered from the index)."""
    decider = deciding_call(step, options, inputs)
    if decider is None:
        return None, None
    key = call_key(step, config, inputs, options)
    decided = decider == (step, options, inputs) or lookup(store, call_key(decider[0], config, decider[2],
                                                                          decider[1])) is not None
    hit = lookup(store, key) if decided else None
    return (as_reused(hit) if hit else None), key


def _object_key(key: str) -> str:
    return f"{INDEX_PREFIX}/{key}.json"


def lookup(store: Store, key: str) -> dict[str, Any] | None:
    """The record indexed under `key` if its artifact still exists, else None."""
    if store.stat(_object_key(key)) is None:
        return None
    record = json.loads(store.fetch_object(_object_key(key)).read_text())
    return record if store.exists(record["kind"], record["id"]) else None


def remember(store: Store, key: str, record: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "record.json"
        path.write_text(json.dumps(record, default=str))
        store.put_object(_object_key(key), path)


def as_reused(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "seconds": 0.0, "reused": True}
