"""Real step processes against a store (issue 11): concurrent writers of one id, and secrets.

Findings 1 and 2, two real step processes making the same artifact at once:
Two `python -m steps.extract` and then two `python -m steps.train` on the same inputs, started together,
on a file:// store and on the moto S3 server (`s3_endpoint`): both exit 0 with the same id, the store
holds one artifact whose every file matches its manifest's sha256, the shards are the planned ones (none
lost, none twice), nothing is left in staging, and `train_log.jsonl` holds each step once, in order.

Finding 6: a server URL's user-info and tokens reach no manifest, log line or error, and where a server
lives is not part of the hidden id.

The tiny target (a seeded 64-wide Llama) and its config are built once for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from steps import mapping, target
from steps.lib.artifacts import DRAFT_LOG_FILE
from steps.lib.config import load_config
from steps.lib.store import Store, open_store
from tests.builders import free_port, put_token_dataset, tiny_hf_config
from tests.conftest import S3_BUCKET

REPO = Path(__file__).resolve().parents[2]
VOCAB, DATASET_ID = 320, "da7a5e7000000001"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny.yaml with an hf_dir target of 64 wide and sizes that make several shards and steps."""
    return tiny_hf_config(tmp_path_factory.mktemp("concurrent"), vocab_size=VOCAB)


def _two_at_once(step: str, config: Path, store: Store, env: dict[str, str],
                 *flags: str) -> tuple[list[dict], list[str]]:
    """Start two processes of `step` together; both must exit 0; their --json records and their stderr."""
    cmd = [sys.executable, "-m", f"steps.{step}", "--config", str(config), "--store", store.uri, "--json", *flags]
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**env, "EAGLENEST_CACHE": str(store.cache_dir) + f"-{i}"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], [err for _, err in outs]


def _race(config: Path, store: Store, env: dict[str, str]) -> None:
    cfg = load_config(config)
    target_id = target.run(cfg, store).id
    put_token_dataset(store, vocab_size=VOCAB, num_rows=40, dataset_id=DATASET_ID)

    # two extractions of one hidden id
    recs, errs = _two_at_once("extract", config, store, env, "--dataset", DATASET_ID)
    hidden = recs[0]["id"]
    assert sum("extract round" in e for e in errs) == 1, errs   # one computed; the other waited and reused
    assert {r["id"] for r in recs} == {hidden} and store.list("hidden") == [hidden]
    m = store.verify("hidden", hidden)                       # every shard's sha256 matches the one manifest
    planned = [s["path"] for s in m.meta["shards"]]
    assert len(planned) >= 4 and sorted(f["path"] for f in m.files) == planned   # none lost, none twice
    assert m.meta["computed_shards"] + m.meta["resumed_shards"] == len(planned)

    # two trainings of one draft id
    vocab = mapping.run(cfg, store, DATASET_ID, target_id).id
    recs, _ = _two_at_once("train", config, store, env, "--hidden", hidden, "--vocab", vocab)
    draft = recs[0]["id"]
    assert {r["id"] for r in recs} == {draft} and store.list("draft") == [draft]
    dm = store.verify("draft", draft)
    log = [json.loads(line) for line in store.fetch_file("draft", draft, DRAFT_LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(dm.metrics["steps"]))   # each step once, in order
    assert dm.metrics["steps"] >= 8
    assert not [k for k in store.backend.list("staging/")]             # no attempt, no lease left behind


def test_two_extracts_and_two_trainings_at_once_on_a_file_store(config_path: Path, tmp_path: Path):
    store = open_store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")
    _race(config_path, store, os.environ.copy())


def test_two_extracts_and_two_trainings_at_once_on_s3(config_path: Path, tmp_path: Path, s3_endpoint: str):
    store = open_store(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}", cache_dir=tmp_path / "cache", endpoint_url=s3_endpoint)
    _race(config_path, store, {**os.environ, "EAGLENEST_S3_ENDPOINT_URL": s3_endpoint})


SECRET = "S3CRET-do-not-log"


def test_server_credentials_reach_no_manifest_log_or_error_and_no_id(config_path: Path, tmp_path: Path):
    store = open_store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")
    cfg = load_config(config_path)
    target.run(cfg, store)
    put_token_dataset(store, vocab_size=VOCAB, num_rows=12, dataset_id=DATASET_ID)
    dead = f"127.0.0.1:{free_port()}"
    urls = [f"extract.server_url=http://admin:{SECRET}@{dead}/",
            f"extract.final_server_url=http://{dead}/x?token={SECRET}&a=1"]
    env = {**os.environ, "EAGLENEST_CACHE": str(tmp_path / "cache")}

    def step(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "steps.extract", "--config", str(config_path), "--store",
                               store.uri, "--dataset", DATASET_ID, "--json", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)

    plain = step()
    assert plain.returncode == 0, plain.stderr[-3000:]
    # the URLs are recorded without credentials, and do not change the id (a moved server reuses the shards)
    with_urls = step(*[a for u in urls for a in ("--set", u)])
    assert with_urls.returncode == 0, with_urls.stderr[-3000:]
    hidden = json.loads(plain.stdout.splitlines()[-1])["id"]
    assert json.loads(with_urls.stdout.splitlines()[-1])["id"] == hidden
    # the sglang backend against the dead servers: one line naming the server, without its credentials
    failed = step("--set", "extract.backend=sglang", "--set", "extract.shard_tokens=300",
                  *[a for u in urls for a in ("--set", u)])
    assert failed.returncode == 2 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr[-3000:]
    assert dead in failed.stderr
    m = store.manifest("hidden", hidden)
    assert m.config["server_url"] is None     # the first writer's; the one with URLs reused it
    for proc in (plain, with_urls, failed):
        assert SECRET not in proc.stdout + proc.stderr
    leaks = [p for root in (tmp_path / "store", tmp_path / "cache") for p in root.rglob("*")
             if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
