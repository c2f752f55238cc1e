"""steps/lib/config.py: every shipped config validates, errors name the file and the field, derived
values (aux ids, draft shape, draft context) are computed once and correctly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from steps.lib.config import (
    CONFIGS_DIR,
    ConfigError,
    PipelineConfig,
    apply_overrides,
    default_aux_layer_ids,
    find_config,
    load_config,
    parse_config,
    parse_size,
    resolve_aux_layer_ids,
    resolve_draft_shape,
    resolve_max_position_embeddings,
    section_hash,
)

SHIPPED = sorted(CONFIGS_DIR.glob("*.yaml"))

# config.json values of the real models the realistic configs describe.
LLAMA_31_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 131072}
MOE_7168 = {"num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432,
            "num_attention_heads": 64, "num_key_value_heads": 64, "vocab_size": 163840,
            "max_position_embeddings": 163840}


def write_yaml(tmp_path: Path, data: dict, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def minimal(**sections) -> dict:
    return {"name": "t", "target": {"source": "tiny"}, **sections}


# --- shipped configs ------------------------------------------------------------------------------

def test_the_realistic_configs_are_shipped():
    names = {p.stem for p in SHIPPED}
    assert {"tiny", "smollm2-135m", "llama-3.1-8b-instruct", "qwen3-8b", "moe-7168"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_config_validates(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.name == path.stem
    # a declared target depth must give capturable default aux ids
    if cfg.target.num_hidden_layers:
        ids = resolve_aux_layer_ids(cfg, cfg.target.num_hidden_layers)
        assert max(ids) <= cfg.target.num_hidden_layers - 1


@pytest.mark.parametrize("name, layers, hidden, vocab, aux", [
    ("llama-3.1-8b-instruct", 32, 4096, 128256, [2, 16, 29]),
    ("qwen3-8b", 36, 4096, 151936, [2, 18, 33]),
    ("moe-7168", 61, 7168, 163840, [2, 30, 58]),
])
def test_realistic_configs_declare_the_target_shape(name, layers, hidden, vocab, aux):
    cfg = load_config(find_config(name))
    t = cfg.target
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (layers, hidden, vocab)
    assert cfg.extract.aux_layer_ids is None  # derived, not typed
    assert resolve_aux_layer_ids(cfg, layers) == aux
    assert cfg.mapping.draft_vocab_size == 32000
    assert cfg.train.max_length <= t.context_length


def test_founding_case_config_is_tp8_fp8_sharded_within_the_disk():
    cfg = load_config(find_config("moe-7168"))
    assert cfg.target.tensor_parallel_size == 8
    assert cfg.target.quantization == "fp8"
    assert cfg.extract.backend == "sharded"           # one copy over the 8 GPUs, not two SGLang servers
    assert cfg.serve.engine == "sglang"
    # headroom on the 1.8 TB scratch disk (F8)
    assert cfg.extract.disk_budget_bytes < parse_size("1.8TB")
    assert cfg.extract.disk_budget_bytes >= parse_size("1TB")


def test_find_config_maps_names_to_shipped_files():
    assert find_config("tiny") == CONFIGS_DIR / "tiny.yaml"
    assert find_config("some/where.yaml") == Path("some/where.yaml")


# --- errors name the file and the field -------------------------------------------------------------

def test_typo_in_a_field_names_the_file_and_the_dotted_field(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(train={"lrr": 1e-3}), "typo.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value)
    assert "train.lrr" in str(e.value) and "unknown field" in str(e.value)


def test_typo_inside_a_list_item_names_its_index(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(dataset={"sources": [{"kind": "stdlib", "limt": 3}]}))
    with pytest.raises(ConfigError, match=r"dataset\.sources\.0\.limt"):
        load_config(path)


def test_wrong_type_names_the_field_and_the_value(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(train={"lr": "fast"}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "train.lr" in str(e.value) and "'fast'" in str(e.value)


def test_unknown_choice_is_refused(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(extract={"backend": "vllm"}))
    with pytest.raises(ConfigError, match=r"extract\.backend.*'vllm'"):
        load_config(path)


def test_missing_required_field_is_named(tmp_path: Path):
    path = write_yaml(tmp_path, {"name": "t"})
    with pytest.raises(ConfigError, match="target: required field is missing"):
        load_config(path)


def test_missing_file_bad_yaml_and_non_mapping_are_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(listy)


def test_cross_field_error_is_readable_not_a_dump_of_the_config(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(mapping={"draft_vocab_size": 999999},
                                        target={"source": "tiny", "vocab_size": 2048}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "mapping.draft_vocab_size=999999 exceeds target.vocab_size=2048" in msg
    assert "'name': 't'" not in msg  # the whole config is not echoed back


def test_frozen_config_cannot_be_mutated():
    cfg = load_config(find_config("tiny"))
    with pytest.raises(Exception, match="frozen"):
        cfg.train.lr = 1.0


# --- overrides --------------------------------------------------------------------------------------

def test_override_sets_a_value_and_revalidates():
    cfg = load_config(find_config("tiny"), ["train.lr=1e-4", "extract.disk_budget=1GiB"])
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.extract.disk_budget_bytes == 2**30


def test_nested_override_reaches_a_subsection():
    cfg = load_config(find_config("tiny"), ["target.tiny.hidden_size=64", "train.draft.head_dim=32"])
    assert cfg.target.tiny.hidden_size == 64
    assert cfg.train.draft.head_dim == 32


def test_override_parses_yaml_values():
    cfg = load_config(find_config("tiny"), ["extract.aux_layer_ids=[1, 3]", "export.engines=[vllm]"])
    assert cfg.extract.aux_layer_ids == [1, 3]
    assert cfg.export.engines == ["vllm"]


@pytest.mark.parametrize("override, fragment", [
    ("train.no_such_knob=1", "train.no_such_knob: unknown field"),
    ("nosection.x=1", "nosection: unknown field"),
    ("train.lr.x=1", "'lr' is not a section"),
    ("train.lr", "must look like section.field=value"),
    ("train.lr=fast", "train.lr"),
    ("dataset.sources.9.limit=5", "'9' is not an index of a list of 2 (0 to 1)"),
    ("dataset.sources.first.limit=5", "'first' is not an index"),
    ("dataset.sources.0.kind.x=1", "'kind' is not a section"),
])
def test_bad_override_is_an_error_naming_the_path(override, fragment):
    path = find_config("tiny")
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    assert fragment in str(e.value)
    assert str(path) in str(e.value)


def test_override_indexes_a_list_by_position():
    """One entry of a list changes and the others stay: a curve point can scale one dataset source."""
    base = load_config(find_config("tiny"))
    cfg = load_config(find_config("tiny"), ["dataset.sources.1.limit=7"])
    assert cfg.dataset.sources[1].limit == 7 != base.dataset.sources[1].limit
    assert [s for i, s in enumerate(cfg.dataset.sources) if i != 1] == \
        [s for i, s in enumerate(base.dataset.sources) if i != 1]


def test_override_does_not_mutate_the_file_data():
    before = find_config("tiny").read_text()
    load_config(find_config("tiny"), ["train.lr=5e-5"])
    assert find_config("tiny").read_text() == before
    assert load_config(find_config("tiny")).train.lr == pytest.approx(1e-3)


# --- derived values ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [(30, [2, 15, 27]), (32, [2, 16, 29]), (36, [2, 18, 33]),
                                         (61, [2, 30, 58])])
def test_default_aux_layer_ids_are_2_half_and_n_minus_3(n, expected):
    assert default_aux_layer_ids(n) == expected
    cfg = parse_config(minimal())
    assert resolve_aux_layer_ids(cfg, n) == expected


def test_too_shallow_target_has_no_default_aux_ids():
    with pytest.raises(ValueError, match="too shallow"):
        default_aux_layer_ids(3)


def test_configured_aux_ids_are_used_as_given():
    cfg = parse_config(minimal(extract={"aux_layer_ids": [1, 2, 3]}))
    assert resolve_aux_layer_ids(cfg, 4) == [1, 2, 3]


def test_aux_id_of_the_last_layer_output_is_refused_at_resolve():
    cfg = parse_config(minimal(extract={"aux_layer_ids": [2, 16, 32]}))
    with pytest.raises(ConfigError) as e:
        resolve_aux_layer_ids(cfg, 32)
    assert "[32]" in str(e.value) and "[1, 31]" in str(e.value)


def test_aux_id_out_of_range_is_refused_at_load_when_depth_is_declared(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(target={"source": "tiny", "num_hidden_layers": 32},
                                        extract={"aux_layer_ids": [2, 16, 32]}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "extract.aux_layer_ids" in str(e.value) and "[32]" in str(e.value)
    assert "last layer" in str(e.value)


@pytest.mark.parametrize("ids, fragment", [([3, 2], "ascending"), ([2, 2, 3], "ascending"),
                                           ([0, 2], "out of range"), ([], "captures nothing")])
def test_bad_aux_id_lists_are_refused(ids, fragment):
    cfg = parse_config(minimal(extract={"aux_layer_ids": ids}))
    with pytest.raises(ConfigError, match=fragment):
        resolve_aux_layer_ids(cfg, 32)


def test_mtbench_in_training_sources_is_refused(tmp_path: Path):
    path = write_yaml(tmp_path, minimal(dataset={"sources": [{"kind": "stdlib"}, {"kind": "mtbench"}]}))
    with pytest.raises(ConfigError, match="held-out evaluation set"):
        load_config(path)


@pytest.mark.parametrize("text, expected", [
    ("1.8TB", 1_800_000_000_000), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("500MB", 500 * 10**6),
    ("50mb", 50 * 10**6), (" 7 ", 7), (1000, 1000), (0, 0),
])
def test_sizes_parse_to_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12parsecs", "TB", "", "-5GB", -5, True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(bad)


def test_disk_budget_in_a_config_is_bytes_and_a_bad_one_names_the_field(tmp_path: Path):
    cfg = parse_config(minimal(extract={"disk_budget": "1.8TB"}, train={"cache_budget": "512MiB"}))
    assert cfg.extract.disk_budget_bytes == 1_800_000_000_000
    assert cfg.train.cache_budget == 512 * 2**20
    path = write_yaml(tmp_path, minimal(extract={"disk_budget": "lots"}))
    with pytest.raises(ConfigError, match=r"extract\.disk_budget.*'lots'"):
        load_config(path)


def test_draft_shape_defaults_to_the_target():
    cfg = parse_config(minimal())
    assert resolve_draft_shape(cfg, LLAMA_31_8B) == {
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128}


def test_draft_shape_configured_values_win_and_hidden_follows_the_target():
    cfg = load_config(find_config("moe-7168"))
    shape = resolve_draft_shape(cfg, MOE_7168)
    assert shape == {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 56,
                     "num_key_value_heads": 8, "head_dim": 128}
    assert shape["num_attention_heads"] * shape["head_dim"] == shape["hidden_size"]


def test_draft_shape_without_kv_heads_or_head_dim_in_the_target():
    cfg = parse_config(minimal())
    target = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9}
    shape = resolve_draft_shape(cfg, target)
    assert shape["num_key_value_heads"] == 9 and shape["head_dim"] == 64


def test_draft_max_position_embeddings_is_the_serving_context():
    llama = load_config(find_config("llama-3.1-8b-instruct"))
    assert resolve_max_position_embeddings(llama, {"max_position_embeddings": 2048}) == 131072
    moe = load_config(find_config("moe-7168"))
    assert resolve_max_position_embeddings(moe, MOE_7168) == 131072
    # no declared context: the target's own
    assert resolve_max_position_embeddings(parse_config(minimal()), LLAMA_31_8B) == 131072


def test_train_length_beyond_the_context_is_refused():
    with pytest.raises(ConfigError, match="train.max_length=4096 exceeds target.context_length=2048"):
        parse_config(minimal(target={"source": "tiny", "context_length": 2048}, train={"max_length": 4096}))


def test_chain_serving_needs_num_draft_tokens_equal_steps_plus_one():
    with pytest.raises(ConfigError, match=r"serve.num_steps\+1=4"):
        parse_config(minimal(serve={"num_steps": 3, "num_draft_tokens": 8}))


def test_the_chain_length_is_one_field_read_by_verify_and_serving():
    """k lives in serve.num_steps only: a config that still sets verify.num_steps is refused, naming both,
    and every shipped config measures offline τ at the k it serves (F9 compares like with like)."""
    with pytest.raises(ConfigError, match=r"verify.num_steps is gone: the chain length k is serve.num_steps"):
        parse_config(minimal(verify={"num_steps": 4}))
    for path in sorted(Path(find_config("tiny")).parent.glob("*.yaml")):
        assert "num_steps" not in yaml.safe_load(path.read_text()).get("verify", {}), path


def test_a_verify_dtype_a_server_would_ignore_is_refused():
    assert parse_config(minimal(verify={"dtype": "bfloat16"})).verify.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="verify.dtype=bfloat16 with verify.engine=server"):
        parse_config(minimal(verify={"dtype": "bfloat16", "engine": "server"}))


# --- hashes -----------------------------------------------------------------------------------------

def test_section_hash_is_stable_across_loads_and_key_order():
    a = load_config(find_config("tiny"))
    b = load_config(find_config("tiny"))
    assert section_hash(a.train) == section_hash(b.train)
    assert section_hash(a) == section_hash(b)
    assert section_hash({"x": 1, "y": 2}) == section_hash({"y": 2, "x": 1})
    assert section_hash(a.train) == section_hash(a.train.model_dump(mode="json"))
    assert len(section_hash(a)) == 64


def test_section_hash_changes_with_any_value():
    base = load_config(find_config("tiny"))
    changed = load_config(find_config("tiny"), ["train.lr=5e-4"])
    assert section_hash(base.train) != section_hash(changed.train)
    assert section_hash(base.extract) == section_hash(changed.extract)  # per section
    assert section_hash({"x": 1}) != section_hash({"x": 1.5})



def _base(ann):
    """The type under Optional[...] and Annotated[...]."""
    import types
    import typing

    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            ann = next(a for a in typing.get_args(ann) if a is not type(None))
        else:
            return ann


def _numeric_fields(model: type, prefix: str = ""):
    """(dotted name, is a list) of every int/float field of the schema, sub-sections included."""
    import typing

    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        ann = _base(info.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _numeric_fields(ann, f"{prefix}{name}.")
        elif typing.get_origin(ann) is list and _base(typing.get_args(ann)[0]) in (int, float):
            yield f"{prefix}{name}", True
        elif ann in (int, float):
            yield f"{prefix}{name}", False


NUMERIC = sorted(_numeric_fields(PipelineConfig))


def test_the_schema_has_numeric_fields_to_bound():
    assert len(NUMERIC) > 50 and ("train.epochs", False) in NUMERIC and ("benchmark.batch_sizes", True) in NUMERIC


@pytest.mark.parametrize(("name", "is_list"), [f for f in NUMERIC if f[0] != "extract.aux_layer_ids"])
def test_every_numeric_field_refuses_a_negative_number_naming_itself(name: str, is_list: bool):
    """Issue 11, finding 8: each int/float of the schema carries bounds (a huge negative is out of every
    range); the aux layer ids are checked against the target's depth instead (test_bad_aux_id_lists_are_refused)."""
    value = "[-1000000000]" if is_list else "-1000000000"
    with pytest.raises(ConfigError) as e:
        parse_config(apply_overrides(minimal(), [f"{name}={value}"], "<test>"))
    msg, where = str(e.value), f"  - {name}{'.0' if is_list else ''}: "
    assert where in msg and ("Input should be" in msg or "size" in msg), msg   # sizes: parse_size's words


def test_a_dataset_source_limit_is_bounded_too():
    with pytest.raises(ConfigError, match=r"dataset\.sources\.0\.limit: Input should be greater than or equal to 1"):
        parse_config(minimal(dataset={"sources": [{"kind": "stdlib", "limit": 0}]}))
