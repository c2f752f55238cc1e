"""The run report and the pipeline's metrics table fit the page (issue 26, item 8): the SGLang command one
option per line and read back by `sh` as the same argv, the lineage in three columns with the store said once,
the metrics table in four."""

from __future__ import annotations

import json
import re
import subprocess

from flows.ui import metrics_rows, run_report, shell_lines
from steps.lib.config import load_config
from steps.lib.serving.start import build_sglang_command

STORE = "file:///home/user/.eaglenest/store"


def record(kind: str, rid: str, **metrics) -> dict:
    return {"kind": kind, "id": rid, "uri": f"{STORE}/artifacts/{kind}/{rid}", "seconds": 1.5, "metrics": metrics}


def sh_argv(text: str) -> list[str]:
    """The argv `sh` builds from `text` (one NUL-terminated word each)."""
    out = subprocess.run(["sh", "-c", "printf '%s\\0' " + text.split(" ", 1)[1]], capture_output=True, check=True)
    return [text.split(" ", 1)[0], *out.stdout.decode().split("\0")[:-1]]


def test_the_sglang_command_is_one_option_a_line_and_sh_reads_back_the_same_argv(tmp_path):
    draft = tmp_path / "export" / "sglang"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "target dir").mkdir()
    argv = build_sglang_command(load_config("configs/tiny.yaml"), target_path=tmp_path / "target dir",
                                draft_dir=draft)
    text = shell_lines(argv)
    lines = text.splitlines()
    assert len(lines) == 1 + sum(a.startswith("--") for a in argv), text
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\"), text
    assert all(line.lstrip().startswith("--") for line in lines[1:]), text
    assert "--speculative-algorithm EAGLE3 \\" in text
    assert sh_argv(text) == argv
    assert max(map(len, lines)) < 120, max(lines, key=len)


def test_the_lineage_has_three_columns_and_names_the_store_once():
    records = {"target": record("target", "a" * 16), "datagen": record("dataset", "b" * 16, ok=400),
               "export": record("export", "c" * 16)}
    md = run_report("tiny", records, dataset=None, decision=None, production=None, plot_png=None, outcome="ok")
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0] == "| step | artifact | seconds |"
    assert all(len(re.findall(r"(?<!\\)\|", row)) == 4 for row in rows), rows
    assert "| datagen | `dataset/" + "b" * 16 + "` | 1.5 |" in rows
    assert md.count("/home/user/.eaglenest/store") == 1 and "artifacts under `/home/user/.eaglenest/store/" in md


def test_artifacts_of_another_store_keep_their_uris():
    records = {"target": record("target", "a" * 16),
               "export": {**record("export", "c" * 16), "uri": "s3://other/artifacts/export/" + "c" * 16}}
    md = run_report("tiny", records, dataset=None, decision=None, production=None, plot_png=None, outcome="ok")
    assert "`s3://other/artifacts/export/" + "c" * 16 + "`" in md and "artifacts under" not in md


def test_the_metrics_table_has_four_columns_whatever_the_steps_measured():
    records = {"datagen": record("dataset", "b" * 16, ok=400, tokens=51234, tokens_per_s=12.3456),
               "verify": record("verify", "d" * 16, tau=1.338095238, speedup=0.41, smoke_tau=1.2),
               "gate": record("gate", "e" * 16, verdict="promote")}
    rows = metrics_rows(records)
    assert all(list(row) == ["step", "artifact", "seconds", "metrics"] for row in rows), rows
    assert rows[0]["metrics"] == "ok 400 · tokens 51234 · tokens_per_s 12.346"
    assert rows[1]["metrics"] == "tau 1.338 · speedup 0.41 · smoke_tau 1.2"
    assert rows[2] == {"step": "gate", "artifact": "gate/" + "e" * 16, "seconds": 1.5, "metrics": "verdict promote"}
