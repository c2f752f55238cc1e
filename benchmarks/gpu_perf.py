"""Extraction and training at the GPU's limit, side by side in one run, each ratio printed (issue 14).

    python -m benchmarks.gpu_perf [--what extract,train,speculators] [--layers 32] [--out DIR]

Rows (Llama-3.1-8B shapes, random bf16 weights, one GPU):
- `bare`: the target's decoder stack alone (`model.model(input_ids)`), 8 × 2048 tokens a call, the
  anchor of every extraction row;
- `capture`: `steps.lib.extraction.capture.LocalBackend.capture_async` (hooks, side-stream copies into pinned host
  buffers) with `steps.lib.extraction.shard_writer.ShardWriter` assembling each shard's rows in host memory, no file;
- `capture+write`: the same with the shards written to local disk (`steps.lib.data.shards.write_encoded`), bf16
  and fp8, each file deleted once written (the upload's place); `+fsync` forces each file to disk;
- `sync` (before): `LocalBackend.capture` + `write_shard` on one thread, as extract ran before;
- `train`: `steps.lib.training.loop.train_step` at TTT 7 and 3, 8192 tokens a step (4 rows of 2048);
- `speculators`: speculators 0.9.0's Eagle3 draft step (flex attention under torch.compile, eager KL
  loss, AdamW, bf16 autocast) at the same shapes (benchmarks/speculators_anchor.py).
Every extraction row streams `--shards` shards of 2 calls each after one warm-up shard: tokens over
wall seconds, host work and all. A bf16 shard written by the async path is checked equal to the
synchronous capture of the same sequences before any number is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.scaling import DRAFT_VOCAB, SHAPES, draft_config, random_target, synthetic_batch
from steps.lib.config import parse_config
from steps.lib.data.shards import read_shard, shard_bytes_bound, write_encoded, write_shard
from steps.lib.extraction.capture import LocalBackend
from steps.lib.extraction.shard_writer import ShardJob, ShardWriter
from steps.lib.layer_ids import default_aux_layer_ids
from steps.lib.model.draft import Eagle3Draft
from steps.lib.runtime import distributed
from steps.lib.training.loop import Setup, build_trainer, train_step
from steps.lib.training.plan import Batch
from steps.lib.training.ttt import layouts, loss_positions, ttt_loss
from steps.mapping import build_vocab

BATCH, SEQ = 8, 2048


#: `--device cpu --shape tiny` is a smoke test of this script on a CPU (no number from it means anything).
DEVICE = torch.device("cuda")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


# --- extraction --------------------------------------------------------------------------------------------

def stream(backend: LocalBackend, seqs: list[list[int]], *, shards: int, write: str | None, fsync: bool,
           tmp: Path, layer_ids: list[int], hidden: int) -> dict:
    """`shards` shards of 2 capture calls each through a ShardWriter -> tokens/s over wall time (after
    one warm-up shard). `write=None`: rows assembled in host memory, no file; else the storage dtype."""
    dtype = write or "bfloat16"
    per = 2 * len(seqs)
    bound = shard_bytes_bound(per * SEQ, per, hidden_size=hidden, num_aux=len(layer_ids), storage_dtype=dtype)

    def write_file(job: ShardJob) -> int:
        if write is None:
            return 0
        n = write_encoded(job.path, job.input_ids, job.loss_masks, job.rows, layer_ids=layer_ids,
                          storage_dtype=dtype)["bytes"]
        if fsync:
            with open(job.path, "rb+") as f:
                os.fsync(f.fileno())
        return n

    def run(count: int) -> float:
        w = ShardWriter(write_file, budget_bytes=4 * bound,
                        upload=(lambda job: job.path.unlink()) if write else None)   # the upload's place
        _sync()
        t0 = time.perf_counter()
        for k in range(count):
            job = ShardJob(tmp / f"s{k}.safetensors", seqs + seqs, [[1] * SEQ] * per, bound)
            for half in (0, 1):
                w.submit(job, list(range(half * len(seqs), (half + 1) * len(seqs))),
                         backend.capture_async(seqs, dtype))
            w.finish(job)
        w.close()
        return time.perf_counter() - t0

    run(1)                                             # warm-up: pinned buffers, kernels, page cache
    seconds = run(shards)
    return {"tokens_per_s": round(shards * per * SEQ / seconds), "seconds": round(seconds, 3),
            "bytes_per_token": round(bound / (per * SEQ), 1)}


def bare_rate(model: torch.nn.Module, seqs: list[list[int]], calls: int) -> float:
    ids = torch.tensor(seqs, device=DEVICE)
    with torch.inference_mode():
        for _ in range(2):
            model.model(input_ids=ids)
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            model.model(input_ids=ids)
        _sync()
    return calls * ids.numel() / (time.perf_counter() - t0)


def check_async_equals_sync(backend: LocalBackend, seqs: list[list[int]], tmp: Path, layer_ids: list[int]) -> None:
    """The async path's bf16 shard holds exactly the states the synchronous capture returns."""
    path = tmp / "check.safetensors"
    job = ShardJob(path, seqs, [[1] * len(s) for s in seqs], 1 << 40)
    write = lambda j: write_encoded(j.path, j.input_ids, j.loss_masks, j.rows, layer_ids=layer_ids,  # noqa: E731
                                    storage_dtype="bfloat16")["bytes"]
    with ShardWriter(write, budget_bytes=1 << 40) as w:
        w.submit(job, list(range(len(seqs))), backend.capture_async(seqs, "bfloat16"))
        w.finish(job)
    got = read_shard(path)
    ref = backend.capture(seqs)
    aux, final = torch.cat([a for a, _ in ref]).float(), torch.cat([f for _, f in ref]).float()
    if not (torch.equal(got["aux_hidden"], aux) and torch.equal(got["final_hidden"], final)):
        raise SystemExit("async capture differs from the synchronous capture: not measuring a wrong pipeline")
    path.unlink()


def bench_extract(args: argparse.Namespace) -> list[dict]:
    shape = SHAPES[args.shape]
    world = distributed.World(rank=0, local_rank=0, size=1, device=DEVICE)
    model = random_target(world, shape, args.layers)
    layer_ids = default_aux_layer_ids(args.layers)
    g = torch.Generator().manual_seed(100)
    seqs = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), generator=g).tolist()
    rows = []
    bare = bare_rate(model, seqs, calls=2 * args.shards)
    rows.append({"what": "extract", "variant": "bare forward", "tokens_per_s": round(bare)})
    backend = LocalBackend(model, layer_ids)
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        check_async_equals_sync(backend, seqs[:3], tmp, layer_ids)
        for name, write, fsync in (("capture (host memory)", None, False), ("capture+write bf16", "bfloat16", False),
                                   ("capture+write fp8", "float8_e4m3fn", False),
                                   ("capture+write bf16 +fsync", "bfloat16", True)):
            r = stream(backend, seqs, shards=args.shards, write=write, fsync=fsync, tmp=tmp, layer_ids=layer_ids,
                       hidden=shape["hidden_size"])
            rows.append({"what": "extract", "variant": name, **r, "vs_bare": round(r["tokens_per_s"] / bare, 3)})
            print(json.dumps(rows[-1]), flush=True)
        # before: synchronous capture, then write_shard on the same thread
        path = tmp / "sync.safetensors"
        t = []
        for k in range(3):
            _sync()
            t0 = time.perf_counter()
            states = backend.capture(seqs)
            write_shard(path, seqs, [[1] * SEQ] * BATCH, torch.cat([a for a, _ in states]),
                        torch.cat([f for _, f in states]), layer_ids=layer_ids)
            if k:
                t.append(time.perf_counter() - t0)
        rate = BATCH * SEQ / statistics.median(t)
        rows.append({"what": "extract", "variant": "sync capture+write bf16 (before)", "tokens_per_s": round(rate),
                     "vs_bare": round(rate / bare, 3)})
    backend.close()
    rows.append({"what": "extract", "variant": "peak GPU memory", "peak_mem_gib": _peak()})
    return rows


# --- training ----------------------------------------------------------------------------------------------

def matmul_flops(dcfg, batch: Batch, t2d: torch.Tensor, ttt: int) -> float:
    """FLOPs of one step by matmul count (forward + backward = 3 × forward; attention scores excluded):
    fc on every token at step 0, the decoder layer on each step's computed positions, the head on the
    counted ones."""
    h, i, nh, nkv, d = (dcfg.hidden_size, dcfg.intermediate_size, dcfg.num_attention_heads,
                        dcfg.num_key_value_heads, dcfg.head_dim)
    layer = 2 * h * (nh + 2 * nkv) * d + nh * d * h + 3 * h * i
    valid = loss_positions(batch, t2d, ttt)
    computed = [int((~lay.pad).sum()) for lay in layouts(valid, batch.doc, ttt)]
    counted = sum(int(v.sum()) for v in valid)
    fwd = 2 * (batch.tokens * dcfg.num_aux * dcfg.target_hidden_size * h + sum(computed) * layer
               + counted * h * dcfg.draft_vocab_size)
    return 3.0 * fwd


def bench_train(args: argparse.Namespace, ttt: int) -> dict:
    dcfg = draft_config(SHAPES[args.shape], DRAFT_VOCAB[args.shape])
    cfg = parse_config({"name": "gpu-perf", "target": {"source": "tiny"}, "train": {"ttt_steps": ttt}})
    world = distributed.World(rank=0, local_rank=0, size=1, device=DEVICE)
    d2t, t2d = build_vocab(torch.randint(0, 1000, (dcfg.vocab_size,), generator=torch.Generator().manual_seed(0)),
                           dcfg.vocab_size, dcfg.draft_vocab_size)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        draft = Eagle3Draft(dcfg)
        draft.embed_tokens.weight.normal_(0, 0.02)
        head_rows = torch.randn(dcfg.draft_vocab_size, dcfg.target_hidden_size) * 0.02
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tr = build_trainer(cfg.train, Setup(draft, head_rows, None, [], {}), world)
    cpu_batch = synthetic_batch(dcfg, t2d, tokens=args.train_tokens, seq_len=SEQ, seed=0)
    batch = Batch(*(getattr(cpu_batch, f).to(DEVICE) for f in Batch.__dataclass_fields__))
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=DEVICE.type == "cuda"):
        same = {a: float(ttt_loss(draft, batch, tr.head_rows, steps=ttt, decay=cfg.train.step_decay,
                                  attention=a)[0]) for a in ("sdpa", "flex" if DEVICE.type == "cuda" else "sdpa")}
    first = [round(train_step(tr, batch, t=cfg.train, lr=1e-4)["loss"], 4) for _ in range(3)]   # compiles
    _sync()
    if args.profile:
        profile(lambda: train_step(tr, batch, t=cfg.train, lr=1e-4), Path(args.out or ".") / f"profile-ttt{ttt}.txt")
    t0 = time.perf_counter()
    for _ in range(args.iters):
        train_step(tr, batch, t=cfg.train, lr=1e-4)
    _sync()
    step = (time.perf_counter() - t0) / args.iters
    flops = matmul_flops(dcfg, cpu_batch, t2d, ttt)
    row = {"what": "train", "variant": "eaglenest train_step", "ttt_steps": ttt, "tokens": batch.tokens,
           "step_s": round(step, 4), "tokens_per_s": round(batch.tokens / step),
           "tflops_matmul": round(flops / step / 1e12, 1), "mfu_vs_790": round(flops / step / 790e12, 3),
           "trainable_params": distributed.trainable_params(draft), "peak_mem_gib": _peak(),
           "loss_sdpa_vs_flex": same, "first_losses": first}
    return row


def profile(fn, path: Path) -> None:
    """Top CUDA kernels of 3 calls of `fn` (printed, and written to `path`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        _sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n\nby host time\n" + host)
    print(table[:6000], flush=True)


def _peak() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEVICE.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="extract,train,speculators")
    p.add_argument("--layers", type=int, default=32, help="target decoder layers (32 = Llama-3.1-8B)")
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (with --shape tiny)")
    p.add_argument("--batch", type=int, default=8, help="sequences per capture call")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (capture and training rows)")
    p.add_argument("--shards", type=int, default=6, help="timed shards per extraction row (2 calls of 8 × 2048)")
    p.add_argument("--ttt", default="7,3")
    p.add_argument("--train-tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tmp", default=None, help="folder for the shards (default: the system's temp dir)")
    p.add_argument("--out", default=None, help="write results.jsonl here")
    p.add_argument("--profile", action="store_true", help="profile 3 training steps (top CUDA kernels)")
    args = p.parse_args(argv)
    global DEVICE, BATCH, SEQ
    DEVICE, BATCH, SEQ = torch.device(args.device), args.batch, args.seq
    what = args.what.split(",")
    rows: list[dict] = []
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    head = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": gpu,
            "torch": torch.__version__, "host": platform.node(), "command": " ".join(sys.argv)}
    print(json.dumps(head), flush=True)
    if "extract" in what:
        rows += bench_extract(args)
    for ttt in map(int, args.ttt.split(",")):
        if "train" in what:
            rows.append(bench_train(args, ttt))
            print(json.dumps(rows[-1]), flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        if "speculators" in what:
            from benchmarks.speculators_anchor import bench_speculators
            try:   # the anchor is someone else's code: its failure must not cost the other rows
                rows.append(bench_speculators(ttt=ttt, tokens=args.train_tokens, seq_len=SEQ, iters=args.iters,
                                              shape_name=args.shape, device=DEVICE.type,
                                              attn="simple_flex_attention" if DEVICE.type == "cuda" else "sdpa"))
            except Exception as e:  # noqa: BLE001 - reported as a row
                rows.append({"what": "train", "variant": "speculators 0.9.0 step FAILED", "ttt_steps": ttt,
                             "error": f"{type(e).__name__}: {e}"[:2000]})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "results.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in [head, *rows]))
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print("\nwhat     variant                                tok/s       ratio")
    anchors = {r.get("ttt_steps"): r["tokens_per_s"] for r in rows
               if r.get("variant", "").startswith("speculators") and "tokens_per_s" in r}
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['what']:8s} {r['variant']:38s} peak {r.get('peak_mem_gib')} GiB {r.get('error', '')[:300]}")
            continue
        ratio = r.get("vs_bare")
        if r["what"] == "train" and anchors.get(r.get("ttt_steps")):
            ratio = round(r["tokens_per_s"] / anchors[r["ttt_steps"]], 3)
        label = r["variant"] + (f" ttt={r['ttt_steps']}" if "ttt_steps" in r else "")
        print(f"{r['what']:8s} {label:38s} {r['tokens_per_s']:>10,}  {ratio if ratio is not None else '':>6}")


if __name__ == "__main__":
    raise SystemExit(main())
