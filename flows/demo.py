"""`make demo`: the whole pipeline on the embedded default, then the same pipeline with an
untrained draft as the control, and a summary a person can read in ten seconds.

Writes `<out>/summary.json` with τ (trained and untrained), per-position acceptance, each step's
artifact id, URI and wall seconds, and the local paths of the target and of both exports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flows.parameters import BadParameter, check_config
from flows.pipeline import eagle3_pipeline
from steps.lib.config import find_config, load_config
from steps.lib.store import open_store, store_uri_for

#: the control: the same pipeline, but the draft is exported straight from initialisation.
#: It is measured on MT-bench only: an untrained draft accepts nothing anywhere.
UNTRAINED = ["train.max_steps=0", "verify.in_distribution_prompts=0"]


def tau_summary(verify: dict[str, Any], control_verify: dict[str, Any]) -> dict[str, Any]:
    """The summary's τ fields from verify's metrics (the trained draft's, the untrained control's)."""
    return {
        "acceptance_length": verify["tau"],          # the user-facing name of τ
        # the 2.5 / 97.5 percentiles of τ over resampled prompts (steps.lib.metrics.tau_interval)
        "acceptance_length_interval": verify.get("tau_interval"),
        "acceptance_length_random_draft": control_verify["tau"],
        # τ on prompts held out of the training sources (dataset.held_out): what the draft learned
        "acceptance_length_in_distribution": verify.get("tau_in_distribution"),
        "acceptance_length_in_distribution_interval": verify.get("tau_interval_in_distribution"),
        "per_position_acceptance_in_distribution": verify.get("per_position_acceptance_in_distribution"),
        "per_position_acceptance": verify["per_position_acceptance"],
        # the share of the target's answer tokens the draft's vocab holds: the rest are never drafted
        "draft_vocab_coverage": verify.get("draft_vocab_coverage"),
        # of the drafts rejected there, the share whose right token was outside that vocab
        "rejections_outside_draft_vocab": verify.get("rejections_outside_draft_vocab"),
        "num_steps": verify["num_steps"],
        "speedup_reference_engine": verify.get("speedup"),
        # which MT-bench categories the prompts came from, each with its own τ (a few prompts may span only one)
        "acceptance_length_by_category": {c: m["tau"] for c, m in (verify.get("tau_by_category") or {}).items()},
    }


def summarize(cfg_name: str, records: dict[str, dict[str, Any]], control: dict[str, dict[str, Any]],
              store_uri: str) -> dict[str, Any]:
    from steps.lib.artifacts import export_dir, target_dir

    store = open_store(store_uri)
    verify, control_verify = records["verify"]["metrics"], control["verify"]["metrics"]
    export_id, target_id = records["export"]["id"], records["target"]["id"]
    return {
        "config": cfg_name,
        "target": load_config(find_config(cfg_name)).target.display_name,
        "target_dir": str(target_dir(store, target_id)),
        "store": store.uri,
        **tau_summary(verify, control_verify),
        "steps": {name: {"id": r["id"], "uri": r["uri"], "seconds": r["seconds"]} for name, r in records.items()},
        "control_steps": {name: {"id": r["id"], "uri": r["uri"], "seconds": r["seconds"]}
                          for name, r in control.items() if r["id"] != records[name]["id"]},
        "export_dirs": {engine: str(export_dir(store, export_id, engine)) for engine in ("sglang", "vllm")},
    }


def _interval(bounds: list[float] | None) -> str:
    return "" if not bounds else f" (95% interval {bounds[0]:.3f}–{bounds[1]:.3f} over prompts)"


def print_summary(s: dict[str, Any]) -> None:
    pos = ", ".join(f"{p:.2f}" for p in s["per_position_acceptance"])
    print(f"\n== eaglenest demo: {s['target']} ==")
    print(f"acceptance length τ (k={s['num_steps']}, held-out MT-bench): {s['acceptance_length']:.3f}"
          f"{_interval(s.get('acceptance_length_interval'))}   untrained draft: "
          f"{s['acceptance_length_random_draft']:.2f}")
    print(f"per-position acceptance: [{pos}]")
    if s.get("acceptance_length_by_category"):
        print("MT-bench categories measured: " + ", ".join(f"{c} {t:.2f}"
                                                         for c, t in s["acceptance_length_by_category"].items()))
    if s.get("draft_vocab_coverage") is not None:
        print(f"the draft's vocab holds {s['draft_vocab_coverage']:.1%} of the target's MT-bench answer tokens "
              "(the rest are never drafted; mapping.draft_vocab_size sets it)")
    if s.get("rejections_outside_draft_vocab") is not None:
        print(f"{s['rejections_outside_draft_vocab']:.1%} of the rejected drafts were tokens outside the draft's vocab")
    if s["acceptance_length_in_distribution"] is not None:
        print(f"acceptance length τ on held-out prompts of the training sources: "
              f"{s['acceptance_length_in_distribution']:.2f}"
              f"{_interval(s.get('acceptance_length_in_distribution_interval'))}")
    for name, r in s["steps"].items():
        print(f"  {name:8s} {r['seconds']:8.1f} s  {r['uri']}")
    for engine, path in s["export_dirs"].items():
        print(f"  export/{engine}: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eaglenest demo", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2-135m.yaml")
    parser.add_argument("--out", default="out/demo", help="where summary.json is written")
    parser.add_argument("--store", default=None, help="store URI (default: the config's, or EAGLENEST_STORE)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    try:
        check_config(args.config, args.overrides)
    except BadParameter as err:      # the pipeline would refuse it too: say so here, once
        print(f"eaglenest demo: {err}", file=sys.stderr)
        return 2
    records = eagle3_pipeline(config=args.config, overrides=args.overrides, store=args.store, through="verify")
    control = eagle3_pipeline(config=args.config, overrides=args.overrides + UNTRAINED, store=args.store,
                              through="verify")
    store_uri = store_uri_for(args.store, load_config(find_config(args.config), args.overrides).store)
    summary = summarize(args.config, records, control, store_uri)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    print(f"\nsummary: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
