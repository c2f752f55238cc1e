"""benchmarks/tau_curve.py --compare: two measured points, τ(A) − τ(B) paired over the same MT-bench prompts,
from the per-prompt histograms each curve row keeps."""

from __future__ import annotations

import json

import pytest

from benchmarks import tau_curve
from benchmarks.quality_parity import paired_difference


def _row(point: str, histograms: list[list[int]], *, keep: bool = True) -> dict:
    rows = [{"id": f"q{i // 2}", "turn": 1 + i % 2, "num_steps": 3, "accept_histogram": h}
            for i, h in enumerate(histograms)]
    return {"point": point, "tau": 0.0, **({"mtbench_rows": rows} if keep else {})}


def test_compare_prints_each_tau_and_the_paired_difference_of_two_points_in_two_files(tmp_path, capsys):
    base = [[0, 0, 0, 9], [9, 0, 0, 0], [1, 2, 3, 3], [6, 2, 1, 0]] * 10
    better = [[h[0] - 1, h[1] + 1, *h[2:]] if h[0] else [h[0], h[1], h[2] - 1, h[3] + 1] for h in base]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(_row("old", base)) + "\n" + json.dumps(_row("new", better)) + "\n")
    b.write_text(json.dumps(_row("base", base)) + "\n")
    assert tau_curve.main(["--compare", f"{a}:new", f"{b}:base"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    d = paired_difference(_row("new", better)["mtbench_rows"], _row("base", base)["mtbench_rows"], seed=0,
                          samples=1000)["3"]
    assert d["tau"] == pytest.approx(40 / sum(map(sum, base))) and d["interval"][0] > 0
    assert line == (f"| 3 | {d['ours']:.3f} | {d['theirs']:.3f} | {d['tau']:+.3f} [{d['interval'][0]:+.3f}, "
                    f"{d['interval'][1]:+.3f}] | 40 |")


def test_compare_names_the_point_it_cannot_pair(tmp_path):
    out = tmp_path / "curve"
    out.mkdir()
    (out / "curve.jsonl").write_text(json.dumps(_row("old", [[1, 1, 1, 1]], keep=False)) + "\n")
    with pytest.raises(SystemExit, match="no per-prompt histograms for 'old'"):
        tau_curve.main(["--out", str(out), "--compare", "old", "old"])
    with pytest.raises(SystemExit, match="no point 'gone'"):
        tau_curve.main(["--out", str(out), "--compare", "gone", "old"])
