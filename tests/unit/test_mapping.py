"""The draft vocab map (F3): built one way, refused in every broken form."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from steps.lib.artifacts import load_vocab
from steps.lib.checks.vocab import validate_vocab
from steps.lib.config import parse_config
from steps.lib.store import open_store
from steps.mapping import build_vocab, count_assistant_tokens, coverage, main, run
from tests.builders import cli_record, record_of

#: artifact ids as the CLI takes them: 16 hex digits
T0, D0 = "7a7a000000000001", "da7a000000000001"


def test_build_vocab_keeps_the_most_frequent_ids_sorted_ascending_as_offsets():
    counts = Counter({7: 50, 3: 40, 9: 40, 1: 5, 0: 1, 12: 1})
    d2t, t2d = build_vocab(counts, target_vocab=16, draft_vocab=4)
    used = torch.arange(4) + d2t
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (16,)
    assert used.tolist() == [1, 3, 7, 9]                     # top 4 by count, then sorted ascending
    assert d2t.tolist() == [1, 2, 5, 6]                      # offsets, not ids
    assert t2d.nonzero().flatten().tolist() == [1, 3, 7, 9]
    validate_vocab(d2t, t2d, 16)


def test_build_vocab_breaks_ties_by_the_lower_id():
    d2t, _ = build_vocab(Counter({5: 2, 2: 2, 8: 2, 4: 1}), target_vocab=10, draft_vocab=2)
    assert (torch.arange(2) + d2t).tolist() == [2, 5]


def test_build_vocab_pads_with_the_lowest_unused_ids_when_too_few_tokens_were_seen():
    d2t, t2d = build_vocab(Counter({4: 3, 0: 1}), target_vocab=10, draft_vocab=5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 3, 4]
    d2t, t2d = build_vocab(Counter({6: 3, 1: 2}), target_vocab=10, draft_vocab=4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 6]
    validate_vocab(d2t, t2d, 10)


def test_build_vocab_accepts_a_dense_count_tensor_and_refuses_foreign_ids():
    d2t, _ = build_vocab(torch.tensor([0, 9, 0, 3, 7]), target_vocab=5, draft_vocab=2)
    assert (torch.arange(2) + d2t).tolist() == [1, 4]
    with pytest.raises(ValueError, match="outside the target vocab"):
        build_vocab(Counter({99: 1}), target_vocab=10, draft_vocab=2)


def test_coverage_is_the_fraction_of_counted_tokens_inside_the_draft_vocab():
    counts = Counter({1: 6, 2: 3, 3: 1})
    _, t2d = build_vocab(counts, target_vocab=5, draft_vocab=2)
    assert coverage(counts, t2d) == pytest.approx(0.9)


def test_count_assistant_tokens_counts_only_loss_masked_tokens():
    rows = [{"input_ids": [1, 2, 3, 3], "loss_mask": [0, 0, 1, 1]}, {"input_ids": [2, 4], "loss_mask": [1, 0]}]
    assert count_assistant_tokens(rows) == Counter({3: 2, 2: 1})
    with pytest.raises(ValueError, match="loss_mask"):
        count_assistant_tokens([{"id": "x", "input_ids": [1, 2], "loss_mask": [1]}])


@pytest.fixture
def good():
    return build_vocab(Counter({i: 100 - i for i in range(0, 40, 3)}), target_vocab=50, draft_vocab=8)


def test_validate_refuses_a_float_d2t(good):
    d2t, t2d = good
    with pytest.raises(ValueError, match="dtype torch.float32, expected int64"):
        validate_vocab(d2t.float(), t2d, 50)


def test_validate_refuses_absolute_ids_instead_of_offsets(good):
    d2t, t2d = good
    absolute = torch.arange(8) + d2t
    with pytest.raises(ValueError, match="absolute target ids|offsets"):
        validate_vocab(absolute, t2d, 50)
    big = build_vocab(Counter({i: 1 for i in range(30, 50)}), target_vocab=50, draft_vocab=20)
    with pytest.raises(ValueError, match="outside"):            # absolute ids overflow when added to i
        validate_vocab(torch.arange(20) + big[0], big[1], 50)


def test_validate_refuses_a_t2d_that_disagrees_with_d2t(good):
    d2t, t2d = good
    bad = t2d.clone()
    bad[int(bad.nonzero()[0])] = False
    bad[49] = True
    with pytest.raises(ValueError, match=r"t2d.nonzero\(\) != arange \+ d2t"):
        validate_vocab(d2t, bad, 50)


def test_validate_refuses_ids_out_of_range(good):
    d2t, t2d = good
    with pytest.raises(ValueError, match="outside"):
        validate_vocab(d2t + 40, t2d, 50)
    with pytest.raises(ValueError, match="outside"):
        validate_vocab(d2t - 5, t2d, 50)


def test_validate_refuses_an_unsorted_map_and_a_missing_one(good):
    d2t, t2d = good
    used = (torch.arange(8) + d2t).flip(0)                     # frequency order, say
    with pytest.raises(ValueError, match="strictly increasing"):
        validate_vocab(used - torch.arange(8), t2d, 50)
    with pytest.raises(ValueError, match="missing"):
        validate_vocab(None, t2d, 50)
    with pytest.raises(ValueError, match="bool"):
        validate_vocab(d2t, t2d.long(), 50)


def _config(tmp_path, draft_vocab: int):
    return parse_config({"name": "t", "store": f"file://{tmp_path}/store", "target": {"source": "tiny"},
                         "mapping": {"draft_vocab_size": draft_vocab}})


def _artifacts(store):
    t = store.begin("target", T0, step="target")
    t.path("config.json").write_text(json.dumps({"vocab_size": 64, "hidden_size": 8}))
    t.commit(meta={"source": "tiny"})
    d = store.begin("dataset", D0, step="datagen")
    rows = [{"id": "a", "input_ids": [1, 5, 5, 9, 60], "loss_mask": [0, 1, 1, 1, 0]},
            {"id": "b", "input_ids": [2, 5, 9, 33], "loss_mask": [0, 1, 0, 1]}]
    d.path("conversations/part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    d.commit()


def test_run_writes_a_validated_vocab_artifact_with_coverage(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    _artifacts(store)
    m = run(_config(tmp_path, 2), store, D0, T0)
    assert m.kind == "vocab" and m.inputs == {"dataset": D0, "target": T0}
    assert m.metrics["distinct_tokens"] == 3                   # 5, 9, 33 (prompt tokens not counted)
    assert m.metrics["coverage"] == pytest.approx(4 / 5)       # 5 x3 and 9 (tie with 33: lower id) of 5
    d2t, t2d = load_vocab(store, m.id)
    assert (torch.arange(2) + d2t).tolist() == [5, 9] and t2d.shape == (64,)
    assert run(_config(tmp_path, 2), store, D0, T0).id == m.id    # same inputs, same artifact


def test_main_builds_the_map_prints_its_record_and_names_a_missing_input(tmp_path, capsys):
    store = open_store(f"file://{tmp_path}/store")
    _artifacts(store)
    config = tmp_path / "c.yaml"
    config.write_text(_config(tmp_path, 2).model_dump_json())
    common = ("--config", str(config), "--store", store.uri)
    code, record = cli_record(capsys, main, *common, "--dataset", D0, "--target", T0)
    assert code == 0
    m = store.manifest("vocab", record["id"])
    assert record == record_of(store, m) and m.inputs == {"dataset": D0, "target": T0}
    assert record["metrics"]["coverage"] == pytest.approx(4 / 5)
    assert (torch.arange(2) + load_vocab(store, m.id)[0]).tolist() == [5, 9]
    # bad input: one line naming the missing input and where its id comes from, exit 2
    assert main([*common, "--target", T0]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing --dataset ID" in err and "eaglenest datagen" in err
    assert main([*common, "--dataset", "f" * 16, "--target", T0]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "f" * 16 in err and "--store" in err


def test_load_vocab_refuses_an_artifact_holding_absolute_ids(tmp_path):
    store = open_store(f"file://{tmp_path}/store")
    d2t, t2d = build_vocab(Counter({10: 5, 20: 4, 30: 3}), 64, 3)
    w = store.begin("vocab", "bad", step="mapping")
    save_file({"d2t": torch.arange(3) + d2t, "t2d": t2d}, str(w.path("vocab.safetensors")))
    w.commit(meta={"target_vocab": 64})
    with pytest.raises(ValueError, match="absolute"):
        load_vocab(store, "bad")
