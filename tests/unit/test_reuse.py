"""flows/reuse.py: the call index that lets a rerun answer stored steps in the parent (no child run).
A real file store and a real (tiny) target artifact."""

from __future__ import annotations

import shutil

import pytest

from flows import reuse
from steps.lib.config import find_config, load_config
from steps.lib.store import open_store
from steps.registry import run_step

OVERRIDES = ["target.tiny.pretrain_steps=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    store_uri = f"file://{root / 'store'}"
    record = run_step("target", "configs/tiny.yaml", OVERRIDES, store_uri, {})
    cfg = load_config(find_config("configs/tiny.yaml"), OVERRIDES).model_dump(mode="json")
    return open_store(store_uri), cfg, record, root


def test_a_stored_call_is_answered_from_the_index_and_a_new_one_is_not(world):
    store, cfg, record, _ = world
    hit, key = reuse.resolve(store, "target", cfg, {}, {})
    assert hit is None and key, "nothing indexed yet: the step runs, and its record is remembered under key"
    reuse.remember(store, key, record)
    hit, again = reuse.resolve(store, "target", cfg, {}, {})
    assert again == key and hit == {**record, "seconds": 0.0, "reused": True}
    other = {**cfg, "seed": cfg["seed"] + 1}
    assert reuse.resolve(store, "target", other, {}, {})[0] is None, "another config is another call"
    assert reuse.resolve(store, "target", cfg, {}, {"x": 1})[0] is None, "other options are another call"


def test_an_index_entry_whose_artifact_is_gone_is_not_trusted(world, tmp_path):
    store, cfg, record, root = world
    fake = {**record, "id": "0123456789abcdef"}
    _, key = reuse.resolve(store, "mapping", cfg, {"dataset": "d", "target": record["id"]}, {})
    reuse.remember(store, key, fake)
    assert reuse.resolve(store, "mapping", cfg, {"dataset": "d", "target": record["id"]}, {})[0] is None


def test_serve_is_answered_only_when_its_benchmark_is_and_the_gate_never(world):
    store, cfg, record, _ = world
    inputs = {"export": "e1", "target": record["id"]}
    urls = {"spec_url": None, "baseline_url": None}
    serve_hit, serve_key = reuse.resolve(store, "serve", cfg, inputs, {})
    assert serve_hit is None and serve_key
    reuse.remember(store, serve_key, record)      # a serve record (any stored artifact will do for the index)
    assert reuse.resolve(store, "serve", cfg, inputs, {})[0] is None, "no stored measurement: serve runs"
    _, bench_key = reuse.resolve(store, "benchmark", cfg, inputs, urls)
    reuse.remember(store, bench_key, record)
    assert reuse.resolve(store, "benchmark", cfg, inputs, urls)[0]["reused"] is True
    assert reuse.resolve(store, "serve", cfg, inputs, {})[0]["reused"] is True
    # an external server may change behind its URL; a second attempt is a new measurement; a gate reads
    # production as it is now
    assert reuse.resolve(store, "benchmark", cfg, inputs, {**urls, "spec_url": "http://127.0.0.1:9"}) == (None, None)
    assert reuse.resolve(store, "benchmark", cfg, inputs, {**urls, "attempt": 2}) == (None, None)
    assert reuse.resolve(store, "gate", cfg, {**inputs, "benchmark": "b"}, {"spec_url": None}) == (None, None)


def test_datagen_is_never_answered_in_the_parent(world):
    """A CPU worker's dataset is float32 text, a GPU worker's bf16 (another id): the parent cannot tell which
    worker the call lands on, so datagen always runs its child, which plans the id where it runs."""
    store, cfg, record, _ = world
    inputs = {"target": record["id"]}
    assert reuse.resolve(store, "datagen", cfg, inputs, {}) == (None, None)
    assert reuse.resolve(store, "mapping", cfg, {**inputs, "dataset": "d"}, {})[1] is not None   # the others are


def test_removing_the_store_root_forgets_everything(world, tmp_path):
    store, cfg, record, root = world
    copy = tmp_path / "copy"
    shutil.copytree(root / "store", copy)
    other = open_store(f"file://{copy}")
    _, key = reuse.resolve(other, "target", cfg, {}, {})
    reuse.remember(other, key, record)
    assert reuse.resolve(other, "target", cfg, {}, {})[0] is not None
    shutil.rmtree(copy / "artifacts" / "target")
    assert reuse.resolve(other, "target", cfg, {}, {})[0] is None
