"""steps/benchmark.py: baseline vs speculative against two real reference servers on 127.0.0.1.

The world is the one of tests/unit/test_reference_server.py (tests/builders.py `bigram_world`):
a "bigram" tiny Llama target and a hand-built copying draft, exported by steps.export,
so the speculative server really accepts drafts (τ well above 1).
"""

from __future__ import annotations

import json
import socket

import pytest

from steps import benchmark
from steps.lib.config import BenchmarkConfig
from steps.lib.data import prompts
from steps.lib.serving import launch as launching
from tests.builders import bigram_world, cli_record, free_port, record_of, scripted_totals

LAYER_IDS, K = [1, 2, 3], 3


def free_ports() -> int:
    """A port p with p + 1 also free (the benchmark starts the baseline on serve.port + 1)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, monkeypatch_module):
    world = bigram_world(tmp_path_factory.mktemp("bench"), free_ports(), num_steps=K, layer_ids=LAYER_IDS,
                         benchmark={"max_new_tokens": 24})
    cfg = world["cfg"].model_copy(update={"verify": world["cfg"].verify.model_copy(update={"num_prompts": 2})})
    m = benchmark.run(cfg, world["store"], world["export_id"], world["target_id"])
    return {**world, "cfg": cfg, "manifest": m}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    for k in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        mp.setenv(k, "1")
    yield mp
    mp.undo()


def test_benchmark_json_has_speed_tau_latency_settings_servers_and_hardware(bench):
    m, store = bench["manifest"], bench["store"]
    assert m.kind == "benchmark" and m.inputs == {"export": bench["export_id"], "target": bench["target_id"]}
    report = json.loads(store.fetch_file("benchmark", m.id, "benchmark.json").read_text())
    assert report["settings"]["batch_sizes"] == [1, 4] and report["settings"]["temperatures"] == [0.0]
    assert report["prompts"] == ["mtbench-81", "mtbench-91", "humaneval-0", "humaneval-1", "humaneval-2",
                                 "humaneval-3"]
    spec, base = report["servers"]["speculative"], report["servers"]["baseline"]
    assert spec["version"].startswith("reference-") and spec["speculative_algorithm"] == "EAGLE3"
    assert spec["speculative_num_steps"] == K and spec["speculative_eagle_topk"] == 1
    assert spec["speculative_num_draft_tokens"] == K + 1 and base["speculative_algorithm"] is None
    assert report["hardware"]["cpu"] and "torch" in report["hardware"]
    r = report["results"]["0.0"]
    for batch in ("1", "4"):
        for side in ("baseline", "speculative"):
            b = r[side]["batches"][batch]
            assert b["requests"] == 6 and b["completion_tokens"] == 6 * bench["cfg"].benchmark.max_new_tokens
            assert b["tokens_per_s"] > 0
    assert r["baseline"]["acceptance"] is None                  # no draft, no spec_* meta_info
    acc = r["speculative"]["acceptance"]
    assert 2.0 <= acc["tau"] <= K + 1 and len(acc["per_position_acceptance"]) == K
    assert acc["per_position_acceptance"][0] == 1.0             # the copying draft's d_1 is always right
    assert acc["tau"] == pytest.approx((acc["accepted_drafts"] + acc["verify_steps"]) / acc["verify_steps"])
    assert r["speculative"]["latency"]["ttft_s"] > 0 and r["speculative"]["latency"]["itl_s"] > 0
    assert m.metrics["tau"] == acc["tau"] and m.metrics["speedup"] > 0
    print(f"τ {m.metrics['tau']:.3f}  baseline {m.metrics['baseline_tokens_per_s']:.1f} tok/s  "
          f"spec {m.metrics['spec_tokens_per_s']:.1f} tok/s  speedup {m.metrics['speedup']:.2f}  "
          f"TTFT {m.metrics['spec_ttft_s'] * 1000:.0f} ms  ITL {m.metrics['spec_itl_s'] * 1000:.1f} ms")


def test_live_tau_is_exactly_what_the_scripted_draft_gives(bench):
    """Every batch size sends every pinned prompt: the summed counts are the script's, that many times."""
    from transformers import AutoTokenizer

    m, cfg = bench["manifest"], bench["cfg"]
    report = json.loads(bench["store"].fetch_file("benchmark", m.id, "benchmark.json").read_text())
    acc = report["results"]["0.0"]["speculative"]["acceptance"]
    tok = AutoTokenizer.from_pretrained(bench["target_dir"])
    prompts = [p["input_ids"] for p in benchmark.pinned_prompts(cfg, cfg.benchmark, tok)]
    eos = None if cfg.benchmark.ignore_eos else tok.eos_token_id
    accepted, steps = map(sum, zip(*scripted_totals(bench["target_dir"], prompts, K, cfg.benchmark.max_new_tokens,
                                                    eos), strict=True))
    runs = len(cfg.benchmark.batch_sizes)
    assert (acc["accepted_drafts"], acc["verify_steps"]) == (runs * accepted, runs * steps)
    assert m.metrics["tau"] == pytest.approx((accepted + steps) / steps, rel=1e-12)


def test_report_markdown_and_png_are_written(bench):
    m, store = bench["manifest"], bench["store"]
    md = store.fetch_file("benchmark", m.id, "report.md").read_text()
    assert "Live τ" in md and "| 0.0 | 1 |" in md and "| 0.0 | 4 |" in md and "humaneval-0" in md
    png = store.fetch_file("benchmark", m.id, "benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_servers_it_started_are_stopped_and_a_rerun_reuses_the_artifact(bench):

    m = bench["manifest"]
    spec_url = m.meta["servers"]["speculative"]["url"]
    assert launching.health_status(f"{spec_url}/health", timeout_s=2) is None
    again = benchmark.run(bench["cfg"], bench["store"], bench["export_id"], bench["target_id"])
    assert again.id == m.id and again.created == m.created
    # the dtype verify decodes in is verify's, not what the benchmark measured: the same artifact
    cfg = bench["cfg"]
    bf16 = cfg.model_copy(update={"verify": cfg.verify.model_copy(update={"dtype": "bfloat16"})})
    assert benchmark.run(bf16, bench["store"], bench["export_id"], bench["target_id"]).id == m.id


def test_main_prints_the_benchmark_record_of_the_same_measurement(bench, tmp_path, capsys):
    """The CLI on the fixture's config and store: the content-addressed measurement is found, not re-run."""
    config = tmp_path / "c.yaml"
    config.write_text(bench["cfg"].model_dump_json())
    code, record = cli_record(capsys, benchmark.main, "--config", str(config), "--store", bench["store"].uri,
                              "--export", bench["export_id"], "--target", bench["target_id"])
    assert code == 0 and record == record_of(bench["store"], bench["manifest"])
    assert record["metrics"]["tau"] > 1.5 and record["metrics"]["speedup"] > 0


def test_pinned_prompts_are_deterministic_and_match_verify_selection(bench):
    from transformers import AutoTokenizer


    tok = AutoTokenizer.from_pretrained(bench["target_dir"])
    s = BenchmarkConfig(num_code_prompts=2)
    a, b = benchmark.pinned_prompts(bench["cfg"], s, tok), benchmark.pinned_prompts(bench["cfg"], s, tok)
    assert a == b and [p["id"] for p in a] == ["mtbench-81", "mtbench-91", "humaneval-0", "humaneval-1"]
    assert [(p["id"], p["input_ids"]) for p in a[:2]] == prompts.held_out_prompts(bench["cfg"], tok)
