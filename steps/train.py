"""Training-time-test (TTT) training of the EAGLE-3 draft.

Reads: a `hidden` artifact (aux + final hidden-state shards, `steps/lib/data/shards.py`, streamed through a
bounded local cache: F8), a `vocab` artifact (`d2t`/`t2d`, validated by `steps/mapping.py`: F3) and
the `target` artifact (only its embedding and the lm_head rows of the draft vocab are read).
Writes: a `draft` artifact: `model.safetensors` (canonical SGLang keys, fp32, with `d2t`/`t2d`),
`draft_config.json` (the `DraftConfig`, the aux `layer_ids` in the internal convention (F4), the
target's shape and context length (F5)) and `train_log.jsonl`.

The unroll follows docs/ARCHITECTURE.md "Draft semantics", the contract the reference engine
drafts with. Stream position p holds (token x[p+1], feature of p):
  step 0   token x[p+1], feature = aux states f[p] (through fc), position id p;
  step j   token x[p+1+j], feature = the draft's own out_hidden of step j-1 at p, position id p+j;
           attends to the step-0 keys at positions <= p of the same sequence and to its own chain
           keys of steps 1..j at p (the K/V of every step are computed once and kept in a
           `DraftCache`, exactly as the engine keeps them);
  loss     soft cross-entropy against softmax(target_lm_head(final[p+1+j])) over the draft vocab,
           weighted step_decay**j, on positions where x[p+2+j] is an assistant token of the same
           sequence that lies inside the draft vocab.
The last condition stands in for "the target's argmax at p+1+j is in the draft vocab": the data is
regenerated greedily by the target, so x[p+2+j] *is* that argmax, and checking it costs nothing
where the exact check needs the full target head (49k rows for SmolLM2) at every position.

Cost: step 0 runs every position (each is a real key); chain step j >= 1 runs only the positions
whose chain still reaches a counted prediction (about the assistant spans), and the draft's lm_head
and the target's head rows run only where a prediction is counted. Sequences are packed into rows
of `max_length` (block-diagonal attention: no sequence sees another), rows into batches of
~`batch_tokens`, in a seeded order planned before the first step (every shard of every epoch).
Checkpoints (model, AdamW, step, RNG) go into the artifact's staging folder every
`checkpoint_every` steps; a re-run resumes from the latest one.

Several GPUs: `torchrun --nproc-per-node N -m steps.train ...` (`steps/lib/runtime/distributed.py`). Each rank
takes every N-th row of each planned batch; the loss is normalised by the global count of
predictions, so the N ranks take the optimizer steps one process takes on the same plan (the same
loss curve within float tolerance, and the same draft id). `train.parallel` picks DDP or FSDP.
Checkpoints hold full tensors keyed by name, written by rank 0, so a run resumes at any world size;
only rank 0 writes the log and the artifact.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from steps.lib.artifacts import DRAFT_CONFIG_FILE, DRAFT_MODEL_FILE, load_vocab, target_dir
from steps.lib.checks.vocab import validate_vocab
from steps.lib.config import PipelineConfig, resolve_aux_layer_ids, resolve_draft_shape, resolve_max_position_embeddings
from steps.lib.data.shards import save_sorted
from steps.lib.extraction.capture import make_backend
from steps.lib.extraction.sequences import read_sequences
from steps.lib.model.checkpoint_keys import text_prefix
from steps.lib.model.draft import DraftConfig, Eagle3Draft
from steps.lib.runtime import distributed
from steps.lib.store import Manifest, Store, artifact_id
from steps.lib.training.checkpoint import BEST_FILE, CKPT_PREFIX
from steps.lib.training.evaluate import held_out, load_eval_set
from steps.lib.training.loop import Setup, train_loop
from steps.lib.training.online import KeptShards, OnlineSource
from steps.lib.training.plan import ShardReader, auto_epochs, build_plan
from steps.registry import step_main

#: train fields that change how the work is spread over GPUs, not what is learned: the same draft
#: id at any world size (the loss curve is the same within float tolerance).
NOT_IN_ID = ("parallel", "fsdp_min_params", "online_memory")


# --- inputs: target head, draft shape -----------------------------------------------------------------

def read_target_head(tdir: Path, tcfg: dict[str, Any]) -> dict[str, Tensor]:
    """The target's `embed_tokens.weight`, `lm_head.weight` (the embedding when tied) and final
    `norm.weight` (absent from the result when the checkpoint has none), nothing else."""
    index = tdir / "model.safetensors.index.json"
    files = ({n: tdir / f for n, f in json.loads(index.read_text())["weight_map"].items()} if index.is_file()
             else dict.fromkeys(_safetensors_keys(tdir / "model.safetensors"), tdir / "model.safetensors"))
    prefix = text_prefix(list(files))                  # `language_model.` (Kimi-K2.5): names without it
    files = {n.removeprefix(prefix): (path, n) for n, path in files.items()}
    tied = bool(tcfg.get("tie_word_embeddings", False))
    out: dict[str, Tensor] = {}
    for name, want in (("embed_tokens.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        if want not in files:
            if name == "lm_head.weight" and tied:
                out[name] = out["embed_tokens.weight"]
                continue
            raise KeyError(f"{tdir}: no tensor {want!r} in the target's safetensors "
                           f"(tie_word_embeddings={tied}); is this a Llama-style HF checkpoint?")
        out[name] = _read_tensor(*files[want])
    if "model.norm.weight" in files:
        out["norm.weight"] = _read_tensor(*files["model.norm.weight"])
    return out


def _read_tensor(path: Path, key: str) -> Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(key).float()


def _safetensors_keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _rope_theta(tcfg: dict[str, Any]) -> float:
    # transformers 5 writes rope_parameters: {"rope_theta": ...}; older configs a top-level rope_theta
    params = tcfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", tcfg.get("rope_theta", 10000.0)))


def draft_config(cfg: PipelineConfig, tcfg: dict[str, Any], num_aux: int, d2t: Tensor) -> DraftConfig:
    shape = resolve_draft_shape(cfg, tcfg)
    return DraftConfig(**shape, rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(tcfg),
                       max_position_embeddings=resolve_max_position_embeddings(cfg, tcfg),
                       vocab_size=int(tcfg["vocab_size"]), draft_vocab_size=len(d2t),
                       target_hidden_size=int(tcfg["hidden_size"]), num_aux=num_aux)


# --- the step ---------------------------------------------------------------------------------------------

def hidden_source(cfg: PipelineConfig, store: Store, target_id: str, source_id: str, tcfg: dict[str, Any],
                  device: torch.device) -> tuple[ShardReader | OnlineSource, list[int]]:
    """Where the batches' hidden states come from -> (reader, captured layer ids): the `hidden` artifact
    `source_id` (offline), or the target run on `device` over the dataset `source_id` (online)."""
    if cfg.train.hidden_states == "online":
        ex = cfg.extract
        layer_ids = resolve_aux_layer_ids(cfg, int(tcfg["num_hidden_layers"]))
        backend = make_backend(cfg, store, target_id, layer_ids, tcfg, device, keep_on_device=True)
        return OnlineSource(backend, read_sequences(store, source_id, ex.max_length), ex.shard_tokens,
                            ex.batch_size, ex.storage_dtype, layer_ids,
                            cache=KeptShards(int(cfg.train.online_memory))), layer_ids
    hidden = store.manifest("hidden", source_id)
    budget = cfg.train.cache_budget or cfg.extract.disk_budget_bytes
    return ShardReader(store, hidden, int(budget), device), list(hidden.meta["layer_ids"])


def prepare(cfg: PipelineConfig, store: Store, target_id: str, source_id: str, vocab_id: str,
            device: torch.device | None = None) -> Setup:
    """Read the inputs, build the draft from the target and the plan of batches."""
    d2t, t2d = load_vocab(store, vocab_id)
    tdir = target_dir(store, target_id)
    tcfg = json.loads((tdir / "config.json").read_text())
    reader, layer_ids = hidden_source(cfg, store, target_id, source_id, tcfg, device or torch.device("cpu"))
    validate_vocab(d2t, t2d, int(tcfg["vocab_size"]))
    dcfg = draft_config(cfg, tcfg, len(layer_ids), d2t)
    head = read_target_head(tdir, tcfg)
    torch.manual_seed(cfg.seed)                   # every rank starts from the same weights
    model = Eagle3Draft.from_target(head, dcfg, d2t, t2d, init_lm_head=cfg.train.init_lm_head)
    if cfg.train.init_norm and "norm.weight" in head:
        # with the head copied too, the draft starts as the target's own head over its output
        with torch.no_grad():
            model.norm.weight.copy_(head["norm.weight"])
    model.lm_head.weight.requires_grad_(not cfg.train.freeze_lm_head)     # the optimizer takes what trains
    lengths = {rel: reader.lengths(rel) for rel in reader.shards()}
    t = cfg.train
    held = held_out(lengths, t.eval_fraction, cfg.seed) if t.eval_every else {}
    trained = sum(n for rel, ns in lengths.items() for i, n in enumerate(ns) if i not in held.get(rel, set()))
    epochs = auto_epochs(trained) if t.epochs == "auto" else t.epochs
    plan = build_plan(lengths, epochs=epochs, seed=cfg.seed, max_length=t.max_length,
                      rows_per_batch=max(1, t.batch_tokens // t.max_length), exclude=held)
    eval_set = (load_eval_set(reader, lengths, held, max_length=t.max_length, max_tokens=t.eval_max_tokens)
                if t.eval_every else None)
    meta = {**dcfg.to_dict(), "layer_ids": layer_ids,
            "target": {"num_hidden_layers": int(tcfg["num_hidden_layers"]), "hidden_size": int(tcfg["hidden_size"]),
                       "vocab_size": int(tcfg["vocab_size"]),
                       "max_position_embeddings": int(tcfg["max_position_embeddings"]),
                       "name": store.manifest("target", target_id).meta.get("name", cfg.target.display_name)}}
    return Setup(model, head["lm_head.weight"][d2t + torch.arange(len(d2t))], reader, plan, meta, eval_set,
                 num_steps=cfg.serve.num_steps)


def draft_id(cfg: PipelineConfig, inputs: dict[str, str]) -> str:
    """The `draft` artifact id: the train section (less how it is spread over GPUs), the seed, the inputs."""
    section = cfg.train.model_dump(mode="json", exclude=set(NOT_IN_ID))
    if section["hidden_states"] == "offline":        # the default leaves every existing draft id unchanged
        del section["hidden_states"]
    return artifact_id("draft", {"train": section, "seed": cfg.seed}, inputs)


def wall_phases(start: float, loaded: float, looped: float, trained: float, loop: dict[str, Any]) -> dict[str, Any]:
    """Where the train step's wall time went (perf_counter marks and the loop's own timers): `phases_s` with
    load (target head, vocab, shard lengths, eval set), the lease, the steps themselves (`train_s`: their first
    ones compile), the data (`read_s`: shard reads offline, the target's forward online), τ_sim (`eval_s`),
    checkpoints, the rest of the loop (batches to the device, the log, the bar) and saving the weights; `wall_s`
    their sum. The upload in `commit` comes after the manifest is written and is not in it. The loop's timers
    count a resumed run's earlier calls too (as `train_s` does, for its tok/s); the marks only this call's, so
    there `loop_other` is short by the earlier calls' share."""
    now = time.perf_counter()
    timed = {"train_steps": loop.get("train_s") or 0.0, "data": loop.get("read_s", 0.0),
             "tau_sim": loop.get("eval_s", 0.0), "checkpoints": loop.get("checkpoint_s", 0.0)}
    phases = {"load": loaded - start, "lease": looped - loaded, **timed,
              "loop_other": trained - looped - sum(timed.values()), "save": now - trained}
    return {"phases_s": phases, "wall_s": now - start}


def run(cfg: PipelineConfig, store: Store, target_id: str, hidden_id: str, vocab_id: str, *,
        on_step: Callable[[int, dict[str, Any]], None] | None = None) -> Manifest:
    """Train (or resume, or reuse) the draft for these inputs; `on_step(step, record)` after each step.
    `hidden_id` names the `hidden` artifact (train.hidden_states offline) or, online, the `dataset` the
    target computes the states of (the lineage names the dataset and the target; no hidden artifact exists).

    Under torchrun every rank calls this; rank 0 writes the artifact, the others return its manifest."""
    source = "dataset" if cfg.train.hidden_states == "online" else "hidden"
    inputs = {"target": target_id, source: hidden_id, "vocab": vocab_id}
    art_id = draft_id(cfg, inputs)
    if store.exists("draft", art_id):
        return store.manifest("draft", art_id)
    start = time.perf_counter()
    world = distributed.setup(cfg.train.device)
    setup = prepare(cfg, store, target_id, hidden_id, vocab_id, world.device)
    loaded = time.perf_counter()
    # One attempt per job (checkpoints are read by every rank): rank 0 takes the lease, the others join it.
    writer = store.begin("draft", art_id, step="train", inputs=inputs, config=cfg.train) if world.is_main else None
    attempt = distributed.all_gather_object(world, writer.attempt if writer else None)[0]
    if attempt == "reused":                                      # another run committed it while we waited
        return store.manifest("draft", art_id)
    if writer is None:
        writer = store.begin("draft", art_id, step="train", inputs=inputs, config=cfg.train, join=attempt)
    looped = time.perf_counter()
    metrics, weights = train_loop(cfg.train, setup, writer.staging, on_step, world)
    if world.is_main:
        trained = time.perf_counter()
        save_sorted(weights, writer.path(DRAFT_MODEL_FILE))
        writer.path(DRAFT_CONFIG_FILE).write_text(json.dumps(setup.meta, indent=2))
        for ckpt in writer.staging.glob(f"{CKPT_PREFIX}*"):      # resume state is not part of the artifact
            shutil.rmtree(ckpt)
        writer.path(BEST_FILE).unlink(missing_ok=True)
        metrics |= wall_phases(start, loaded, looped, trained, metrics)
        writer.commit(metrics=metrics, meta=setup.meta)
    distributed.barrier(world)                                   # the manifest exists for every rank now
    return store.manifest("draft", art_id)


def main(argv: list[str] | None = None) -> int:
    return step_main("train", argv)


if __name__ == "__main__":
    raise SystemExit(main())
