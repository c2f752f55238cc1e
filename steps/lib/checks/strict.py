"""The export's strict checker: every key, shape, dtype and config field of an engine draft directory.

Export and convert run it on what they just wrote, and nothing is published unless it finds nothing:
a directory that passes is served by the engine exactly as trained. It owns no rule itself; each
finding comes from its catalogue row's module (F1 capture flag, F2 keys, F3 vocab map, F4 layer ids,
F5 context, F7 config schema), the same checks serve's preflight and doctor run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from steps.lib.checks.algorithm import check_aux_capture_flag
from steps.lib.checks.config import config_findings
from steps.lib.checks.context import check_context
from steps.lib.checks.finding import Finding
from steps.lib.checks.keys import key_findings
from steps.lib.checks.layers import layer_id_findings
from steps.lib.checks.vocab import vocab_findings
from steps.lib.config import InputError
from steps.lib.formats import (
    CONFIG_FILE,
    KEY_MAPS,
    ST_DTYPES,
    WEIGHTS_FILE,
    draft_config,
    engine_key_map,
    layer_config,
    read_json,
)


class FormatError(ValueError):
    """An engine directory that would be served wrongly; the message lists every finding."""


def tensor_meta(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key → (shape, dtype name) of a safetensors file, without reading the tensors; a truncated or corrupt
    file is an `InputError` naming it."""
    try:
        with safe_open(str(path), "pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), ST_DTYPES.get(f.get_slice(k).get_dtype(),
                                                                          f.get_slice(k).get_dtype()))
                    for k in f.keys()}
    except SafetensorError as err:
        raise InputError(f"{path}: not a readable safetensors file ({err}: truncated or corrupt); copy or "
                         "export it again") from None


def check_engine_dir(path: str | Path, engine: str, *, expect: dict[str, Any] | None = None) -> list[Finding]:
    """Every finding on an engine draft directory; [] when it is servable as trained.

    `expect` (optional): `layer_ids` (internal convention), `vocab_size` / `hidden_size` /
    `context_length` of the target, `draft_vocab_size`, `dtype`.
    """
    path, expect = Path(path), expect or {}
    key_map = engine_key_map(engine)
    for name, row in ((CONFIG_FILE, "F7"), (WEIGHTS_FILE, "F2")):
        if not (path / name).is_file():
            return [Finding(row, "fail", f"{path}/{name}", "file missing", "re-export with steps.export")]
    where, weights_where = f"{path.name}/{CONFIG_FILE}", f"{path.name}/{WEIGHTS_FILE}"
    config = read_json(path / CONFIG_FILE)
    layer = layer_config(config, engine)
    findings = config_findings(config, engine, where, expect={k: expect[k] for k in ("hidden_size",
                               "draft_vocab_size", "dtype") if k in expect})
    findings += check_aux_capture_flag(config, engine, where)
    findings += layer_id_findings(config, engine, expect.get("layer_ids"), where,
                                  target_arch=expect.get("target_architecture"))
    if "context_length" in expect:
        context = check_context(layer.get("max_position_embeddings"), expect["context_length"],
                                where=f"{where}:max_position_embeddings")
        findings += [context] if context.status != "pass" else []
    try:
        shape = draft_config(config, engine)
    except (KeyError, TypeError, ValueError):
        shape = None        # the missing fields are reported above; shapes cannot be checked
    dtype = config.get("torch_dtype") or layer.get("torch_dtype")
    findings += key_findings(tensor_meta(path / WEIGHTS_FILE), engine, shape,
                             dtype=dtype if isinstance(dtype, str) else None, where=weights_where)
    with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
        keys = set(f.keys())
        d2t, t2d = (f.get_tensor(key_map[k]) if key_map[k] in keys else None for k in ("d2t", "t2d"))
    findings += vocab_findings(d2t, t2d, draft_vocab=shape.draft_vocab_size if shape else None,
                               vocab=layer.get("vocab_size"), target_vocab=expect.get("vocab_size"),
                               where=weights_where, config_where=where, d2t_key=KEY_MAPS[engine]["d2t"],
                               t2d_key=KEY_MAPS[engine]["t2d"])
    return findings


def assert_engine_dir(path: str | Path, engine: str, *, expect: dict[str, Any] | None = None) -> None:
    """`check_engine_dir`, raising FormatError listing every finding."""
    findings = check_engine_dir(path, engine, expect=expect)
    if findings:
        lines = "\n".join(f"  - {f}" for f in findings)
        raise FormatError(f"{path}: {len(findings)} problem(s) in the {engine} draft directory; "
                          f"it would be served wrongly without an error:\n{lines}")
