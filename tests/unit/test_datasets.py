"""flows/dataset_trigger.py without a Prefect server: the dataset event (shape, deterministic id, accepted
by the server's own event schema), validation before upload, upload/list over a file store, and the
store additions it rests on (`stat`, `put_object`, `fetch_object`) over file:// and a real S3
protocol server (moto on 127.0.0.1). The trigger itself runs in tests/integration/test_dataset_trigger.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import uuid
from pathlib import Path

import pytest
from prefect.server.events.schemas.events import Event
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import dataset_trigger as datasets
from flows.dataset_trigger import EVENT, check_dataset, dataset_event, list_datasets, upload_dataset
from steps.lib.config import PromptSource
from steps.lib.data.prompts import load_source
from steps.lib.store import open_store
from tests.conftest import S3_BUCKET as BUCKET  # the `s3_endpoint` moto server fixture is in tests/conftest.py

URI = "s3://bucket/prefix/datasets/chats/part-1.jsonl"
GOOD_ROWS = [{"prompt": "What is a drafter?"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the event ----------------------------------------------------------------------------------------

def test_dataset_event_follows_the_contract():
    ev = dataset_event(URI, "chats", "0cc175b9c0f1b6a831c399e269772661", 123, "s3://bucket/prefix")
    assert ev["event"] == EVENT == "eaglenest.dataset.uploaded"
    assert ev["resource"] == {"prefect.resource.id": "eaglenest.dataset.chats", "prefect.resource.name": "chats",
                              "eaglenest.pipeline": "tiny"}
    assert ev["payload"] == {"uri": URI, "name": "chats", "version": "0cc175b9c0f1b6a831c399e269772661",
                             "size": 123, "store": "s3://bucket/prefix", "pipeline": "tiny"}
    assert ev["id"] == str(uuid.uuid5(uuid.NAMESPACE_URL, f"{URI}@0cc175b9c0f1b6a831c399e269772661"))
    json.dumps(ev)  # plain JSON: the MinIO adapter posts it as is


def test_event_id_is_the_same_for_the_same_object_version_only():
    a = dataset_event(URI, "chats", "v1", 1, "s3://bucket/prefix")
    again = dataset_event(URI, "chats", "v1", 1, "s3://bucket/prefix")
    assert a["id"] == again["id"]
    assert dataset_event(URI, "chats", "v2", 1, "s3://bucket/prefix")["id"] != a["id"]
    assert dataset_event(URI.replace("part-1", "part-2"), "chats", "v1", 1, "s3://bucket/prefix")["id"] != a["id"]


def test_the_server_event_schema_accepts_the_event():
    ev = dataset_event(URI, "chats", "v1", 7, "s3://bucket/prefix")
    parsed = Event.model_validate(ev)
    assert str(parsed.id) == ev["id"] and parsed.resource.id == "eaglenest.dataset.chats"
    assert parsed.payload["uri"] == URI


def dead_api_url() -> str:
    """An API URL nothing listens on (a port just freed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/api"


def test_post_events_names_the_url_when_the_server_is_unreachable():
    url = dead_api_url()
    with pytest.raises(ConnectionError, match=re.escape(f"{url}/events")):
        datasets.post_events(url, [dataset_event(URI, "chats", "v1", 7, "s3://bucket/prefix")])


# --- validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad_row, line, field", [
    ({"messages": [{"role": "user"}]}, 2, "messages[0]"),
    ({"prompt": 42}, 2, "prompt"),
    ({"messages": [{"role": "user", "content": "  "}]}, 2, "messages[0].content"),
    ({"text": "no known field"}, 2, "messages"),
])
def test_a_bad_row_is_refused_naming_the_line_and_field(tmp_path, bad_row, line, field):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD_ROWS[0], bad_row, GOOD_ROWS[1]])
    with pytest.raises(ValueError) as err:
        check_dataset(path)
    assert f"{path}:{line}" in str(err.value) and repr(field) in str(err.value)


def test_invalid_json_and_unknown_formats_are_refused(tmp_path):
    broken = tmp_path / "d.jsonl"
    broken.write_text(json.dumps(GOOD_ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"d\.jsonl:2: not valid JSON"):
        check_dataset(broken)
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"unknown dataset format '\.csv'"):
        check_dataset(csv)
    with pytest.raises(FileNotFoundError):
        check_dataset(tmp_path / "missing.jsonl")


def test_the_cli_refuses_a_row_over_the_byte_bound_before_parsing_it(tmp_path, capsys):
    """`dataset upload` reads the file as datagen does: a line at a time, a row over the bound refused by its size."""
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps(GOOD_ROWS[0]) + "\n" + json.dumps({"prompt": "x" * 300_000}) + "\n")
    store_uri = f"file://{tmp_path / 'store'}"
    assert datasets.main(["upload", str(big), "--name", "big", "--store", store_uri, "--no-event",
                          "--max-prompt-tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert f"{big}:2: a line longer than the bound" in err and "datagen.max_prompt_tokens=64" in err
    assert "nothing was uploaded" in err and not (tmp_path / "store").exists()
    assert datasets.main(["upload", str(big), "--name", "big", "--store", store_uri, "--no-event"]) == 0   # 1024


def test_jsonl_and_parquet_count_their_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert check_dataset(write_jsonl(tmp_path / "d.jsonl", GOOD_ROWS)) == 2
    pq.write_table(pa.Table.from_pylist([{"prompt": f"q{i}"} for i in range(5)]), tmp_path / "d.parquet")
    assert check_dataset(tmp_path / "d.parquet") == 5


# --- upload and list over a file store -----------------------------------------------------------------

def test_upload_puts_the_file_under_datasets_name_and_lists_it(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    src = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    record, sent = upload_dataset(store, src, "support")
    assert sent
    assert record["key"] == "datasets/support/chats.jsonl"
    assert (tmp_path / "store" / "datasets" / "support" / "chats.jsonl").read_bytes() == src.read_bytes()
    assert record["version"] == hashlib.md5(src.read_bytes()).hexdigest()
    assert record["uri"] == f"file://{(tmp_path / 'store').resolve()}/datasets/support/chats.jsonl"
    assert list_datasets(store) == [record]


def test_the_same_bytes_again_are_not_sent_and_give_the_same_event(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    src = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    first, _ = upload_dataset(store, src, "support")
    again, sent = upload_dataset(store, src, "support")
    assert not sent and again == first
    assert datasets.event_for(store, again)["id"] == datasets.event_for(store, first)["id"]
    write_jsonl(src, GOOD_ROWS[:1])
    changed, sent = upload_dataset(store, src, "support")
    assert sent and changed["version"] != first["version"]
    assert datasets.event_for(store, changed)["id"] != datasets.event_for(store, first)["id"]


def test_list_skips_objects_that_are_not_datasets_name_file(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    root = tmp_path / "store" / "datasets"
    (root / "a" / "deeper").mkdir(parents=True)
    (root / "loose.jsonl").write_text("{}\n")
    (root / "a" / "deeper" / "x.jsonl").write_text("{}\n")
    (root / "a" / ".x.jsonl.tmp-1").write_text("{}\n")
    (root / "a" / "ok.jsonl").write_text("{}\n")
    assert [r["key"] for r in list_datasets(store)] == ["datasets/a/ok.jsonl"]


def test_the_prefix_picks_the_pipeline_and_the_event_carries_it(tmp_path):
    """datasets/<name>/ → the default pipeline; datasets/<pipeline>/<name>/ → that one; anything else is no dataset."""
    assert datasets.parse_key("datasets/chats/a.jsonl") == ("tiny", "chats", "a.jsonl")
    assert datasets.parse_key("datasets/smollm2/chats/a.jsonl") == ("smollm2", "chats", "a.jsonl")
    for other in ("datasets/unknown/chats/a.jsonl", "datasets/a.jsonl", "other/x/a.jsonl", "datasets//a.jsonl"):
        assert datasets.parse_key(other) is None, other
    store = open_store(f"file://{tmp_path / 'store'}")
    src = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    default, _ = upload_dataset(store, src, "support")
    smol, _ = upload_dataset(store, src, "support", pipeline="smollm2")
    assert default["key"] == "datasets/support/chats.jsonl" and default["pipeline"] == "tiny"
    assert smol["key"] == "datasets/smollm2/support/chats.jsonl" and smol["pipeline"] == "smollm2"
    event = datasets.event_for(store, smol)
    assert event["resource"]["eaglenest.pipeline"] == "smollm2" == event["payload"]["pipeline"]
    assert event["id"] != datasets.event_for(store, default)["id"]
    assert sorted(r["key"] for r in list_datasets(store)) == sorted([default["key"], smol["key"]])
    with pytest.raises(ValueError, match="pipeline's prefix"):
        upload_dataset(store, src, "smollm2")


@pytest.mark.parametrize("name", ["", "../up", "a/b", "-x", "has space"])
def test_bad_dataset_names_are_refused(tmp_path, name):
    store = open_store(f"file://{tmp_path / 'store'}")
    with pytest.raises(ValueError, match="dataset name"):
        upload_dataset(store, write_jsonl(tmp_path / "d.jsonl", GOOD_ROWS), name)


def test_cli_refuses_a_bad_file_and_keeps_the_stored_version(tmp_path, capsys):
    store_uri = f"file://{tmp_path / 'store'}"
    good = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    assert datasets.main(["upload", str(good), "--name", "support", "--store", store_uri, "--no-event"]) == 0
    stored = tmp_path / "store" / "datasets" / "support" / "chats.jsonl"
    before = stored.read_bytes()
    bad = tmp_path / "bad" / "chats.jsonl"
    bad.parent.mkdir()
    write_jsonl(bad, [GOOD_ROWS[0], {"prompt": None, "messages": [{"role": "robot", "content": "x"}]}])
    capsys.readouterr()
    assert datasets.main(["upload", str(bad), "--name", "support", "--store", store_uri, "--no-event"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2" in err and "'messages[0].role'" in err and "nothing was uploaded" in err
    assert stored.read_bytes() == before and bad.is_file()


def test_cli_without_a_prefect_api_uploads_nothing_and_says_how_to_fix_it(tmp_path, capsys):
    good = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        rc = datasets.main(["upload", str(good), "--name", "support", "--store", f"file://{tmp_path / 'store'}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "PREFECT_API_URL" in err and "--no-event" in err
    assert not (tmp_path / "store" / "datasets").exists()


def test_cli_with_an_unreachable_api_keeps_the_upload_and_says_the_event_was_not_sent(tmp_path, capsys):
    good = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    with temporary_settings(updates={PREFECT_API_URL: dead_api_url()}):
        rc = datasets.main(["upload", str(good), "--name", "support", "--store", f"file://{tmp_path / 'store'}"])
    assert rc == 1
    assert "the file is in the store but the event was not sent" in capsys.readouterr().err
    assert (tmp_path / "store" / "datasets" / "support" / "chats.jsonl").read_bytes() == good.read_bytes()


def test_cli_list_prints_name_size_version_and_uri(tmp_path, capsys):
    store_uri = f"file://{tmp_path / 'store'}"
    good = write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS)
    datasets.main(["upload", str(good), "--name", "support", "--store", store_uri, "--no-event"])
    capsys.readouterr()
    assert datasets.main(["list", "--store", store_uri]) == 0
    out = capsys.readouterr().out
    assert "support" in out and hashlib.md5(good.read_bytes()).hexdigest() in out
    assert f"{good.stat().st_size} B" in out and "/datasets/support/chats.jsonl" in out


# --- store additions: stat / put_object / fetch_object, and prompts from a store URI --------------------

def test_file_store_stat_is_size_and_md5(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    store.backend.put_bytes("datasets/a/x.jsonl", b"hello\n")
    assert store.backend.stat("datasets/a/x.jsonl") == {"size": 6, "etag": hashlib.md5(b"hello\n").hexdigest()}
    assert store.backend.stat("datasets/a/missing.jsonl") is None


def test_prompts_read_a_file_source_given_as_a_file_store_uri(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    record, _ = upload_dataset(store, write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS), "support")
    prompts = load_source(PromptSource(kind="file", path=record["uri"]))
    assert [p["messages"][-1]["content"] for p in prompts] == ["What is a drafter?", "Hi"]
    with pytest.raises(ValueError, match="datasets/\\[<pipeline>/\\]<name>/<file>"):
        load_source(PromptSource(kind="file", path="s3://bucket/prefix/chats.jsonl"))
    # a file:// URI outside datasets/ is the local file it names, as a plain path is
    (tmp_path / "local.jsonl").write_text(json.dumps(GOOD_ROWS[0]) + "\n")
    assert len(load_source(PromptSource(kind="file", path=f"file://{tmp_path / 'local.jsonl'}"))) == 1


def test_a_dataset_uploaded_for_another_pipeline_is_read_from_its_uri(tmp_path):
    """datasets/smollm2/<name>/<file>: the URI the trigger hands eagle3-pipeline/smollm2 loads."""
    store = open_store(f"file://{tmp_path / 'store'}")
    record, _ = upload_dataset(store, write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS), "support", "smollm2")
    assert "/datasets/smollm2/support/" in record["uri"]
    assert len(load_source(PromptSource(kind="file", path=record["uri"]))) == 2


def test_upload_of_a_dataset_far_below_its_pipelines_need_warns_with_the_numbers(tmp_path, capsys):
    small = write_jsonl(tmp_path / "support-chats.jsonl", [{"prompt": f"question {i}?"} for i in range(32)])
    store_uri = f"file://{tmp_path / 'store'}"
    assert datasets.main(["upload", str(small), "--name", "support", "--store", store_uri, "--no-event"]) == 0
    err = capsys.readouterr().err
    assert "warning: support-chats.jsonl for eagle3-pipeline/tiny: 32 answers, far below the ~327" in err, err
    assert "gate.min_tau 1.2" in err and "datagen.samples_per_prompt=" in err
    enough = write_jsonl(tmp_path / "enough.jsonl", [{"prompt": f"question {i}?"} for i in range(100)])
    assert datasets.main(["upload", str(enough), "--name", "enough", "--store", store_uri, "--no-event"]) == 0
    assert "far below" not in capsys.readouterr().err


def test_the_pipelines_dataset_parameter_makes_the_upload_its_only_prompt_source(tmp_path):
    from flows.pipeline import dataset_overrides
    from steps.lib.config import find_config, load_config
    from steps.lib.data.prompts import load_prompts

    store = open_store(f"file://{tmp_path / 'store'}")
    record, _ = upload_dataset(store, write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS), "support")
    cfg = load_config(find_config("tiny"), dataset_overrides(record["uri"]))
    assert [(s.kind, s.path) for s in cfg.dataset.sources] == [("file", record["uri"])]
    prompts = load_prompts(cfg.dataset, cfg.seed)
    assert sorted(p["messages"][-1]["content"] for p in prompts) == ["Hi", "What is a drafter?"]


@pytest.fixture
def s3_store(s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLENEST_S3_ENDPOINT_URL", s3_endpoint)
    return open_store(f"s3://{BUCKET}/{uuid.uuid4().hex}", cache_dir=tmp_path / "cache")


def test_s3_stat_is_size_and_etag_without_quotes(s3_store):
    s3_store.backend.put_bytes("datasets/a/x.jsonl", b"hello\n")
    stat = s3_store.backend.stat("datasets/a/x.jsonl")
    assert stat == {"size": 6, "etag": hashlib.md5(b"hello\n").hexdigest()}
    assert s3_store.backend.stat("datasets/a/missing.jsonl") is None


def test_s3_put_object_is_single_part_so_the_version_is_the_md5(s3_store, tmp_path):
    big = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 1000}) + "\n"
    big.write_text(line * 9000)  # 9 MB: over boto3's 8 MB multipart threshold
    stat = s3_store.put_object("datasets/big/big.jsonl", big)
    assert stat == {"size": big.stat().st_size, "etag": hashlib.md5(big.read_bytes()).hexdigest()}


def test_prompts_read_a_file_source_given_as_an_s3_uri(s3_store, tmp_path):
    record, sent = upload_dataset(s3_store, write_jsonl(tmp_path / "chats.jsonl", GOOD_ROWS), "support")
    assert sent and record["uri"] == f"{s3_store.uri}/datasets/support/chats.jsonl"
    assert list_datasets(s3_store) == [record]
    prompts = load_source(PromptSource(kind="file", path=record["uri"]))
    assert [p["messages"][-1]["content"] for p in prompts] == ["What is a drafter?", "Hi"]
    cached = s3_store.fetch_object(record["key"])
    assert cached.is_relative_to(tmp_path / "cache") and cached.read_bytes() == (tmp_path / "chats.jsonl").read_bytes()
    with pytest.raises(FileNotFoundError, match="no such object"):
        s3_store.fetch_object("datasets/support/missing.jsonl")
