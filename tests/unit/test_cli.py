"""The one CLI every step shares (steps/registry.py `step_main`), driven as a user would: the same flags and
help shape everywhere, `--json`, one-line errors with exit 2, `--debug`, `--version`, the store precedence."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from steps.lib.store import open_store
from steps.registry import STEPS, step_main, version
from tests.builders import MAPPING_DATASET, MAPPING_TARGET, full_disk_in, mapping_world

ROOT = Path(__file__).resolve().parents[2]
SHARED_FLAGS = ("--config", "--store", "--set", "--json", "--debug", "--version")

#: the world's artifact ids: 16 hex digits, as the CLI requires
T0, D0, E0 = MAPPING_TARGET, MAPPING_DATASET, "e0e0000000000001"


@pytest.mark.parametrize("name", list(STEPS))
def test_every_step_has_the_same_help_shape(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_main(name, ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: eaglenest {name} ")
    for flag in (*SHARED_FLAGS, *(f"--{i}" for i in STEPS[name].inputs)):
        assert flag in text, f"{name} --help lacks {flag}"


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        step_main("mapping", ["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"eaglenest {version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version())


@pytest.fixture
def world(tmp_path):
    """A config file and a store holding a target and a dataset: mapping's inputs, nothing else."""
    return mapping_world(tmp_path)


def test_json_prints_the_record_kind_id_uri_seconds_metrics_and_meta(world, capsys, monkeypatch):
    monkeypatch.delenv("EAGLENEST_STORE", raising=False)
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", D0, "--target", T0]
    assert step_main("mapping", [*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert set(record) == {"step", "kind", "id", "uri", "seconds", "metrics", "meta"} and record["kind"] == "vocab"
    assert record["step"] == "mapping" and record["seconds"] >= 0
    assert record["uri"] == world["store"].artifact_uri("vocab", record["id"])
    assert record["metrics"]["distinct_tokens"] == 2            # 5 and 9: answer tokens only
    assert step_main("mapping", argv) == 0
    (line,) = capsys.readouterr().out.splitlines()                     # without --json: one human line
    assert record["id"] in line and record["uri"] in line


def test_mapping_honours_eaglenest_store_over_the_config(world, capsys, monkeypatch):
    """The containers set EAGLENEST_STORE; explicit --store > $EAGLENEST_STORE > the config's `store`."""
    monkeypatch.setenv("EAGLENEST_STORE", world["store"].uri)
    assert step_main("mapping", ["--config", world["config"], "--dataset", D0, "--target", T0, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["uri"].startswith(world["store"].uri)
    assert not (world["tmp"] / "config-store" / "vocab").exists()


def test_train_honours_eaglenest_store(world, capsys, monkeypatch):
    """Cheap: train looks its inputs up in the store EAGLENEST_STORE names (and says so when one is absent)."""
    env_store = open_store(f"file://{world['tmp']}/env-store")
    monkeypatch.setenv("EAGLENEST_STORE", env_store.uri)
    argv = ["--config", world["config"], "--target", T0, "--hidden", "ab" * 8, "--vocab", "cd" * 8]
    assert step_main("train", argv) == 2
    assert env_store.uri in capsys.readouterr().err


def _one_error_line(capsys) -> str:
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err, out.err
    return lines[0]


def test_a_missing_artifact_is_one_line_with_the_fix(world, capsys):
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", "f" * 16, "--target", T0]
    assert step_main("mapping", argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith("eaglenest mapping: ") and f"dataset/{'f' * 16}" in line and "--store" in line


def test_a_missing_default_target_names_the_step_that_makes_it(world, capsys):
    assert step_main("datagen", ["--config", world["config"], "--store", world["store"].uri]) == 2
    line = _one_error_line(capsys)
    assert "no target artifact" in line and "eaglenest target" in line


def test_a_bad_store_uri_is_one_line_with_the_fix(world, capsys):
    assert step_main("mapping", ["--config", world["config"], "--store", "nope://x", "--dataset", D0]) == 2
    line = _one_error_line(capsys)
    assert "nope://x" in line and "file://PATH" in line and "EAGLENEST_STORE" in line


@pytest.mark.parametrize("content", [None, "name: [unclosed\n  - x: {", "- a list\n"])
def test_an_unreadable_or_invalid_config_is_one_line_with_the_fix(tmp_path, capsys, content):
    config = tmp_path / "c.yaml"
    if content is not None:
        config.write_text(content)
    assert step_main("export", ["--config", str(config), "--draft", "x", "--target", "y"]) == 2
    line = _one_error_line(capsys)
    assert str(config) in line and "--config" in line


def test_debug_shows_the_traceback(world):
    argv = ["--config", world["config"], "--store", "nope://x", "--dataset", D0, "--target", T0, "--debug"]
    with pytest.raises(Exception, match="nope://x"):
        step_main("mapping", argv)


def test_the_console_script_dispatches_steps_tools_and_flows_without_steps_importing_flows(tmp_path):
    """`python -m flows.cli`: the `eaglenest` script; a step command never imports Prefect."""
    result = subprocess.run([sys.executable, "-c", "import sys\nfrom flows.cli import main\n"
                             "try:\n    main(['export', '--config', 'nope.yaml'])\nexcept SystemExit:\n    pass\n"
                             "assert 'prefect' not in sys.modules, 'a step command imported prefect'\n"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    out = subprocess.run([sys.executable, "-m", "flows.cli", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.stdout.strip() == f"eaglenest {version()}"


@pytest.mark.parametrize(("override", "field", "bound"), [
    ("train.epochs=-2", "train.epochs", "greater than 0"),
    ("verify.num_prompts=0", "verify.num_prompts", "greater than or equal to 1"),
    ("extract.batch_size=0", "extract.batch_size", "greater than or equal to 1"),
    ("train.ttt_steps=0", "train.ttt_steps", "greater than or equal to 1"),
    ("train.lr=-1", "train.lr", "greater than 0"),
    ("serve.num_steps=0", "serve.num_steps", "greater than or equal to 1"),
    ("serve.port=70000", "serve.port", "less than or equal to 65535"),
    ("extract.disk_budget=0", "extract.disk_budget", "positive size"),
])
def test_each_bad_number_is_one_line_naming_the_field_and_its_range(world, capsys, override, field, bound):
    """Issue 11, finding 8: before any work, whatever the step."""
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", D0, "--target", T0]
    assert step_main("mapping", [*argv, "--set", override]) == 2
    line = _one_error_line(capsys)
    assert field in line and bound in line, line
    assert world["store"].list("vocab") == []


def test_a_draft_vocab_larger_than_the_targets_is_one_line_once_the_target_is_known(world, capsys):
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", D0, "--target", T0]
    assert step_main("mapping", [*argv, "--set", "mapping.draft_vocab_size=100"]) == 2
    line = _one_error_line(capsys)
    assert "mapping.draft_vocab_size=100 exceeds the target's vocab_size=64" in line and "at most 64" in line


# --- finding 9: bad inputs are one line naming the file (and line), exit 2 ---------------------------

def _file_source_config(world, path) -> str:
    config = world["tmp"] / "file-source.yaml"
    config.write_text(yaml.safe_dump({"name": "t", "target": {"source": "tiny"},
                                      "dataset": {"sources": [{"kind": "file", "path": str(path)}]}}))
    return str(config)


@pytest.mark.parametrize(("content", "fragment"), [
    (b"", "empty.jsonl: no rows"),
    (b'{"prompt": "hi"}\n{"prompt": "hi", \n', "empty.jsonl:2: not valid JSON"),
    (b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n', "empty.jsonl:2: not UTF-8 (byte 0xe9 at column 16)"),
    (b'{"prompt": "hi"}\n{"text": "no usable field"}\n', "empty.jsonl:2: field 'messages': no usable field"),
])
def test_a_bad_jsonl_dataset_is_one_line_naming_the_file_and_line(world, capsys, content, fragment):
    data = world["tmp"] / "empty.jsonl"
    data.write_bytes(content)
    argv = ["--config", _file_source_config(world, data), "--store", world["store"].uri, "--target", T0]
    assert step_main("datagen", argv) == 2
    line = _one_error_line(capsys)
    assert str(world["tmp"] / fragment) in line


def test_a_dataset_directory_without_a_usable_column_is_one_line(world, capsys):
    import datasets

    ds_dir = world["tmp"] / "ds"
    datasets.Dataset.from_dict({"question": ["a", "b"]}).save_to_disk(str(ds_dir))
    capsys.readouterr()                                       # the save's progress bar
    argv = ["--config", _file_source_config(world, ds_dir), "--store", world["store"].uri, "--target", T0]
    assert step_main("datagen", argv) == 2
    line = _one_error_line(capsys)
    assert f"{ds_dir}: row 1: field 'messages': no usable field (row has ['question'])" in line


def test_a_dead_s3_endpoint_is_one_line_naming_it(world, capsys, monkeypatch):
    from tests.builders import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"
    for name, value in {"EAGLENEST_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(name, value)
    argv = ["--config", world["config"], "--store", "s3://bucket/p", "--dataset", D0, "--target", T0]
    assert step_main("mapping", argv) == 2
    line = _one_error_line(capsys)
    assert endpoint in line and "EAGLENEST_S3_ENDPOINT_URL" in line


def test_verify_of_a_vllm_only_export_is_one_line(world, capsys):
    w = world["store"].begin("export", E0, step="export")
    w.path("vllm/config.json").write_text("{}")
    w.commit(meta={"engines": {"vllm": "vllm"}})
    argv = ["--config", world["config"], "--store", world["store"].uri, "--export", E0, "--target", T0]
    assert step_main("verify", argv) == 2
    line = _one_error_line(capsys)
    assert f"export {E0} has no 'sglang' directory; it holds ['vllm']" in line and "export.engines" in line


@pytest.mark.parametrize("damage", ["config", "weights"])
def test_doctor_on_a_corrupt_config_or_truncated_weights_is_one_line_naming_the_file(tmp_path, capsys, damage):
    from steps import doctor
    from tests.builders import specforge_layout

    d = specforge_layout(tmp_path)
    name = "config.json" if damage == "config" else "model.safetensors"
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[: len(data) // 2])
    assert doctor.main([str(d)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"eaglenest doctor: {d / name}: ")
    assert ("not valid JSON" if damage == "config" else "not a readable safetensors file") in line


# --- issue 11, finding 7: ids are 16 hex digits and of the kind asked for ---------------------------

@pytest.mark.parametrize("bad", ["../../../outside/evil", f"../hidden/{'a' * 16}", "/etc", "..", "ABCDEF0123456789",
                                 "a" * 15, "a" * 17])
def test_an_input_id_that_is_not_16_hex_digits_is_refused_in_one_line(world, capsys, bad):
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", bad, "--target", T0]
    assert step_main("mapping", argv) == 2
    line = _one_error_line(capsys)
    assert f"--dataset {bad!r} is not an artifact id" in line and "16 hex digits" in line
    assert world["store"].list("vocab") == []


def test_an_id_of_another_kind_is_refused_naming_what_it_holds(world, capsys):
    """A dataset id passed as --target: the target folder has no such artifact; a manifest copied under
    another kind's folder is refused by its own kind field."""
    store = world["store"]
    argv = ["--config", world["config"], "--store", store.uri, "--dataset", D0, "--target", D0]
    assert step_main("mapping", argv) == 2
    assert f"no artifact target/{D0}" in _one_error_line(capsys)
    src = store.local_path(f"{store.key('dataset', D0)}/manifest.json")
    dst = store.local_path(f"{store.key('target', D0)}/manifest.json")
    dst.parent.mkdir(parents=True)
    dst.write_bytes(src.read_bytes())
    assert step_main("mapping", argv) == 2
    assert f"holds dataset/{D0}, not target/{D0}" in _one_error_line(capsys)


def test_eaglenest_store_verify_and_gc_as_a_process(world):
    """`eaglenest store verify [--kind K] [--id ID]`: exit 0, then 1 naming a flipped byte; `store gc`."""
    store = world["store"]

    def eaglenest(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.cli", "store", *args, "--config", world["config"],
                               "--store", store.uri], capture_output=True, text=True, cwd=ROOT, timeout=120)

    ok = eaglenest("verify")
    assert ok.returncode == 0 and f"ok      dataset/{D0}" in ok.stdout and f"ok      target/{T0}" in ok.stdout
    rows = store.local_path(f"{store.key('dataset', D0)}/conversations/part-00000.jsonl")
    rows.write_bytes(rows.read_bytes().replace(b'"a"', b'"b"'))
    bad = eaglenest("verify", "--kind", "dataset")
    assert bad.returncode == 1 and f"CORRUPT dataset/{D0}" in bad.stdout and "sha256" in bad.stdout
    assert "target/" not in bad.stdout                       # --kind: only datasets were checked
    assert eaglenest("verify", "--id", T0).returncode == 0
    refused = eaglenest("verify", "--id", "../dataset")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "16 hex digits" in refused.stderr
    store.backend.put_bytes(f"staging/vocab/{'ab' * 8}/a-gone/x.bin", b"debris")
    gc = eaglenest("gc", "--json")
    removed = [r["key"] for r in json.loads(gc.stdout)["removed"]]
    assert gc.returncode == 0 and [k for k in removed if "/." not in k] == [f"staging/vocab/{'ab' * 8}/a-gone/x.bin"]
    assert all(k.endswith(".lease.json.lock") for k in removed if "/." in k)    # committed writers' lock files
    assert store.backend.list("staging/") == [] and not any(store.local_path("staging").rglob("*"))


def test_store_verify_checks_aliases_naming_a_missing_target_or_a_corrupt_file(world, capsys):
    """Issue 27: `store verify` exits 1 for an alias to nothing and for an unreadable alias file, naming each."""
    from flows.cli import store_main

    store = world["store"]
    args = ["verify", "--config", world["config"], "--store", store.uri]
    store.set_alias("previous", "target", T0)
    store.backend.put_bytes("aliases/production.json", json.dumps({"kind": "export", "id": "ab" * 8}).encode())
    try:
        assert store_main(args) == 1
        out = capsys.readouterr().out
        assert f"ok      alias previous -> target/{T0}" in out
        assert f"CORRUPT alias production  {store.uri}/aliases/production.json points at export/{'ab' * 8}" in out
        store.backend.put_bytes("aliases/production.json", b"{torn")
        assert store_main(args) == 1
        assert "aliases/production.json: not valid JSON" in capsys.readouterr().out
    finally:
        store.restore_alias("production", None)
        store.restore_alias("previous", None)


def test_python_dash_m_runs_the_step_file_once(tmp_path):
    """`python -m steps.<step>` executes its file as `__main__`; the CLI uses that module instead of
    importing `steps.<step>` a second time (two copies: the file run twice, its classes two identities)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['steps.mapping', '--config', 'tiny', '--store', 'bogus://{tmp_path}']\n"
            "try:\n"
            "    runpy.run_module('steps.mapping', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as done:\n"
            "    print('exit', done.code, 'imported-again', 'steps.mapping' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["exit", "2", "imported-again", "False"], out.stdout + out.stderr[-2000:]


def test_a_full_disk_is_one_line_naming_the_file_its_free_bytes_and_the_knobs(world, capsys, monkeypatch):
    """ENOSPC once printed "[Errno 28] No space left on device — check the path and its permissions": no path."""
    from steps.lib.data import shards

    full_disk_in(monkeypatch, shards)                                  # where mapping writes vocab.safetensors
    argv = ["--config", world["config"], "--store", world["store"].uri, "--dataset", D0, "--target", T0]
    assert step_main("mapping", argv) == 2
    line = _one_error_line(capsys)
    assert re.search(r"no space left on device writing \S+/vocab\.safetensors \(filesystem /\S*: \d+ bytes free\)",
                     line), line
    assert "--store" in line and "EAGLENEST_CACHE" in line and "extract.disk_budget" in line
