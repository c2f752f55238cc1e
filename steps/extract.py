"""Extract: the target's aux and final hidden states for every dataset token, in rounds under a disk budget.

Reads a `target` artifact and a `dataset` artifact (tokenized conversations with loss masks);
writes a `hidden` artifact of shards (`steps/lib/data/shards.py`), each holding whole sequences.

Hidden states are huge (a 7168-wide target in bf16 costs 57 KB per token with three aux layers),
so F8 is the failure this step exists to prevent: 21M tokens filled 924 GB and 5× more data could
not fit a 1.8 TB disk. Local disk is therefore bounded by `extract.disk_budget`: a shard is written only
when its size bound fits beside the shards still awaiting upload, and each shard is uploaded, verified in
the store and deleted locally as soon as it is written. Capture (the GPU,
`steps/lib/extraction/capture.py`), writes and uploads (two host threads,
`steps/lib/extraction/shard_writer.py`) overlap, so the target runs at the speed of its bare forward
while the host keeps up. Peak local bytes are measured on disk (real file sizes, not estimates) and
recorded in the manifest; `rounds` counts the budget-fulls the data makes. A shard is the unit of resume:
shard i always holds the same sequences, an uploaded shard is never recomputed, and a killed run loses at
most the shards in flight.

The captured layers are recorded in the internal convention (F4: HF `hidden_states` index,
i = input of decoder layer i); the `sglang` backend converts to SGLang's ids (internal − 1)
through `steps/lib/layer_ids.py` and refuses a server that captures other layers.

On several GPUs (`torchrun --nproc-per-node N -m steps.extract ...`) each rank loads its own replica
of the target and takes a contiguous range of the shards still to do; the disk budget is shared
(each rank writes under budget / N, into its own scratch folder), and rank 0 writes the manifest once every rank's
shards are uploaded. The shards are the same files at any world size. Targets too large for one
GPU are extracted with `extract.backend=sharded` (transformers' tensor-parallel plan) or `sglang_runner`
(SGLang's own model runner in each rank, steps/lib/extraction/sglang_runner.py): one copy of the target over
the ranks, states binary to rank 0's writer. `extract.backend=sglang` asks SGLang servers through JSON.

    python -m steps.extract --config configs/tiny.yaml --target ID --dataset ID [--store URI] [--set k=v]
    torchrun --nproc-per-node 8 -m steps.extract --config C --target ID --dataset ID
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steps.lib.artifacts import target_config, target_dir
from steps.lib.checks.disk import check_disk_budget
from steps.lib.config import ConfigError, PipelineConfig, resolve_aux_layer_ids
from steps.lib.data.shards import bytes_per_token, check_storage_dtype, shard_bytes_bound, write_encoded
from steps.lib.extraction import sglang_runner
from steps.lib.extraction.capture import CaptureBackend, SGLangBackend, ShardedBackend, load_sharded, make_backend
from steps.lib.extraction.sequences import SHARD_PATH, capture_batches, group_sequences, read_sequences
from steps.lib.extraction.shard_writer import ShardJob, ShardWriter
from steps.lib.files import files_under
from steps.lib.layer_ids import target_architecture
from steps.lib.runtime import distributed
from steps.lib.store import ArtifactError, ArtifactWriter, Manifest, Store, artifact_id, sha256_file
from steps.registry import step_main

log = logging.getLogger("eaglenest.extract")

#: extract fields that change no byte of the output: the same shards are reused whatever the
#: budget, or wherever the servers run (a resumed run may raise the budget and keep its shards; a
#: moved server does not restart extraction, and a URL's credentials never reach the id).
NOT_IN_ID = ("disk_budget", "server_url", "final_server_url", "runner_mem_fraction")
#: backends whose ranks hold one target together (collective forwards): rank 0 extracts, the others follow.
SHARED_TARGET = ("sharded", "sglang_runner")


# --- inputs -------------------------------------------------------------------------------------

# --- planning -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardFormat:
    """What every shard of one `hidden` artifact holds: which layers (internal ids), how wide, stored how.
    Built once per run (the storage dtype checked there), handed to the planner, the capture and the writer."""
    layer_ids: tuple[int, ...]
    hidden_size: int
    storage_dtype: str

    def __post_init__(self) -> None:
        check_storage_dtype(self.storage_dtype)

    @property
    def num_aux(self) -> int:
        return len(self.layer_ids)

    def bytes_bound(self, tokens: int, sequences: int) -> int:
        return shard_bytes_bound(tokens, sequences, hidden_size=self.hidden_size, num_aux=self.num_aux,
                                 storage_dtype=self.storage_dtype)


@dataclass(frozen=True)
class DiskShare:
    """This rank's part of `extract.disk_budget` (F8): each of the job's ranks writes under budget / ranks."""
    budget_bytes: int
    world_size: int = 1

    @property
    def bytes(self) -> int:
        return self.budget_bytes // self.world_size

    def check_fits(self, shards: list[ShardPlan]) -> None:
        """Refuse, before any work, a budget whose share cannot hold the largest shard (a ConfigError: the fix
        is a config value, so the CLI prints it as one line, exit 2)."""
        too_big = max(shards, key=lambda s: s.bytes_bound) if shards else None
        if too_big is None or too_big.bytes_bound <= self.bytes:
            return
        ranks = f" shared by {self.world_size} ranks ({self.bytes} bytes each)" if self.world_size > 1 else ""
        raise ConfigError(
            f"extract.disk_budget={self.budget_bytes} bytes{ranks} cannot hold even one shard: shard "
            f"{too_big.index} ({too_big.tokens} tokens) needs up to {too_big.bytes_bound} bytes. "
            f"Raise extract.disk_budget to at least {too_big.bytes_bound * self.world_size}, or lower "
            f"extract.shard_tokens (or extract.max_length, which bounds a single sequence)")


@dataclass(frozen=True)
class ShardPlan:
    index: int
    sequences: tuple[int, ...]   # indices into the dataset's sequence list
    tokens: int
    bytes_bound: int             # an upper bound on the file's size

    @property
    def path(self) -> str:
        return SHARD_PATH.format(self.index)


def plan_shards(lengths: list[int], shard_tokens: int, fmt: ShardFormat) -> list[ShardPlan]:
    """Cut the sequence list, in order, into shards of about `shard_tokens` tokens (whole sequences).

    Deterministic in (lengths, shard_tokens): shard i of a resumed run holds the same sequences.
    A sequence longer than `shard_tokens` gets a shard of its own.
    """
    groups = group_sequences(lengths, shard_tokens)
    plans = []
    for k, seqs in enumerate(groups):
        t = sum(lengths[i] for i in seqs)
        plans.append(ShardPlan(k, tuple(seqs), t, fmt.bytes_bound(t, len(seqs))))
    return plans


def plan_rounds(shards: list[ShardPlan], share: DiskShare) -> list[list[ShardPlan]]:
    """Group shards into rounds whose summed size bound fits this rank's share of the disk budget (F8);
    `share.check_fits` has refused a shard that fits no round."""
    budget = share.bytes
    rounds: list[list[ShardPlan]] = [[]]
    used = 0
    for s in shards:
        if rounds[-1] and used + s.bytes_bound > budget:
            rounds.append([])
            used = 0
        rounds[-1].append(s)
        used += s.bytes_bound
    return [r for r in rounds if r]


# --- rounds -------------------------------------------------------------------------------------

class ScratchDir:
    """Where shards wait for upload; `peak_bytes` is the largest total ever measured on disk."""

    def __init__(self, root: Path):
        # Leftovers of a killed run were never uploaded (or are uploaded already): drop them.
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        self.root, self.peak_bytes = root, 0

    def measure(self) -> int:
        used = 0
        for p in files_under(self.root):
            try:                          # the uploader thread deletes uploaded shards meanwhile
                used += p.stat().st_size
            except FileNotFoundError:
                pass
        self.peak_bytes = max(self.peak_bytes, used)
        return used


def submit_shard(w: ShardWriter, backend: CaptureBackend, plan: ShardPlan, sequences: list[dict[str, list[int]]],
                 path: Path, *, batch_size: int, fmt: ShardFormat) -> None:
    """Capture one shard's sequences in batches, each handed to the writer as soon as it is queued
    on the device (the GPU goes on with the next batch while the host takes this one)."""
    seqs = [sequences[i] for i in plan.sequences]
    job = ShardJob(path, [s["input_ids"] for s in seqs], [s["loss_mask"] for s in seqs], plan.bytes_bound, tag=plan)
    # Batch sequences of similar length together (less padding); the writer restores the shard's order.
    for keys in capture_batches([len(s["input_ids"]) for s in seqs], batch_size):
        w.submit(job, keys, backend.capture_async([seqs[k]["input_ids"] for k in keys], fmt.storage_dtype))
    w.finish(job)


def shard_file_writer(fmt: ShardFormat) -> Callable[[ShardJob], int]:
    """The writer's `write`: a filled job as one shard file -> its bytes."""
    def write(job: ShardJob) -> int:
        return write_encoded(job.path, job.input_ids, job.loss_masks, job.rows, layer_ids=list(fmt.layer_ids),
                             storage_dtype=fmt.storage_dtype)["bytes"]
    return write


def extract_shard(backend: CaptureBackend, plan: ShardPlan, sequences: list[dict[str, list[int]]],
                  path: Path, *, batch_size: int, fmt: ShardFormat) -> None:
    """Capture one shard's sequences and write it, waiting for the file (one shard of `run_rounds`)."""
    with ShardWriter(shard_file_writer(fmt), budget_bytes=plan.bytes_bound) as w:
        submit_shard(w, backend, plan, sequences, path, batch_size=batch_size, fmt=fmt)


def upload_and_verify(writer: ArtifactWriter, plan: ShardPlan) -> dict[str, Any]:
    """Upload a shard, check it landed whole, delete the local copy (F8)."""
    rec = writer.upload(plan.path, delete_local=True,  # upload() checks the landed size
                        extra={"tokens": plan.tokens, "sequences": len(plan.sequences)})
    landed = writer.landed_path(plan.path)
    if landed is not None and sha256_file(landed) != rec["sha256"]:
        raise ArtifactError(f"{writer.artifact_uri}/{plan.path}: "
                            "sha256 of the uploaded copy differs from the local shard; re-run extract")
    return rec


def check_resumed(writer: ArtifactWriter, plans: list[ShardPlan]) -> None:
    """A shard uploaded by a killed run must hold what the plan says it holds, or nothing is trusted."""
    for p in plans:
        rec = writer.uploaded(p.path)
        if rec and (rec.get("tokens"), rec.get("sequences")) != (p.tokens, len(p.sequences)):
            raise ArtifactError(f"{writer.artifact_uri}/{p.path}: uploaded "
                                f"by an earlier run with {rec.get('tokens')} tokens / {rec.get('sequences')} "
                                f"sequences, but the plan says {p.tokens} / {len(p.sequences)}; the dataset "
                                "changed under the same id. Delete the unfinished artifact folder and re-run")


def run_rounds(writer: ArtifactWriter, backend: CaptureBackend, rounds: list[list[ShardPlan]],
               sequences: list[dict[str, list[int]]], scratch: ScratchDir, *, batch_size: int,
               fmt: ShardFormat, share: DiskShare, bar: Any) -> dict[str, Any]:
    """capture → write locally → upload → verify → delete for this rank's shards, overlapped (`ShardWriter`):
    a shard is written only when its size bound fits in this rank's `share` beside the shards awaiting upload.
    `rounds` (planned by `plan_rounds`) is how many budget-fulls the shards make; `capture_s` is the
    wall time of the whole pipeline, the last upload included."""
    computed, computed_tokens = 0, 0
    t0 = time.perf_counter()
    with ShardWriter(shard_file_writer(fmt), budget_bytes=share.bytes,
                     upload=lambda job: upload_and_verify(writer, job.tag),
                     written=lambda job: scratch.measure()) as w:
        for r, shards in enumerate(rounds):
            for plan in shards:
                submit_shard(w, backend, plan, sequences, scratch.root / plan.path, batch_size=batch_size,
                             fmt=fmt)
                computed += 1
                computed_tokens += plan.tokens
                bar.update(plan.tokens)
            log.info("extract round %d/%d: %d shards, %d tokens captured; local peak so far %d bytes (budget %d)",
                     r + 1, len(rounds), len(shards), sum(s.tokens for s in shards), scratch.peak_bytes,
                     share.bytes)
    return {"rounds": len(rounds), "computed_shards": computed, "computed_tokens": computed_tokens,
            "capture_s": time.perf_counter() - t0, "peak_local_bytes": scratch.peak_bytes}


# --- the step -----------------------------------------------------------------------------------

def begin_hidden(store: Store, cfg: PipelineConfig, art_id: str, inputs: dict[str, str],
                 rank: int = 0, join: str | None = None) -> tuple[ArtifactWriter, ScratchDir]:
    """The artifact writer, staging in this rank's scratch dir outside the store.

    For a file:// store `store.begin` stages inside the store folder itself, where "upload" is a
    no-op and local bytes could not be told from uploaded ones; staging apart keeps the budget
    logic the same for file and s3 stores. Ranks other than 0 `join` the attempt rank 0 holds the lease of.
    """
    scratch = ScratchDir(scratch_root(store, art_id) / f"rank-{rank}")
    writer = store.begin("hidden", art_id, step="extract", inputs=inputs, config=cfg.extract, staging=scratch.root,
                         join=join)
    return writer, scratch


def scratch_root(store: Store, art_id: str) -> Path:
    return store.cache_dir / "extract-scratch" / art_id


def hidden_id(cfg: PipelineConfig, target_id: str, dataset_id: str) -> str:
    """The `hidden` artifact id: the extract section (less what changes no byte) and the inputs."""
    section = cfg.extract.model_dump(mode="json", exclude=set(NOT_IN_ID))
    return artifact_id("hidden", section, {"target": target_id, "dataset": dataset_id})


def extract_range(writer: ArtifactWriter, mine: list[ShardPlan], sequences: list[dict[str, list[int]]],
                  scratch: ScratchDir, *, cfg: PipelineConfig, store: Store, target_id: str, fmt: ShardFormat,
                  share: DiskShare, tcfg: dict[str, Any], world: distributed.World,
                  done_tokens: int, backend: CaptureBackend | None = None) -> dict[str, Any]:
    """This rank's shards, in rounds under its share of the budget -> its stats (the progress bar:
    rank 0's range, which the others' match within one shard)."""
    stats = {"rank": world.rank, "shards": [p.index for p in mine], "rounds": 0, "computed_shards": 0,
             "computed_tokens": 0, "capture_s": 0.0, "peak_local_bytes": 0}
    total = done_tokens + sum(p.tokens for p in mine)
    with distributed.progress_bar(world, total=total, initial=done_tokens, desc="extract", unit="tok") as bar:
        if mine:
            backend = backend or make_backend(cfg, store, target_id, list(fmt.layer_ids), tcfg, world.device)
            if isinstance(backend, SGLangBackend):        # the ETA from the first batch, before hours go in
                backend.expect(total - done_tokens)
            stats.update(run_rounds(writer, backend, plan_rounds(mine, share), sequences, scratch,
                                    batch_size=cfg.extract.batch_size, fmt=fmt, share=share, bar=bar))
    # F8: what the plan promised, measured; a rank that overran its share must not publish the artifact.
    budget = check_disk_budget(stats["peak_local_bytes"], share.bytes, where=f"extract rank {world.rank}")
    if budget.status == "fail":
        raise ArtifactError(str(budget))
    return stats


def run(cfg: PipelineConfig, store: Store, target_id: str, dataset_id: str) -> Manifest:
    """Extract aux + final hidden states of every dataset token into a `hidden` artifact.

    Under torchrun every rank calls this and extracts a contiguous range of the shards still to do;
    rank 0 commits the manifest after all ranks' uploads, and every rank returns it. With
    `extract.backend: sharded` (or `sglang_runner`) the ranks instead hold one target split by transformers'
    tensor-parallel plan (or SGLang's model runner, TP = world size): rank 0 extracts every shard as a world
    of one, the others run its forwards with it."""
    art_id = hidden_id(cfg, target_id, dataset_id)
    if store.exists("hidden", art_id):
        return store.manifest("hidden", art_id)
    if cfg.extract.backend == "sglang_runner":
        sglang_runner.check_available()                    # one line naming the fix, before any work
    world = distributed.setup()
    tcfg = target_config(store, target_id)
    layer_ids = resolve_aux_layer_ids(cfg, tcfg["num_hidden_layers"], target_architecture(tcfg))
    # one process: the local backend (sglang_runner holds the target through SGLang even on one GPU)
    if cfg.extract.backend not in SHARED_TARGET or (cfg.extract.backend == "sharded" and not world.distributed):
        return extract_shards(cfg, store, target_id, dataset_id, world, tcfg, layer_ids)
    backend = load_shared(cfg, store, target_id, layer_ids, tcfg, world)
    if not world.is_main:
        return follow_writer(backend, store, art_id)
    try:
        return extract_shards(cfg, store, target_id, dataset_id, distributed.solo(world), tcfg, layer_ids,
                              backend=backend)
    finally:
        backend.release()


def load_shared(cfg: PipelineConfig, store: Store, target_id: str, layer_ids: list[int], tcfg: dict[str, Any],
                world: distributed.World) -> ShardedBackend | sglang_runner.SGLangRunnerBackend:
    """Every rank together: the one target split over the world (a world of one is a one-GPU run)."""
    if cfg.extract.backend == "sharded":
        return load_sharded(store, target_id, layer_ids, world)
    return sglang_runner.load_runner(target_dir(store, target_id), layer_ids, tcfg, world,
                                     mem_fraction=cfg.extract.runner_mem_fraction,
                                     context_length=cfg.extract.max_length,
                                     trust_remote_code=cfg.target.trust_remote_code)


def follow_writer(backend: ShardedBackend | sglang_runner.SGLangRunnerBackend, store: Store, art_id: str) -> Manifest:
    """A rank > 0 of a sharded extraction: rank 0's forwards until it is done, then its manifest."""
    batches = backend.follow()
    if not store.exists("hidden", art_id):
        raise ArtifactError(f"extract rank {backend.world.rank}: rank 0 stopped after {batches} batches without "
                            f"committing hidden {art_id}; its log names why")
    return store.manifest("hidden", art_id)


def extract_shards(cfg: PipelineConfig, store: Store, target_id: str, dataset_id: str, world: distributed.World,
                   tcfg: dict[str, Any], layer_ids: list[int], *, backend: CaptureBackend | None = None) -> Manifest:
    """Plan the shards, extract this rank's range of those still to do, commit on rank 0 (see `run`)."""
    ex = cfg.extract
    inputs = {"target": target_id, "dataset": dataset_id}
    art_id = hidden_id(cfg, target_id, dataset_id)
    sequences = read_sequences(store, dataset_id, ex.max_length)
    fmt = ShardFormat(tuple(layer_ids), tcfg["hidden_size"], ex.storage_dtype)
    share = DiskShare(ex.disk_budget_bytes, world.size)
    plans = plan_shards([len(s["input_ids"]) for s in sequences], ex.shard_tokens, fmt)
    share.check_fits(plans)                                  # fail before any work if one shard cannot fit
    writer, scratch = begin_hidden(store, cfg, art_id, inputs) if world.is_main else (None, None)
    # One attempt per job: rank 0 holds the lease (or found the artifact committed meanwhile), the others join.
    attempt = distributed.all_gather_object(world, writer.attempt if writer else None)[0]
    if attempt == "reused" or (writer is not None and writer.reused is not None):
        return store.manifest("hidden", art_id)
    if writer is None or scratch is None:
        writer, scratch = begin_hidden(store, cfg, art_id, inputs, world.rank, join=attempt)
    check_resumed(writer, plans)
    todo = [p for p in plans if not writer.has(p.path)]
    mine = distributed.split_contiguous(todo, world)
    done_tokens = sum(p.tokens for p in plans) - sum(p.tokens for p in todo)
    stats = extract_range(writer, mine, sequences, scratch, cfg=cfg, store=store, target_id=target_id,
                          fmt=fmt, share=share, tcfg=tcfg, world=world, done_tokens=done_tokens, backend=backend)
    ranks = distributed.all_gather_object(world, stats)       # also: every rank's uploads are done
    if world.is_main:
        if world.distributed:                                  # see the other ranks' uploads too
            writer.reload()
        writer.commit(metrics=extract_metrics(writer, plans, ranks),
                      meta=extract_meta(writer, plans, cfg, tcfg, fmt, ranks))
        shutil.rmtree(scratch_root(store, art_id), ignore_errors=True)
    distributed.barrier(world)                                 # the manifest exists for every rank now
    return store.manifest("hidden", art_id)


def extract_metrics(writer: ArtifactWriter, plans: list[ShardPlan], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput is the job's: tokens computed by all ranks over the slowest rank's capture time."""
    capture_s = max(r["capture_s"] for r in ranks)
    computed = sum(r["computed_tokens"] for r in ranks)
    return {"tokens": sum(p.tokens for p in plans),
            "bytes": sum(writer.uploaded(p.path)["size"] for p in plans),
            "peak_local_bytes": sum(r["peak_local_bytes"] for r in ranks),
            "tokens_per_s": computed / capture_s if capture_s else None,
            "world_size": len(ranks)}


def extract_meta(writer: ArtifactWriter, plans: list[ShardPlan], cfg: PipelineConfig, tcfg: dict[str, Any],
                 fmt: ShardFormat, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """peak_local_bytes sums the ranks' peaks: an upper bound on what the host's disk held at once."""
    ex = cfg.extract
    computed = sum(r["computed_shards"] for r in ranks)
    return {
        "layer_ids": list(fmt.layer_ids), "hidden_size": fmt.hidden_size, "num_aux": fmt.num_aux,
        "num_hidden_layers": tcfg["num_hidden_layers"], "storage_dtype": fmt.storage_dtype,
        "bytes_per_token": bytes_per_token(fmt.hidden_size, fmt.num_aux, fmt.storage_dtype),
        "tokens": sum(p.tokens for p in plans),
        "sequences": sum(len(p.sequences) for p in plans),
        "bytes": sum(writer.uploaded(p.path)["size"] for p in plans),
        "shards": [{"path": p.path, "tokens": p.tokens, "sequences": len(p.sequences)} for p in plans],
        "peak_local_bytes": sum(r["peak_local_bytes"] for r in ranks), "disk_budget_bytes": ex.disk_budget_bytes,
        "rounds": sum(r["rounds"] for r in ranks),
        "computed_shards": computed,
        "resumed_shards": len(plans) - computed,
        "backend": ex.backend,
        "world_size": len(ranks),
        "ranks": [{"rank": r["rank"], "shards": r["shards"], "computed_tokens": r["computed_tokens"],
                   "peak_local_bytes": r["peak_local_bytes"], "capture_s": r["capture_s"]} for r in ranks],
    }


def main(argv: list[str] | None = None) -> int:
    return step_main("extract", argv)


if __name__ == "__main__":
    raise SystemExit(main())
