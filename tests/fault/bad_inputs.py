"""Bad input at every CLI: each case is one line on stderr naming the problem, exit 2, no traceback (issue 27).

    python tests/fault/bad_inputs.py [--only NAME,...] [--jobs 2]

Builds bad configs, datasets, draft directories, safetensors, store URIs and ids under a temporary
directory, runs `python -m flows.cli ...` (what `eaglenest ...` runs) on each, and checks: exit code 2,
no "Traceback" anywhere in the output, and the last stderr line starting with "eaglenest" (the one error
line; a step's log lines before it are progress, not errors). Prints one line per failed case and
`N passed, M failed`; exits 1 when any failed. `tests/unit/test_bad_inputs.py` runs a short form.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASE_TIMEOUT_S = 300.0


@dataclass
class Case:
    name: str
    argv: list[str]


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _draft_variant(root: Path, name: str, edit: Callable[[Path], None]) -> Path:
    """A copy of a good eaglenest SGLang draft dir under root/name with `edit` applied."""
    import shutil

    good = root / "good" / "sglang"
    if not good.exists():
        from tests.builders import eaglenest_layout
        eaglenest_layout(root / "good", "sglang")
    out = root / name
    shutil.copytree(good, out, symlinks=True)
    edit(out)
    return out


def _header_bomb(path: Path) -> None:
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 62) + b"{}")


def _symlink_weights_out(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to("/etc/passwd")


def _symlink_config_out(path: Path) -> None:
    outside = path.parent / "outside-config.json"
    outside.write_text((path / "config.json").read_text())
    (path / "config.json").unlink()
    (path / "config.json").symlink_to(outside)


def cases(root: Path) -> list[Case]:
    """Every bad input, built under `root`."""
    store = f"file://{root / 'store'}"
    good_cfg = _write(root / "good.yaml", (REPO / "configs" / "tiny.yaml").read_text())
    cfgs = {
        "config-yaml-syntax": "name: [unclosed\n",
        "config-a-list": "- 1\n- 2\n",
        "config-null": "null\n",
        "config-unknown-field": "name: x\nno_such_section: {a: 1}\n",
        "config-negative-lr": "name: x\ntrain: {lr: -1}\n",
        "config-string-for-int": "name: x\ntrain: {epochs: many}\n",
        "config-aux-ids-not-ints": "name: x\nextract: {aux_layer_ids: [a, b, c]}\n",
        "config-bad-target-source": "name: x\ntarget: {source: nowhere}\n",
        "config-hf-dir-without-path": "name: x\ntarget: {source: hf_dir}\n",
        "config-file-dataset-without-path": "name: x\ndataset: {sources: [{kind: file}]}\n",
        "config-binary": b"\xff\xfe\x00garbage\x00",
    }
    out = [Case(f"target {name}", ["target", "--config", str(_write(root / f"{name}.yaml", text)), "--store", store])
           for name, text in cfgs.items()]
    out += [
        Case("target config missing", ["target", "--config", str(root / "absent.yaml"), "--store", store]),
        Case("target --set without =", ["target", "--config", str(good_cfg), "--set", "train.lr", "--store", store]),
        Case("target --set unknown field", ["target", "--config", str(good_cfg), "--set", "train.nope=1",
                                             "--store", store]),
        Case("target --set bad number", ["target", "--config", str(good_cfg), "--set", "train.lr=fast",
                                          "--store", store]),
        Case("store uri unknown scheme", ["target", "--config", str(good_cfg), "--store", "ftp://host/x"]),
        Case("store uri s3 without bucket", ["store", "verify", "--store", "s3://"]),
        Case("store verify path-like kind", ["store", "verify", "--store", store, "--kind", "../x"]),
        Case("store verify path-like id", ["store", "verify", "--store", store, "--id", "../../etc"]),
        Case("export draft id not hex", ["export", "--config", str(good_cfg), "--store", store,
                                         "--draft", "not-an-id", "--target", "0123456789abcdef"]),
        Case("export draft id missing", ["export", "--config", str(good_cfg), "--store", store,
                                         "--draft", "0123456789abcdef", "--target", "fedcba9876543210"]),
        Case("verify export id missing", ["verify", "--config", str(good_cfg), "--store", store,
                                          "--export", "0123456789abcdef", "--target", "fedcba9876543210"]),
        Case("train dataset id path-like", ["train", "--config", str(good_cfg), "--store", store,
                                            "--hidden", "../../x", "--vocab", "0123456789abcdef",
                                            "--target", "fedcba9876543210"]),
        Case("gate benchmark id missing", ["gate", "--config", str(good_cfg), "--store", store,
                                           "--benchmark", "0123456789abcdef", "--export", "fedcba9876543210",
                                           "--target", "fedcba9876543210"]),
    ]
    jsonl = {
        "empty": "",
        "not-json": "{this is not json}\n",
        "a-list-row": "[1, 2, 3]\n",
        "no-prompt-field": '{"id": "a", "nothing": 1}\n',
        "non-utf8": b'{"prompt": "\xff\xfe"}\n',
        "torn-last-line": '{"prompt": "hi"}\n{"prompt": "t',
        "oversized-row": '{"prompt": "' + "x" * (4096 * 600) + '"}\n',
        "messages-not-a-list": '{"messages": "hello"}\n',
    }
    for name, text in jsonl.items():
        path = _write(root / "datasets" / f"{name}.jsonl", text)
        out.append(Case(f"dataset upload {name}", ["dataset", "upload", str(path), "--name", "d", "--no-event",
                                                    "--max-prompt-tokens", "16", "--store", store]))
    out.append(Case("dataset upload corrupt parquet", [
        "dataset", "upload", str(_write(root / "datasets" / "corrupt.parquet", b"PAR1garbagePAR1")),
        "--name", "d", "--no-event", "--store", store]))
    out.append(Case("dataset upload missing file", ["dataset", "upload", str(root / "none.jsonl"), "--name", "d",
                                                    "--no-event", "--store", store]))
    drafts = {
        "config-a-list": lambda p: (p / "config.json").write_text("[1, 2]"),
        "config-null": lambda p: (p / "config.json").write_text("null"),
        "config-not-json": lambda p: (p / "config.json").write_text("{nope"),
        "no-config": lambda p: (p / "config.json").unlink(),
        "truncated-weights": lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:200]),
        "header-bomb": _header_bomb,
        "no-weights": lambda p: (p / "model.safetensors").unlink(),
        "weights-symlink-out": _symlink_weights_out,
        "config-symlink-out": _symlink_config_out,
    }
    for name, edit in drafts.items():
        d = _draft_variant(root / "drafts", name, edit)
        out.append(Case(f"doctor {name}", ["doctor", str(d), "--store", store]))
        out.append(Case(f"convert {name}", ["convert", str(d), str(root / "converted" / name), "--to", "vllm"]))
    out += [
        Case("doctor missing dir", ["doctor", str(root / "no-such-draft"), "--store", store]),
        Case("convert missing dir", ["convert", str(root / "no-such-draft"), str(root / "c-none"), "--to", "vllm"]),
        Case("doctor export id missing", ["doctor", "0123456789abcdef", "--store", store]),
        Case("serve --draft config a list", ["serve", "--config", str(good_cfg), "--store", store,
                                             "--draft", str(root / "drafts" / "config-a-list"), "--print-command"]),
    ]
    return out


def run_case(case: Case) -> tuple[Case, str | None]:
    """(case, None when it held, else what went wrong)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, "-m", "flows.cli", *case.argv], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=CASE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return case, f"no answer in {CASE_TIMEOUT_S:.0f} s"
    err_lines = [line for line in done.stderr.splitlines() if line.strip()]
    problems = []
    if done.returncode != 2:
        problems.append(f"exit {done.returncode}")
    if "Traceback" in done.stderr + done.stdout:
        problems.append("a traceback")
    if not err_lines or not err_lines[-1].startswith("eaglenest"):
        problems.append("no one-line error")
    if not problems:
        return case, None
    return case, ", ".join(problems) + " | " + " / ".join(err_lines[-3:])[:400]


def run(names: list[str] | None = None, jobs: int = 2) -> dict[str, object]:
    """Build and run the cases (all, or those named); the figures."""
    with tempfile.TemporaryDirectory(prefix="eaglenest-bad-inputs-") as tmp:
        all_cases = cases(Path(tmp))
        chosen = [c for c in all_cases if names is None or c.name in names]
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(run_case, chosen))
    failed = {case.name: why for case, why in results if why is not None}
    return {"cases": len(results), "passed": len(results) - len(failed), "failed": failed,
            "tracebacks": sum("traceback" in why for why in failed.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated case names")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    figures = run(args.only.split(",") if args.only else None, args.jobs)
    for name, why in figures["failed"].items():
        print(f"FAILED {name}: {why}")
    print(json.dumps({k: v for k, v in figures.items() if k != "failed"}))
    print(f"{figures['passed']} passed, {len(figures['failed'])} failed")
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
