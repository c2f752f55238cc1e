"""τ against the amount of training data (issue 12, item 6): for each point, the pipeline from the target to
verify on one store, then one table of held-out MT-bench τ and in-distribution τ against answers and tokens.

    python benchmarks/tau_curve.py --config smollm2-135m --store file://out/curve-store --out out/curve \\
        --set datagen.batch_size=256 ... \\
        --point 2.7k= --point 2.7k-fp8=extract.storage_dtype=float8_e4m3fn \\
        --point 0.7k=dataset.max_prompts=672 --point 10.7k=datagen.samples_per_prompt=4 \\
        [--parity 10.7k --venv .venv-speculators]

A point is NAME=OVERRIDE[,OVERRIDE...] on top of the common `--set`s. Points run in the order given; every
step's artifact is reused by id, so a run cut short (a device call's time limit) resumes where it stopped,
and a point already in OUT/curve.jsonl with the same overrides is not measured again. `--parity NAME` then
runs benchmarks/quality_parity.py's harness on that point's data (speculators 0.9.0 vs eaglenest, same
batches). Writes OUT/curve.jsonl (a row per point, with each MT-bench prompt's accept histogram at each k),
OUT/curve.md and, with --parity, OUT/parity-NAME/. Imports no Prefect: it runs as plain steps on the GPU machine
(`steps.registry.run_step`).

Two measured points, compared on the same prompts (no run; a point is NAME in OUT/curve.jsonl or FILE:NAME):

    python benchmarks/tau_curve.py --out out/curve --compare bf16 chat
    python benchmarks/tau_curve.py --compare results-a.jsonl:v32k results-b.jsonl:b16e8

prints τ(A) − τ(B) at each chain length with its paired 95% bootstrap interval: differences of a few hundredths,
which two intervals taken apart cannot resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: the chain of one point, each step with the artifact ids it takes (by the names run_step expects)
CHAIN = (("target", ()), ("datagen", ("target",)), ("extract", ("target", "dataset")),
         ("mapping", ("dataset", "target")), ("train", ("target", "hidden", "vocab")),
         ("export", ("draft", "target")), ("verify", ("export", "target")))
#: the artifact kind each step writes (the name later steps take it by)
OUTPUT = {"target": "target", "datagen": "dataset", "extract": "hidden", "mapping": "vocab", "train": "draft",
          "export": "export", "verify": "verify"}


def parse_point(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition("=")
    if not name:
        raise SystemExit(f"--point {text!r}: expected NAME=OVERRIDE[,OVERRIDE...] (overrides may be empty)")
    return name, [o for o in overrides.split(",") if o]


def run_point(config: str, overrides: list[str], store_uri: str) -> dict[str, Any]:
    """The chain target → verify for one point -> each step's record (artifacts reused by id)."""
    from steps.registry import open_config, run_step, skipped

    cfg, _ = open_config(config, overrides, store_uri)
    ids: dict[str, str] = {}
    records: dict[str, dict[str, Any]] = {}
    for step, needs in CHAIN:
        if skipped(step, cfg):      # online training: train runs the target over the dataset itself
            ids["hidden"] = ids["dataset"]
            continue
        t0 = time.perf_counter()
        rec = run_step(step, config, overrides, store_uri, {n: ids[n] for n in needs})
        print(f"  {step}: {rec['id']} ({time.perf_counter() - t0:.1f} s)", flush=True)
        ids[OUTPUT[step]] = rec["id"]
        records[step] = rec
    return records


def mtbench_rows(store_uri: str, verify_id: str) -> list[dict[str, Any]]:
    """Each MT-bench prompt's accept histogram at each chain length, from the verify report: what a paired
    comparison of two points needs (`--compare`)."""
    from steps.lib.store import open_store

    report = json.loads(open_store(store_uri).fetch_file("verify", verify_id, "report.json").read_text())
    return [{f: r.get(f) for f in ("id", "turn", "num_steps", "accept_histogram")}
            for r in report["prompts"] if "split" not in r]


def row_for(name: str, overrides: list[str], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One table row: how much data the point had, what training and verify measured."""
    data, train, verify = (records[s]["metrics"] for s in ("datagen", "train", "verify"))
    hidden = records["extract"]["metrics"] if "extract" in records else {}
    by_k = verify.get("by_chain_length") or {}
    return {"point": name, "overrides": overrides, "answers": data["ok"], "prompts": data["prompts"],
            "answer_tokens": data["assistant_tokens"], "generated_tokens_per_s": data["tokens_per_s"],
            "datagen_s": data["gen_s"], "hidden_bytes": hidden.get("bytes"),
            "storage_dtype": records["extract"]["meta"].get("storage_dtype") if "extract" in records else "online",
            "two_turn": data.get("two_turn"), "synthetic_kept": data.get("synthetic_kept"),
            "train_tokens": train.get("tokens"), "train_s": train.get("train_s"), "tau_sim": train.get("tau_sim"),
            "tau_sim_decode": train.get("tau_sim_decode"),
            "epochs": train.get("epochs"), "train_phases_s": train.get("phases_s"),
            # online: how often the target ran over a shard, and the states kept on the device for later epochs
            "shards_total": train.get("shards_total"), "shards_computed": train.get("shards_computed"),
            "cache_peak_bytes": train.get("cache_peak_bytes"),
            "tau": verify["tau"], "tau_interval": verify.get("tau_interval"),
            "tau_turn1": verify.get("tau_turn1"), "tau_turn2": verify.get("tau_turn2"),
            "by_chain_length": {k: {f: v.get(f) for f in ("tau", "tau_interval", "per_position_acceptance",
                                                          "rejections_outside_draft_vocab")}
                                for k, v in by_k.items()},
            "per_position_acceptance": verify["per_position_acceptance"],
            "tau_by_category": verify.get("tau_by_category"),      # MT-bench's eight, both turns, at the served k
            "tau_in_distribution": verify.get("tau_in_distribution"),
            "per_position_acceptance_in_distribution": verify.get("per_position_acceptance_in_distribution"),
            "draft_vocab_coverage": verify.get("draft_vocab_coverage"),     # answer tokens the draft can propose
            # rejected drafts whose right token is outside the draft vocab (no training wins them back)
            "rejections_outside_draft_vocab": verify.get("rejections_outside_draft_vocab"),
            # HumanEval (verify.code_prompts): measured only where the draft never trained on it
            "tau_humaneval": verify.get("tau_humaneval"),
            "tau_interval_humaneval": verify.get("tau_interval_humaneval"),
            "per_position_acceptance_humaneval": verify.get("per_position_acceptance_humaneval"),
            "verify_prompts": verify["prompts"], "mismatches": verify["mismatches"],
            # what the weights decoded in (verify.dtype), and the speculative outputs that left plain greedy's at a
            # gap within verify.tie_tolerance (bf16 flips)
            "verify_dtype": records["verify"]["meta"].get("dtype"), "near_ties": verify.get("near_ties"),
            "ids": {OUTPUT[s]: r["id"] for s, r in records.items()},
            "seconds": {s: r["seconds"] for s, r in records.items()}}


def table(rows: list[dict[str, Any]]) -> str:
    def pos(values: list[float] | None) -> str:
        return " / ".join(f"{v:.2f}" for v in values) if values else "–"

    head = ("| point | answers | answer tokens | storage | τ MT-bench | per position | τ in-distribution | "
            "per position | τ_sim (decode walk) | train s |\n|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {r['point']} | {r['answers']} | {r['answer_tokens']} | {r['storage_dtype']} | {r['tau']:.3f} | "
        f"{pos(r['per_position_acceptance'])} | "
        f"{r['tau_in_distribution'] if r['tau_in_distribution'] is None else format(r['tau_in_distribution'], '.3f')}"
        f" | {pos(r['per_position_acceptance_in_distribution'])} | "
        f"{'–' if r['tau_sim'] is None else format(r['tau_sim'], '.3f')}"
        f"{'' if r.get('tau_sim_decode') is None else ' ({:.3f})'.format(r['tau_sim_decode'])}"
        f" | {r['train_s'] or 0:.1f} |"
        for r in rows) + "\n"


def measured_row(ref: str, default: Path) -> dict[str, Any]:
    """The curve row `ref` names: NAME (in `default`) or FILE:NAME (the last row of that name: a re-measure wins)."""
    path, _, name = ref.rpartition(":")
    path = Path(path) if path else default
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["point"] == name] if path.exists() else []
    if not rows:
        raise SystemExit(f"--compare {ref}: no point {name!r} in {path}")
    if not rows[-1].get("mtbench_rows"):
        raise SystemExit(f"--compare {ref}: {path} keeps no per-prompt histograms for {name!r} (a row measured "
                         "before they were kept); measure the point again")
    return rows[-1]


def compare(a: dict[str, Any], b: dict[str, Any], *, samples: int = 1000) -> str:
    """τ(a) − τ(b) at each chain length both measured, paired over MT-bench prompts, as a markdown table."""
    from benchmarks.quality_parity import paired_difference

    diff = paired_difference(a["mtbench_rows"], b["mtbench_rows"], seed=0, samples=samples)
    head = (f"| k | τ {a['point']} | τ {b['point']} | {a['point']} − {b['point']} [95% paired] | prompts |\n"
            "|---|---|---|---|---|\n")
    return head + "\n".join(
        f"| {k} | {d['ours']:.3f} | {d['theirs']:.3f} | {d['tau']:+.3f} [{d['interval'][0]:+.3f}, "
        f"{d['interval'][1]:+.3f}] | {d['prompts']} |" for k, d in diff.items()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2-135m")
    ap.add_argument("--store", default="file://out/curve-store")
    ap.add_argument("--out", type=Path, default=Path("out/curve"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--point", dest="points", action="append", default=[], metavar="NAME=OVERRIDES")
    ap.add_argument("--parity", metavar="NAME", help="run the parity harness on this point's data last")
    ap.add_argument("--venv", type=Path, default=None,
                    help="speculators' venv or interpreter (default: quality_parity's .venv-speculators)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="τ(A) − τ(B) of two measured points on the same prompts (NAME in OUT/curve.jsonl, "
                         "or FILE:NAME); runs nothing")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(*(measured_row(ref, args.out / "curve.jsonl") for ref in args.compare)), flush=True)
        return 0
    import torch

    points = [parse_point(p) for p in args.points] or [("default", [])]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "curve.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    machine = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else
               f"{platform.machine()} CPU, {os.cpu_count()} cores")
    for name, extra in points:
        overrides = args.overrides + extra
        if any(r["point"] == name and r["overrides"] == overrides for r in rows):
            print(f"{name}: measured already ({log})", flush=True)
            continue
        print(f"{name}: {' '.join(overrides) or '(config as is)'}", flush=True)
        records = run_point(args.config, overrides, args.store)
        row = row_for(name, overrides, records)
        row |= {"config": args.config, "machine": machine, "date": datetime.now(UTC).strftime("%Y-%m-%d"),
                "mtbench_rows": mtbench_rows(args.store, records["verify"]["id"])}
        rows.append(row)
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        (args.out / "curve.md").write_text(table(rows))
        print(table(rows), flush=True)
    if args.parity:
        from benchmarks.quality_parity import DEFAULT_VENV, run_parity
        from benchmarks.quality_parity import table as parity_table

        extra = dict(points)[args.parity]
        result = run_parity(args.config, args.overrides + extra, args.store, args.out / f"parity-{args.parity}",
                            args.venv or DEFAULT_VENV)
        print(parity_table(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
