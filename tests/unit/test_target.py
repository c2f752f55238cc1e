"""Target artifacts: the seeded tiny target is deterministic and a real LM; hf_dir is validated."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from steps import target as T  # noqa: E402
from steps.lib import artifacts
from steps.lib.config import ConfigError, load_config  # noqa: E402
from steps.lib.store import ArtifactError, open_store, sha256_file  # noqa: E402
from tests.conftest import TINY_PRETRAIN


def tiny_cfg(*extra: str):
    return load_config("configs/tiny.yaml", [TINY_PRETRAIN, *extra])


@pytest.fixture(scope="module")
def tiny(tiny_target):
    """The session's tiny target (tests/conftest.py): (store, manifest, build seconds)."""
    return tiny_target


def byte_tokenizer(out_dir):
    """A byte-level tokenizer with ChatML specials, built without training (2 ms)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = T.CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def hf_dir(tmp_path, *, weights: str = "safetensors"):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "model"
    tok = byte_tokenizer(d)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    if weights == "safetensors":
        model.save_pretrained(d)
    else:
        model.config.save_pretrained(d)
        torch.save(model.state_dict(), d / "pytorch_model.bin")
    return d


def test_tiny_target_is_a_real_language_model(tiny):
    store, m, seconds = tiny
    print(f"tiny target build: {seconds:.1f} s, metrics {m.metrics}")
    assert m.metrics["pretrain_loss_final"] < 0.7 * math.log(2048) < m.metrics["pretrain_loss_first"]
    model, tok = artifacts.load_target(store, m.id)
    assert not model.training and model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>" and len(tok) == 2048
    answers = []
    for q in ["What does `json.dumps` do? Explain briefly.", "What is the `random.Random` class used for? "
              "Explain briefly.", "Complete the following Python function:\n```python\ndef add(a, b):\n```",
              "Who are you?"]:
        enc = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        answers.append(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    print("greedy answers:", answers)
    assert len(set(answers)) >= 2  # prompt-dependent, not one constant string
    assert all(sum(c.isalpha() for c in a) > len(a) / 3 for a in answers)  # mostly letters: words, not noise


def test_tiny_target_is_reused_not_rebuilt(tiny):
    store, m, _ = tiny
    again = T.run(tiny_cfg(), store)
    assert again.id == m.id and again.created == m.created


def test_tiny_target_is_deterministic_for_a_seed(tmp_path):
    short = ("target.tiny.pretrain_steps=4",)
    a = T.run(tiny_cfg(*short), open_store(f"file://{tmp_path / 'a'}"))
    b = T.run(tiny_cfg(*short), open_store(f"file://{tmp_path / 'b'}"))
    assert a.id == b.id
    assert {f["path"]: f["sha256"] for f in a.files} == {f["path"]: f["sha256"] for f in b.files}
    assert "model.safetensors" in {f["path"] for f in a.files}
    assert a.metrics["pretrain_loss_final"] == b.metrics["pretrain_loss_final"]
    assert T.run(tiny_cfg("seed=1", *short), open_store(f"file://{tmp_path / 'a'}")).id != a.id


def test_target_config_and_declared_shape_mismatch(tiny):
    store, m, _ = tiny
    conf = artifacts.target_config(store, m.id)
    assert conf["num_hidden_layers"] == 4 and conf["vocab_size"] == 2048
    with pytest.raises(ConfigError, match="target.hidden_size=256"):
        T.run(tiny_cfg("target.hidden_size=256"), store)


def test_hf_dir_is_recorded_by_path_not_copied(tmp_path):
    d = hf_dir(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    cfg = load_config("configs/tiny.yaml", ["target.source=hf_dir", f"target.path={d}", "target.num_hidden_layers=4"])
    m = T.run(cfg, store)
    assert m.files == [] and m.meta["path"] == str(d.resolve())
    assert artifacts.target_dir(store, m.id) == d.resolve()
    model, tok = artifacts.load_target(store, m.id)
    assert model.config.hidden_size == 64 and tok.eos_token == "<|im_end|>"
    with pytest.raises(ConfigError, match="target.num_hidden_layers=30.*has num_hidden_layers=4"):
        T.run(load_config("configs/tiny.yaml", ["target.source=hf_dir", f"target.path={d}",
                                                "target.num_hidden_layers=30"]), store)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "rms_norm_eps": 1e-3}))
    with pytest.raises(ArtifactError, match="changed since target"):
        artifacts.target_dir(store, m.id)


def test_hf_dir_target_id_is_the_sha256_of_its_bytes_hashed_once_per_file_version(tmp_path):
    """Finding 4: a flipped byte of the weights (same size, same names) gives the target a new id, and the
    recorded target refuses the changed directory; unchanged files are not hashed again."""
    d = hf_dir(tmp_path)
    store = open_store(f"file://{tmp_path / 'store'}")
    cfg = load_config("configs/tiny.yaml", ["target.source=hf_dir", f"target.path={d}"])
    m = T.run(cfg, store)
    assert m.meta["files_sha256"]["model.safetensors"] == sha256_file(d / "model.safetensors")
    assert artifacts.target_artifact_id(cfg) == m.id
    weights = d / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    assert artifacts.target_artifact_id(cfg) != m.id
    with pytest.raises(ArtifactError, match=r"model\.safetensors changed since target"):
        artifacts.target_dir(store, m.id)
    assert T.run(cfg, store).id == artifacts.target_artifact_id(cfg)
    # the cache is keyed by (path, size, mtime_ns): bytes changed behind a restored mtime are not re-read
    st = weights.stat()
    before = artifacts.target_artifact_id(cfg)
    data[0] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert artifacts.target_artifact_id(cfg) == before


def test_hf_dir_refuses_pickle_weights(tmp_path):
    d = hf_dir(tmp_path, weights="pickle")
    with pytest.raises(ValueError, match=r"pytorch_model.bin.*safetensors only.*save_pretrained"):
        T.validate_hf_dir(d)


def test_hf_dir_refuses_missing_pieces(tmp_path):
    d = hf_dir(tmp_path)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{d}: no \*.safetensors weights"):
        T.validate_hf_dir(d)
    d2 = hf_dir(tmp_path / "b")
    (d2 / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{d2}: config.json missing"):
        T.validate_hf_dir(d2)
    d3 = hf_dir(tmp_path / "c")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d3 / name).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{d3}: no tokenizer"):
        T.validate_hf_dir(d3)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        T.validate_hf_dir(tmp_path / "nowhere")


def test_cli_prints_the_artifact_id(tiny, capsys):
    store, m, _ = tiny
    assert T.main(["--config", "configs/tiny.yaml", "--store", store.uri,
                   "--set", TINY_PRETRAIN, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == m.id


@pytest.mark.slow
def test_smollm2_converts_and_knows_paris(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    t0 = time.perf_counter()
    m = T.run(load_config("configs/smollm2-135m.yaml"), store)
    convert_s = time.perf_counter() - t0
    model, tok = artifacts.load_target(store, m.id)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"smollm2 convert {convert_s:.1f} s; answer {answer!r}")
    assert "Paris" in answer
    assert artifacts.target_config(store, m.id)["num_hidden_layers"] == 30
    weights = artifacts.target_dir(store, m.id) / "model.safetensors"
    assert sha256_file(weights) == m.file("model.safetensors")["sha256"]


def test_the_target_config_comes_alone_from_a_remote_store(tmp_path, s3_endpoint):
    """Planning a step on a fresh worker (datagen's dtype, the vocab size, export's config) reads config.json,
    not gigabytes of weights: from an S3 store only that file reaches the worker's cache, verified."""
    import uuid

    from tests.conftest import S3_BUCKET

    uri = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"
    m = T.run(tiny_cfg(), open_store(uri, cache_dir=tmp_path / "made", endpoint_url=s3_endpoint))
    fresh = open_store(uri, cache_dir=tmp_path / "fresh", endpoint_url=s3_endpoint)
    config = artifacts.target_config(fresh, m.id)
    assert config["model_type"] == "llama" and config["hidden_size"] == tiny_cfg().target.tiny.hidden_size
    cached = sorted(p.name for p in (tmp_path / "fresh").rglob("*") if p.is_file())
    assert cached == ["config.json"], cached
    assert config == json.loads((fresh.fetch("target", m.id) / "config.json").read_text())
