"""Artifact readers: one function per artifact kind, so no step imports another step to read its output.

A step writes its artifact (`store.begin(...).commit(...)`); every later step, tool and flow reads it
through here. Each reader verifies what it returns: files against the manifest (sizes and sha256,
`steps/lib/store/`), a recorded `hf_dir` target against its config hash, the vocab map against F3
(`steps/lib/checks/vocab.py`). File names shared by a writer and its readers are defined here once.

| kind      | written by          | read with                                                  |
|-----------|---------------------|------------------------------------------------------------|
| `target`  | steps/target.py     | `target_dir`, `target_config`, `load_target`, `load_tokenizer` |
| `dataset` | steps/datagen.py    | `read_conversations`                                        |
| `vocab`   | steps/mapping.py    | `load_vocab`                                                |
| `draft`   | steps/train.py      | `load_draft`                                                |
| `export`  | steps/export.py     | `export_dir`, `served_export` (a directory or an id, with its target) |
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steps.lib.checks.vocab import validate_vocab
from steps.lib.config import PipelineConfig
from steps.lib.home import local_path
from steps.lib.store import ARTIFACT_ID, ArtifactError, Store, artifact_id, content_sha256, open_store, sha256_file

if TYPE_CHECKING:
    import torch

    from steps.lib.model.draft import Eagle3Draft

# The orchestrator (flows/) reads paths and file names here and never tensors: torch is imported by the
# readers that return tensors, so that importing this module costs no torch (2.4 s and 200 MB on 2 cores).

# --- file names shared by writers and readers ----------------------------------------------------------

#: dataset: `conversations/part-{i:05d}.jsonl`, read in name order.
CONVERSATIONS_DIR = "conversations"
#: vocab: `d2t` int64 offsets and `t2d` bool in one safetensors file.
VOCAB_FILE = "vocab.safetensors"
#: draft: canonical weights (fp32, with d2t/t2d), the DraftConfig + layer ids + target facts, the log.
DRAFT_MODEL_FILE, DRAFT_CONFIG_FILE, DRAFT_LOG_FILE = "model.safetensors", "draft_config.json", "train_log.jsonl"

#: what the `smollm2` target is converted from and stored as (part of its artifact id).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: storage dtype of the converted SmolLM2 weights (compute is fp32 on CPU; bf16 halves the disk), by its
#: torch name: `str(torch.bfloat16)` is part of the target's artifact id.
SMOLLM2_STORAGE_DTYPE = "torch.bfloat16"


# --- target ----------------------------------------------------------------------------------------------

def config_sha256(model_dir: Path) -> str:
    """sha256 of a model directory's config.json ("" when absent): how a recorded `hf_dir` is pinned."""
    path = Path(model_dir) / "config.json"
    return sha256_file(path) if path.is_file() else ""


#: the files of an `hf_dir` model whose bytes are its identity: weights, configs and tokenizer (not a README).
HF_DIR_CONTENT = ("*.safetensors", "*.json", "tokenizer.model", "merges.txt", "vocab.txt")


def hf_dir_content(model_dir: Path) -> dict[str, str]:
    """{file name: sha256} of a model directory's weights, configs and tokenizer files (hashed once per
    file version: `content_sha256`), so a flipped byte or re-saved weights give the target a new id."""
    names = sorted({p.name for pat in HF_DIR_CONTENT for p in Path(model_dir).glob(pat) if p.is_file()})
    return {name: content_sha256(Path(model_dir) / name) for name in names}


def target_identity(cfg: PipelineConfig) -> dict[str, Any]:
    """What determines the target's weights (its artifact id); names and serving fields do not."""
    t = cfg.target
    if t.source == "tiny":
        return {"source": "tiny", "tiny": t.tiny.model_dump(mode="json"), "seed": cfg.seed}
    if t.source == "smollm2":
        return {"source": "smollm2", "gguf": SMOLLM2_GGUF, "storage_dtype": SMOLLM2_STORAGE_DTYPE}
    path = Path(str(t.path)).resolve()
    return {"source": "hf_dir", "path": str(path), "files_sha256": hf_dir_content(path)}


def target_artifact_id(cfg: PipelineConfig) -> str:
    """The id the target step gives (or gave) the target of this config."""
    return artifact_id("target", target_identity(cfg))


def target_dir(store: Store, target_id: str) -> Path:
    """A local HF model directory for a target artifact (verified against its manifest)."""
    m = store.manifest("target", target_id)
    if m.meta.get("source") != "hf_dir":
        return store.fetch("target", target_id)
    path = Path(m.meta["path"])
    if config_sha256(path) != m.meta["config_sha256"]:
        raise ArtifactError(f"{path}/config.json changed since target {target_id} was recorded; the draft "
                         "would be trained for a different model. Re-run the target step.")
    recorded = m.meta.get("files_sha256")       # absent in targets recorded before content ids
    if recorded is not None and (now := hf_dir_content(path)) != recorded:
        changed = sorted(n for n in {*now, *recorded} if now.get(n) != recorded.get(n))
        raise ArtifactError(f"{path}: {', '.join(changed)} changed since target {target_id} was recorded (its id "
                         "is the sha256 of these bytes); re-run the target step, which records the new content "
                         "under a new id")
    return path


def target_config(store: Store, target_id: str) -> dict[str, Any]:
    """The target's config.json: from a remote store that one file alone (not the weights), verified."""
    m = store.manifest("target", target_id)
    if m.meta.get("source") == "hf_dir":
        return json.loads((target_dir(store, target_id) / "config.json").read_text())
    return json.loads(store.fetch_file("target", target_id, "config.json", m).read_text())


def load_tokenizer(store: Store, target_id: str) -> Any:
    """The target's tokenizer; remote code only if the target config allowed it."""
    from transformers import AutoTokenizer

    m = store.manifest("target", target_id)
    return AutoTokenizer.from_pretrained(target_dir(store, target_id),
                                         trust_remote_code=bool(m.meta.get("trust_remote_code")))


def inference_device() -> str:
    """Where a step runs the target for decoding (datagen, verify): the first GPU when there is one.

    Decoding stays in float32 there too (the default of `load_target`): a 135M-1B target at batch 1 is
    bound by kernel launches, not arithmetic, and float32 keeps verify's speculative == plain greedy check
    free of bf16 near-ties between a one-token and a (k+1)-token forward."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(store: Store, target_id: str, *, device: str = "cpu", dtype: torch.dtype | None = None,
                tp_plan: str | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) in `dtype` (default float32); safetensors only, remote code only if
    the config allowed it. `tp_plan="auto"`: sharded over the joined process group by transformers' own
    tensor-parallel plan (every rank calls this together; each keeps its shard where transformers puts it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from steps.lib.model.checkpoint_keys import key_mapping

    m = store.manifest("target", target_id)
    path = target_dir(store, target_id)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, use_safetensors=True,
                                                 key_mapping=key_mapping(path),   # `language_model.` (K2.5)
                                                 trust_remote_code=bool(m.meta.get("trust_remote_code")),
                                                 **({"tp_plan": tp_plan} if tp_plan else {}))
    return (model if tp_plan else model.to(device)).eval(), load_tokenizer(store, target_id)


# --- dataset ---------------------------------------------------------------------------------------------

def conversations_path(chunk: int) -> str:
    """Where chunk `chunk` of a dataset's conversations lives inside the artifact."""
    return f"{CONVERSATIONS_DIR}/part-{chunk:05d}.jsonl"


def read_conversations(store: Store, dataset_id: str) -> Iterator[dict[str, Any]]:
    """The rows of a dataset artifact, chunk by chunk in order (each file verified)."""
    m = store.manifest("dataset", dataset_id)
    for rec in sorted(m.files, key=lambda r: r["path"]):
        if rec["path"].startswith(f"{CONVERSATIONS_DIR}/"):
            with open(store.fetch_file("dataset", dataset_id, rec["path"], m)) as f:
                for line in f:
                    yield json.loads(line)


# --- vocab -----------------------------------------------------------------------------------------------

def load_vocab(store: Store, vocab_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of a vocab artifact, validated (F3)."""
    from safetensors.torch import load_file

    m = store.manifest("vocab", vocab_id)
    tensors = load_file(str(store.fetch_file("vocab", vocab_id, VOCAB_FILE, m)))
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    target_vocab = int(m.meta.get("target_vocab", t2d.numel() if t2d is not None else 0))
    validate_vocab(d2t, t2d, target_vocab)
    return d2t, t2d


# --- draft -----------------------------------------------------------------------------------------------

def load_draft(store: Store, draft_id: str) -> tuple[Eagle3Draft, dict[str, Any]]:
    """(draft in eval mode, draft_config.json) of a draft artifact; the vocab map is re-validated (F3)."""
    from safetensors.torch import load_file

    from steps.lib.model.draft import DraftConfig, Eagle3Draft

    m = store.manifest("draft", draft_id)
    meta = json.loads(Path(store.fetch_file("draft", draft_id, DRAFT_CONFIG_FILE, m)).read_text())
    model = Eagle3Draft(DraftConfig.from_dict(meta))
    model.load_state_dict(load_file(str(store.fetch_file("draft", draft_id, DRAFT_MODEL_FILE, m))))
    validate_vocab(model.d2t, model.t2d, model.cfg.vocab_size)
    return model.eval(), meta


# --- export ----------------------------------------------------------------------------------------------

def export_dir(store: Store, export_id: str, engine: str) -> Path:
    """A verified local directory of one engine's export (`sglang` or `vllm`)."""
    m = store.manifest("export", export_id)
    if engine not in m.meta.get("engines", {}):
        raise ArtifactError(f"export {export_id} has no {engine!r} directory; it holds "
                            f"{sorted(m.meta.get('engines', {}))} (set export.engines to include {engine!r} and "
                            "re-run export)")
    return store.fetch("export", export_id) / engine


def served_export(draft: str, store_uri: str) -> tuple[Path, Path | None]:
    """An exported SGLang draft given as a directory or an export artifact id, and the target directory its
    lineage names: the export's manifest records the target it was trained for, so serving it needs no
    `--target-path`. A directory outside any file:// store (copied elsewhere, or downloaded) has no
    lineage: (its path, None). A directory may be given as the `file://` URI a run printed for it."""
    path = local_path(draft)
    if path.is_dir():
        found = _export_holding(path.resolve())
        if found is None:
            return path, None
        store, export_id = open_store(f"file://{found[0]}"), found[1]
    elif ARTIFACT_ID.fullmatch(draft):
        store, export_id = open_store(store_uri), draft
        path = export_dir(store, export_id, "sglang")
    else:
        raise FileNotFoundError(f"--draft {draft}: neither a directory nor an export artifact id (16 hex digits)")
    target_id = store.manifest("export", export_id).inputs.get("target")
    return path, (target_dir(store, target_id) if target_id else None)


def _export_holding(engine_dir: Path) -> tuple[Path, str] | None:
    """(store root, export id) when `engine_dir` is `<root>/artifacts/export/<id>/<engine>` of a file store."""
    art = engine_dir.parent
    if art.parent.name == "export" and art.parent.parent.name == "artifacts" and (art / "manifest.json").is_file():
        return art.parents[2], art.name
    return None
