"""Export: one trained draft → an SGLang directory and a vLLM (speculators) directory, strictly checked.

Reads: a `draft` artifact (canonical weights + `draft_config.json`) and the `target` artifact's
config. Writes: an `export` artifact with `sglang/` and `vllm/`, each `config.json` +
`model.safetensors` (floats in `export.dtype`, `d2t` int64, `t2d` bool). Key names and config
fields come from the tables in `steps/lib/formats/`; the same tables drive the strict checker,
which runs on every written directory before the manifest is committed, so a directory that an
engine would load wrongly (F2 keys, F3 vocab map, F4 layer ids, F5 context, F7 config) never
becomes an artifact.

    python -m steps.export --config tiny --draft <draft_id> --target <target_id>
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steps.lib import formats
from steps.lib.artifacts import load_draft, target_config
from steps.lib.checks.strict import assert_engine_dir
from steps.lib.config import PipelineConfig, config_dict, resolve_max_position_embeddings
from steps.lib.layer_ids import check_capturable, check_expressible, target_architecture, to_engine
from steps.lib.store import Manifest, Store, artifact_id
from steps.registry import step_main

STEP = "export"


def export_section(cfg: PipelineConfig) -> dict[str, Any]:
    """Everything in the config that changes the exported bytes (the artifact id hashes it)."""
    return {"export": config_dict(cfg.export), "context_length": cfg.target.context_length,
            "speculative_tokens": cfg.serve.num_steps, "verifier": verifier_name(cfg)}


def verifier_name(cfg: PipelineConfig) -> str:
    """How the vLLM directory names its target (`speculators_config.verifier.name_or_path`)."""
    return str(cfg.target.path) if cfg.target.source == "hf_dir" else cfg.target.display_name


def draft_layer_ids(meta: dict[str, Any], target_config: dict[str, Any], where: str,
                    engines: list[str] | tuple[str, ...] = ()) -> list[int]:
    """The internal aux ids the draft was trained on, checked capturable and expressible by the engines (F4)."""
    ids = meta.get("layer_ids")
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{where}: draft_config.json has no layer_ids (internal convention); cannot write the "
                         "engines' capture layers (F4). Re-run train.")
    check_capturable(ids, int(target_config["num_hidden_layers"]))
    for engine in engines:
        check_expressible(ids, engine, target_architecture(target_config))
    return [int(i) for i in ids]


def engine_config(engine: str, draft_fields: dict[str, Any], *, layer_ids: list[int], max_pos: int,
                  cfg: PipelineConfig, target_config: dict[str, Any]) -> dict[str, Any]:
    """config.json for one engine, built by its builder in steps/lib/formats/ (the ENGINES registry)."""
    return formats.CONFIG_BUILDERS[engine](
        draft_fields, layer_ids=layer_ids, max_position_embeddings=max_pos, dtype=cfg.export.dtype,
        verifier_name_or_path=verifier_name(cfg),
        verifier_architectures=list(target_config.get("architectures") or []),
        speculative_tokens=cfg.serve.num_steps)


def expectations(draft_fields: dict[str, Any], *, layer_ids: list[int], max_pos: int, dtype: str,
                 target_config: dict[str, Any]) -> dict[str, Any]:
    """What the strict checker compares each written directory against."""
    return {"layer_ids": layer_ids, "target_architecture": target_architecture(target_config),
            "vocab_size": int(target_config["vocab_size"]),
            "hidden_size": int(target_config["hidden_size"]), "context_length": max_pos,
            "draft_vocab_size": int(draft_fields["draft_vocab_size"]), "dtype": dtype}


def write_checked(out: Path, engine: str, state: dict[str, Any], *, config: dict[str, Any],
                  expect: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Write one engine directory, strict-check it (raises FormatError), return its manifest meta."""
    formats.write_engine_dir(out, engine, state, config, dtype=dtype)
    assert_engine_dir(out, engine, expect=expect)
    ids = to_engine(expect["layer_ids"], engine, expect.get("target_architecture"))
    return {"layer_ids": ids, "num_keys": len(formats.KEY_MAPS[engine]),
            "architectures": config["architectures"], "max_position_embeddings": expect["context_length"]}


def run(cfg: PipelineConfig, store: Store, draft_id: str, target_id: str) -> Manifest:
    """Write and strictly check each engine's directory; no manifest if any check fails."""
    section, inputs = export_section(cfg), {"draft": draft_id, "target": target_id}
    export_id = artifact_id("export", section, inputs)
    if store.exists("export", export_id):
        return store.manifest("export", export_id)
    tcfg = target_config(store, target_id)
    draft, meta = load_draft(store, draft_id)
    draft_fields = draft.cfg.to_dict()
    layer_ids = draft_layer_ids(meta, tcfg, f"draft {draft_id}", cfg.export.engines)
    max_pos = resolve_max_position_embeddings(cfg, tcfg)          # F5: from the target, never the draft
    expect = expectations(draft_fields, layer_ids=layer_ids, max_pos=max_pos, dtype=cfg.export.dtype,
                          target_config=tcfg)
    writer = store.begin("export", export_id, step=STEP, inputs=inputs, config=section)
    state = draft.state_dict()
    engines = {}
    for engine in cfg.export.engines:
        config = engine_config(engine, draft_fields, layer_ids=layer_ids, max_pos=max_pos, cfg=cfg,
                               target_config=tcfg)
        engines[engine] = write_checked(writer.staging / engine, engine, state, config=config, expect=expect,
                                        dtype=cfg.export.dtype)
    return writer.commit(metrics={"num_keys": {e: m["num_keys"] for e, m in engines.items()}},
                         meta={"engines": engines, "internal_layer_ids": layer_ids, "dtype": cfg.export.dtype,
                               "draft_max_position_embeddings": draft_fields["max_position_embeddings"]})


def main(argv: list[str] | None = None) -> int:
    return step_main("export", argv)


if __name__ == "__main__":
    raise SystemExit(main())
