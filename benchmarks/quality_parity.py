"""Parity: eaglenest's draft vs speculators 0.9.0's `Eagle3DraftModel`, trained on the same data and
measured by the same engine (issue 12, item 1).

Same for both: the hidden-state artifact and the vocab artifact (d2t/t2d) of one store, the batches
(eaglenest's plan: every optimizer step sees the same sequences, packed the same way), the token
budget, the TTT steps and their loss decay, the learning-rate schedule (`steps.lib.training.loop.lr_at`),
AdamW betas, weight decay and gradient clipping. Each keeps its own model and objective: speculators
copies the target's lm_head rows and freezes them (and the embedding), trains with forward KL and
masks by its own rules; eaglenest trains its head (started from the target's rows with
`train.init_lm_head`). speculators trains in .venv-speculators (scripts/setup-speculators-venv.sh) as
a subprocess (benchmarks/speculators_driver.py) and saves its own format; `eaglenest convert --to
sglang` turns that into an SGLang directory. Both SGLang directories are then loaded with SGLang's
rules (`load_sglang_draft`) and measured by `steps.verify.measure` (the reference engine: chain
drafting, greedy verification) on the same held-out prompts.

    .venv/bin/python benchmarks/quality_parity.py --config smollm2-135m --store file://out/store \\
        --set dataset.max_prompts=32 --out out/parity

Prints a table (τ, per-position acceptance, training time) and writes `parity.json` + `parity.md` in --out.
The input artifacts are reused when the store has them (same config, same ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".venv-speculators"
#: batches written ahead of speculators' trainer (each is a step's hidden states)
AHEAD = 8


class ParityError(RuntimeError):
    """The harness cannot run (no side venv, a failed subprocess)."""


def speculators_python(venv: Path) -> Path:
    """The interpreter that has speculators: `venv`'s, or `venv` itself when it names an interpreter (on the
    GPU machine speculators' wheels are installed beside eaglenest's dependencies, into one python)."""
    if venv.is_file():
        return venv
    py = venv / "bin" / "python"
    if not py.is_file():
        raise ParityError(f"{venv}: no speculators side venv; build it with scripts/setup-speculators-venv.sh "
                          f"{venv} (~3 min, ~1.2 GB: CPU torch, transformers 5.19, speculators 0.9.0 --no-deps)")
    return py


def inputs(config: str, overrides: list[str], store_uri: str) -> dict[str, str]:
    """target → datagen → extract → mapping (reused when the store already has them)."""
    from steps.registry import run_step

    ids = {"target": run_step("target", config, overrides, store_uri, {})["id"]}
    ids["dataset"] = run_step("datagen", config, overrides, store_uri, {"target": ids["target"]})["id"]
    ids["hidden"] = run_step("extract", config, overrides, store_uri, {"target": ids["target"],
                                                                       "dataset": ids["dataset"]})["id"]
    ids["vocab"] = run_step("mapping", config, overrides, store_uri, {"dataset": ids["dataset"],
                                                                      "target": ids["target"]})["id"]
    return ids


def speculators_batch(batch) -> dict[str, Any]:
    """One eaglenest batch (packed rows) as speculators' training input: every sequence shifted as
    `speculators.models.eagle3.data.shift_batch` does (x[1:], aux[:-1], final[1:], mask[1:], positions
    from 1), all sequences of the batch packed into one row with document ids."""
    import torch

    parts: dict[str, list] = {k: [] for k in ("input_ids", "hidden_states", "verifier_last_hidden_states",
                                              "loss_mask", "position_ids", "document_ids")}
    doc = 0
    for r in range(batch.doc.shape[0]):
        for d in batch.doc[r].unique().tolist():
            if d < 0:
                continue
            at = (batch.doc[r] == d).nonzero().flatten()
            if len(at) < 2:
                continue
            parts["input_ids"].append(batch.input_ids[r, at[1:]])
            parts["hidden_states"].append(batch.aux[r, at[:-1]])
            parts["verifier_last_hidden_states"].append(batch.final[r, at[1:]])
            parts["loss_mask"].append(batch.loss_mask[r, at[1:]])
            parts["position_ids"].append(torch.arange(1, len(at)))
            parts["document_ids"].append(torch.full((len(at) - 1,), doc))
            doc += 1
    return {k: torch.cat(v)[None].contiguous() for k, v in parts.items()}


def train_speculators(cfg, store, ids: dict[str, str], work: Path, out: Path, venv: Path) -> dict[str, Any]:
    """Write eaglenest's plan in speculators' layout, train in the side venv, return its summary."""
    import torch
    from safetensors.torch import save_file

    from steps.lib.artifacts import load_vocab, target_dir
    from steps.lib.training.loop import BETAS, lr_at
    from steps.lib.training.plan import make_batch
    from steps.train import prepare

    py = speculators_python(venv)
    t = cfg.train
    setup = prepare(cfg, store, ids["target"], ids["hidden"], ids["vocab"])
    total = len(setup.plan) if t.max_steps is None else min(len(setup.plan), t.max_steps)
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("step-*.safetensors"):
        old.unlink()
    d2t, t2d = load_vocab(store, ids["vocab"])
    save_file({"d2t": d2t, "t2d": t2d}, str(work / "vocab.safetensors"))
    plan = {"target_dir": str(target_dir(store, ids["target"])), "layer_ids": setup.meta["layer_ids"],
            "draft_vocab_size": len(d2t), "ttt_steps": t.ttt_steps, "step_decay": t.step_decay,
            "lrs": [lr_at(s, total, lr=t.lr, warmup_ratio=t.warmup_ratio, min_lr_ratio=t.min_lr_ratio)
                    for s in range(total)],
            "betas": list(BETAS), "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
            "loss_fn": "kl_div", "seed": cfg.seed, "threads": torch.get_num_threads()}
    (work / "plan.json").write_text(json.dumps(plan))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # The driver trains while the batches are written, at most AHEAD steps ahead: a large dataset's
    # batches (its hidden states, once per epoch) never sit on disk all at once.
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen([str(py), str(ROOT / "benchmarks" / "speculators_driver.py"), str(work), str(out)],
                                stdout=log, stderr=subprocess.STDOUT,
                                # a side venv must not see this venv's packages; a named interpreter keeps its path
                                env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "") if venv.is_file()
                                     else ""})
        for step in range(total):
            while len(list(work.glob("step-*.safetensors"))) >= AHEAD and proc.poll() is None:
                time.sleep(0.02)
            if proc.poll() is not None:
                break
            name, rows = setup.plan[step]
            part = work / f".step-{step:06d}.part"
            save_file(speculators_batch(make_batch(setup.reader.load(name), rows, t.max_length)), str(part))
            part.rename(work / f"step-{step:06d}.safetensors")
        code = proc.wait()
    if code != 0:
        tail = (out.parent / f"{out.name}.log").read_text()[-4000:]
        raise ParityError(f"speculators training failed (exit {code}):\n{tail}")
    summary = json.loads((out / "train_summary.json").read_text())
    return {**summary, "wall_s": time.perf_counter() - t0,
            "final": json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])}


def training_prompts(store, dataset_id: str, tokenizer, n: int) -> list[tuple[str, list[int]]]:
    """The first `n` prompts the draft was trained on (first user turn, chat-templated): τ in distribution."""
    from steps.lib.artifacts import read_conversations
    from steps.lib.data.prompts import chat_token_ids

    out = []
    for row in read_conversations(store, dataset_id):
        if len(out) >= n:
            break
        first_user = [m for m in row["messages"] if m["role"] != "assistant"][:2]
        out.append((row["id"], chat_token_ids(tokenizer, first_user)))
    return out


def measure_dir(cfg, target, tokenizer, sglang_dir: Path, prompts: list[tuple[str, list[int]]] | None = None
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """τ of one SGLang draft directory with the reference engine, measured as verify measures MT-bench
    (`measure_mtbench`: both turns when verify.turns is 2, every verify.chain_lengths, each τ with its bootstrap
    interval, verify.batch_size prompts at once), or, given `prompts`, on those first turns at the served k.
    -> (the figures, one row a prompt, turn and chain length with its accept histogram)."""
    from steps.lib.formats.sglang import sglang_layer_ids
    from steps.lib.formats.sglang_loader import draft_vocab, load_sglang_draft
    from steps.lib.model.reference_engine import Engine
    from steps.verify import local_decoding, measure, measure_mtbench, summarize

    draft, report = load_sglang_draft(sglang_dir, target=target)
    engine = Engine(target, tokenizer, draft, layer_ids=sglang_layer_ids(sglang_dir), num_steps=cfg.serve.num_steps)
    loaded = {"dropped_keys": report.dropped, "missing_params": report.missing}
    if prompts is not None:
        total, rows = measure(engine, prompts, cfg.verify.max_new_tokens, tokenizer.eos_token_id,
                              batch_size=cfg.verify.batch_size)
        return {**summarize(total, rows), **loaded}, rows
    decoding = local_decoding(engine, cfg.verify.max_new_tokens, tokenizer.eos_token_id,
                              batch_size=cfg.verify.batch_size)
    metrics, rows = measure_mtbench(cfg, decoding, tokenizer, draft_vocab(sglang_dir))
    return {**metrics, **loaded}, rows


def paired_difference(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], *, seed: int, samples: int
                      ) -> dict[str, dict[str, Any]]:
    """τ(ours) − τ(theirs) at each chain length both were measured at (each τ beside), with its paired 95%
    bootstrap interval over the prompts (`tau_difference_interval`: the same prompts resampled for both). Rows
    pair by prompt id, turn and chain length; both drafts must have been measured on the same prompts."""
    from steps.lib.metrics import pooled_tau, tau_difference_interval

    def by_k(rows: list[dict[str, Any]]) -> dict[int, dict[tuple, list[int]]]:
        out: dict[int, dict[tuple, list[int]]] = {}
        for r in rows:
            out.setdefault(r["num_steps"], {})[(r["id"], r.get("turn", 1))] = r["accept_histogram"]
        return out

    a, b = by_k(ours), by_k(theirs)
    difference = {}
    for k in sorted(a.keys() & b.keys()):
        if a[k].keys() != b[k].keys():
            raise ParityError(f"k = {k}: the two drafts were measured on different prompts "
                              f"({len(a[k])} against {len(b[k])}); a paired difference needs the same ones")
        keys = sorted(a[k])
        ha, hb = [a[k][key] for key in keys], [b[k][key] for key in keys]
        ours_tau, theirs_tau = pooled_tau(ha), pooled_tau(hb)
        difference[str(k)] = {"tau": ours_tau - theirs_tau, "ours": ours_tau, "theirs": theirs_tau,
                              "prompts": len(keys),
                              "interval": tau_difference_interval(ha, hb, seed=seed, samples=samples)}
    return difference


def run_parity(config: str, overrides: list[str], store_uri: str, out: Path, venv: Path = DEFAULT_VENV, *,
               train_prompts: int = 0) -> dict[str, Any]:
    """Train both, convert theirs, measure both on the held-out prompts (and on `train_prompts` of the
    training prompts when > 0) -> the result written to out/parity.json and out/parity.md."""
    import torch

    from steps.convert import main as convert_main
    from steps.lib.artifacts import export_dir, inference_device, load_target
    from steps.lib.config import find_config, load_config
    from steps.lib.store import open_store, store_uri_for
    from steps.registry import run_step

    speculators_python(venv)                          # fail before any work
    # the same data for both: no held-out split taken out of eaglenest's training here
    ours_overrides = overrides + ["train.eval_every=0"]
    cfg = load_config(find_config(config), ours_overrides)
    store = open_store(store_uri_for(store_uri, cfg.store))
    ids = inputs(config, ours_overrides, store_uri)
    out.mkdir(parents=True, exist_ok=True)

    rec = run_step("train", config, ours_overrides, store_uri, {k: ids[k] for k in ("target", "hidden", "vocab")})
    export = run_step("export", config, ours_overrides, store_uri, {"draft": rec["id"], "target": ids["target"]})
    ours_dir = export_dir(store, export["id"], "sglang")

    theirs_raw, theirs_dir = out / "speculators-draft", out / "speculators-sglang"
    # speculators' draft is kept once trained and converted (a run stopped in verify starts there again),
    # under a record of what it was trained on: other inputs or another train config train it again
    done = out / "speculators.json"
    key = {"inputs": ids, "train": cfg.train.model_dump(mode="json"), "seed": cfg.seed}
    record = json.loads(done.read_text()) if done.exists() else {}
    if record.get("key") == key and theirs_dir.is_dir():
        theirs_train = record["train"]
    else:
        done.unlink(missing_ok=True)
        for d in (theirs_raw, theirs_dir):
            shutil.rmtree(d, ignore_errors=True)
        theirs_train = train_speculators(cfg, store, ids, out / "speculators-batches", theirs_raw, venv)
        if convert_main([str(theirs_raw), str(theirs_dir), "--to", "sglang"]) != 0:
            raise ParityError(f"eaglenest convert {theirs_raw} {theirs_dir} --to sglang failed (see above)")
        part = done.with_suffix(".part")
        part.write_text(json.dumps({"key": key, "train": theirs_train}))
        part.rename(done)

    target, tokenizer = load_target(store, ids["target"], device=inference_device())
    seen = training_prompts(store, ids["dataset"], tokenizer, train_prompts) if train_prompts else None
    (ours, ours_prompts), (theirs, theirs_prompts) = (measure_dir(cfg, target, tokenizer, d)
                                                      for d in (ours_dir, theirs_dir))
    rows = {"eaglenest": {**ours, "train_s": rec["metrics"]["train_s"], "tokens_trained": rec["metrics"]["tokens"],
                          "steps": rec["metrics"]["steps"], "train_acc": rec["metrics"]["acc"]},
            "speculators 0.9.0": {**theirs, "train_s": theirs_train["train_s"],
                                  "tokens_trained": theirs_train["tokens"], "steps": theirs_train["steps"],
                                  "train_acc": theirs_train["final"]["acc"]}}
    if seen:
        for row, d in ((rows["eaglenest"], ours_dir), (rows["speculators 0.9.0"], theirs_dir)):
            row["on_training_prompts"] = measure_dir(cfg, target, tokenizer, d, seen)[0]
    result = {"config": config, "overrides": overrides, "store": store_uri, "inputs": ids,
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
              "date": datetime.now(UTC).strftime("%Y-%m-%d"), "verify": cfg.verify.model_dump(), "rows": rows,
              # eaglenest − speculators on the same prompts: the comparison's own interval
              "difference": paired_difference(ours_prompts, theirs_prompts, seed=cfg.seed,
                                              samples=cfg.verify.bootstrap_samples)}
    (out / "parity.json").write_text(json.dumps(result, indent=2))
    (out / "parity.md").write_text(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    """One row a trainer: τ at the served k with its interval, then at every chain length both were measured at."""
    rows = result["rows"]
    # the chain lengths both were measured at (verify.chain_lengths; none when measured at the served k only)
    other = sorted(set.intersection(*({int(k) for k in r.get("by_chain_length", {})} for r in rows.values())))

    def tau(r: dict[str, Any]) -> str:
        low, high = r.get("tau_interval") or (float("nan"), float("nan"))
        return f"{r['tau']:.3f} [{low:.3f}, {high:.3f}]"

    head = ("| trainer | τ held-out (k = served) | " + "".join(f"τ {k}/1/{k + 1} | " for k in other)
            + "per-position acceptance | τ training prompts | train s | tokens trained | steps "
            "| last train top-1 (step 0) |\n|" + "---|" * (8 + len(other)) + "\n")
    lines = [f"| {name} | {tau(r)} | " + "".join(f"{tau(r['by_chain_length'][str(k)])} | " for k in other)
             + f"{' / '.join(f'{a:.3f}' for a in r['per_position_acceptance'])} | "
             f"{r['on_training_prompts']['tau'] if 'on_training_prompts' in r else float('nan'):.3f} | "
             f"{r['train_s']:.1f} | {r['tokens_trained']} | {r['steps']} | "
             f"{(r['train_acc'][0] or 0):.3f} |" for name, r in rows.items()]
    paired = [f"{int(k)}/1/{int(k) + 1} {d['tau']:+.3f} [{d['interval'][0]:+.3f}, {d['interval'][1]:+.3f}]"
              for k, d in result.get("difference", {}).items()]
    tail = (f"\neaglenest − speculators, paired over the same {next(iter(result['difference'].values()))['prompts']}"
            f" prompts: {'; '.join(paired)}\n" if paired else "")
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--store", default="file://out/store")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", type=Path, default=Path("out/parity"))
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--train-prompts", type=int, default=0, help="also measure τ on this many training prompts")
    args = ap.parse_args(argv)
    try:
        result = run_parity(args.config, args.overrides, args.store, args.out, args.venv,
                            train_prompts=args.train_prompts)
    except ParityError as err:
        print(f"quality_parity: {err}", file=sys.stderr)
        return 2
    print(table(result))
    print(f"written: {args.out / 'parity.json'}, {args.out / 'parity.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
