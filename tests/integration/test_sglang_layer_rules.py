"""F4 per target family, judged by SGLang's own `set_eagle3_layers_to_capture` (sglang_layer_rule_judge.py).

For every architecture with a rule in `steps/lib/layer_ids.ENGINE_FAMILY_RULES` (and Llama, the plain
offset): the ids eaglenest writes for internal ids I are the ids SGLang's model class captures as I, and
`from_engine` reads any eagle_config as that class does. Ids the family cannot express are refused, and
SGLang's code shows no config reaches them. A missing `.venv-sglang` FAILS, never skips.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from steps.lib.layer_ids import ENGINE_FAMILY_RULES, InexpressibleLayerIds, from_engine, to_engine
from tests.integration.test_sglang_loader import SGLANG_PYTHON

JUDGE = Path(__file__).with_name("sglang_layer_rule_judge.py")
N = 61                                            # the founding target's depth
INTERNAL = [[2, 30, 58], [3, 30, 58], [1, 30, 58], [5], [2], [10, 20, 30, 40], [1, 2, 3]]
#: the judge's classes (sglang_layer_rule_judge.CLASSES), named here so an entry dropped from the table fails
ARCHS = ["LlamaForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
         "Glm4MoeLiteForCausalLM", "KimiK25ForConditionalGeneration"]
#: every eagle_config a draft could hold that starts low: how the engine reads them is checked too
WRITTEN = [[0, 29, 57], [1, 29, 57], [2, 30, 58], [3, 5], [1], [0]]


@pytest.fixture(scope="module")
def judge() -> dict:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run scripts/setup-sglang-venv.sh first")
    cases = [{"arch": a, "ids": ids, "num_layers": N} for a in ARCHS for ids in WRITTEN]
    expressible = [(a, i) for a in ARCHS for i in INTERNAL if _expressible(i, a)]
    cases += [{"arch": a, "ids": to_engine(i, "sglang", a), "num_layers": N} for a, i in expressible]
    proc = subprocess.run([str(SGLANG_PYTHON), str(JUDGE)], input=json.dumps({"cases": cases}), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"version": out["version"], "cases": cases, "captured": out["captured"], "expressible": expressible}


def _expressible(ids: list[int], arch: str) -> bool:
    try:
        to_engine(ids, "sglang", arch)
    except InexpressibleLayerIds:
        return False
    return True


def test_the_judge_is_sglang_0_5_23(judge):
    assert judge["version"] == "0.5.23"


def test_from_engine_reads_every_config_as_sglangs_model_class_does(judge):
    for case, got in zip(judge["cases"], judge["captured"], strict=True):
        assert from_engine(case["ids"], "sglang", case["arch"]) == got, case


def test_what_export_writes_is_captured_as_the_trained_layers(judge):
    n = len(judge["cases"]) - len(judge["expressible"])
    for (arch, internal), got in zip(judge["expressible"], judge["captured"][n:], strict=True):
        assert got == internal, (arch, internal, to_engine(internal, "sglang", arch))


def test_refused_ids_are_the_ones_no_config_reaches(judge):
    """Internal ids starting at 1 on a DeepSeek-family target: no eagle_config in WRITTEN gets SGLang to
    capture internal 1 first, and every other internal set is expressible."""
    reached = {(c["arch"], got[0]) for c, got in zip(judge["cases"], judge["captured"], strict=True) if got}
    refused = {(a, tuple(i)) for a in ARCHS for i in INTERNAL if not _expressible(i, a)}
    assert refused == {(a, tuple(i)) for a in ARCHS for i in INTERNAL if (a, i[0]) not in reached and i[0] == 1}
    assert refused and set(ENGINE_FAMILY_RULES["sglang"]) <= set(ARCHS)
