"""Diagnose any EAGLE-3 draft directory: every catalogue row, offline, then (with a server) live.

What `eaglenest doctor` prints and the gate records when a draft gets no acceptance. The directory
may come from anywhere (eaglenest's `sglang/` or `vllm/` export, SpecForge, speculators, EAGLE's
own release): its layout is recognised by `steps/lib/layouts.py` and every row is judged by the rules of
the engine that serves that layout. Each row's rule lives in its own module of this package; this
module reads the checkpoint once and hands each rule what it needs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steps.lib import formats
from steps.lib.checks.algorithm import check_algorithm, draft_architecture
from steps.lib.checks.config import check_config_fields, unknown_layout
from steps.lib.checks.context import check_context
from steps.lib.checks.cuda_graph import check_cuda_graph, server_unreachable
from steps.lib.checks.finding import Finding
from steps.lib.checks.keys import check_keys
from steps.lib.checks.layers import check_aux_layers
from steps.lib.checks.strict import tensor_meta
from steps.lib.checks.tau import compare_tau
from steps.lib.checks.vocab import check_vocab
from steps.lib.draft_config import DraftConfig
from steps.lib.formats.sglang_loader import load_sglang_draft
from steps.lib.http import get_json, post_json
from steps.lib.layer_ids import default_aux_layer_ids, from_engine
from steps.lib.layouts import LAYOUT_ENGINE, LAYOUT_RULES, convert, detect_layout
from steps.lib.metrics import acceptance_length_from_requests

#: short held-out prompts for the live / offline τ probe (not in any training source eaglenest uses).
PROBE_PROMPTS = ("Explain why the sky is blue in two sentences.",
                 "Write a Python function that reverses a linked list.",
                 "List three differences between TCP and UDP.",
                 "What is the capital of Australia, and why is it not Sydney?")
PROBE_MAX_NEW_TOKENS = 32


# --- the checkpoint, read once ---------------------------------------------------------------------

@dataclass
class Checkpoint:
    """A draft directory as doctor sees it: its layout, whose loader serves it, config and tensor shapes."""
    path: Path
    layout: str
    engine: str                                   # whose loader rules apply
    config: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # key → (shape, dtype)
    trained_layer_ids: list[int] | None           # internal, from the export manifest when there is one

    @property
    def where(self) -> str:
        return str(self.path)

    @property
    def weights_where(self) -> str:
        return f"{self.path}/{formats.WEIGHTS_FILE}"

    def layer_config(self) -> dict[str, Any]:
        return formats.layer_config(self.config, self.engine)

    def tensor(self, canonical: str) -> torch.Tensor | None:
        """The tensor the engine's loader would load as `canonical`, or None."""
        resolve = formats.RESOLVERS[self.engine]
        key = next((k for k in self.tensors if resolve(k).canonical == canonical), None)
        if key is None:
            return None
        with safe_open(str(self.path / formats.WEIGHTS_FILE), "pt") as f:
            return f.get_tensor(key)

    def shape(self) -> DraftConfig | None:
        try:
            return formats.draft_config(self.config, self.engine)
        except (KeyError, TypeError, ValueError):
            return None          # config fields missing: F7 names them


def read_checkpoint(path: str | Path, trained_layer_ids: list[int] | None = None) -> Checkpoint:
    """config.json + tensor shapes of a draft directory, its layout and the loader rules that apply."""
    path = Path(path)
    config = formats.read_config(path)
    tensors = tensor_meta(formats.draft_file(path, formats.WEIGHTS_FILE))
    layout = detect_layout(config, list(tensors))
    return Checkpoint(path, layout, LAYOUT_ENGINE.get(layout, "sglang"), config, tensors,
                      trained_layer_ids or manifest_layer_ids(path))


def manifest_layer_ids(path: Path) -> list[int] | None:
    """The internal aux ids an eaglenest export recorded (`<export>/manifest.json` beside sglang/, vllm/)."""
    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        return None
    ids = (json.loads(manifest.read_text()).get("meta") or {}).get("internal_layer_ids")
    return [int(i) for i in ids] if isinstance(ids, list) else None


def check_layout(ck: Checkpoint) -> Finding:
    """Which layout this is (LAYOUT pass) or that none is recognised (F7: nothing can serve it as EAGLE-3)."""
    if ck.layout == "unknown":
        return unknown_layout(ck.where, draft_architecture(ck.config), list(ck.tensors), [r[2] for r in LAYOUT_RULES])
    rule = next(r[2] for r in LAYOUT_RULES if r[0] == ck.layout)
    return Finding("LAYOUT", "pass", ck.where, f"{ck.layout} layout ({rule}); served by {ck.engine}'s loader rules")


# --- the offline rows, each by its own module ---------------------------------------------------------

def convert_command(ck: Checkpoint, num_target_layers: Any) -> str:
    """`eaglenest convert` that rewrites this directory for its engine (beside it, as `<dir>-fixed`): the
    target's depth when the directory records no aux layer ids (else the server would capture its defaults)."""
    command = f"eaglenest convert {ck.path.resolve()} {ck.path.resolve()}-fixed --to {ck.engine}"
    if not formats.engine_layer_ids(ck.config, ck.engine):
        command += f" --num-target-layers {num_target_layers if isinstance(num_target_layers, int) else 'N'}"
    return command


def offline_checks(ck: Checkpoint, target: dict[str, Any] | None, context_length: int | None) -> list[Finding]:
    """F2, F3, F4, F5, F7 on the directory, against the target's config.json when there is one."""
    target = target or {}
    lc = ck.layer_config()
    target_vocab, target_hidden = target.get("vocab_size"), target.get("hidden_size")
    command = convert_command(ck, target.get("num_hidden_layers"))
    config_fix = f"`{command}` (it writes the config from the weights: draft_vocab_size = the head's rows)"
    if ck.layout == "eagle-official":
        config_fix = (f"repackage for SGLang: `{command}` (architectures LlamaForCausalLMEagle3, explicit "
                      "eagle_config ids)")
    return [
        check_keys(ck.tensors, ck.engine, ck.shape(), where=ck.weights_where, convert=command),
        check_vocab(ck.tensor("d2t"), ck.tensor("t2d"), draft_vocab=ck.config.get("draft_vocab_size"),
                    vocab=lc.get("vocab_size"), target_vocab=target_vocab if isinstance(target_vocab, int) else None,
                    where=ck.where, weights_where=ck.weights_where),
        check_aux_layers(ck.config, ck.engine, num_layers=target.get("num_hidden_layers"),
                         target_arch=draft_architecture(target), trained=ck.trained_layer_ids, where=ck.where),
        check_context(lc.get("max_position_embeddings"), context_length or target.get("max_position_embeddings"),
                      where=ck.where),
        check_config_fields(ck.config, ck.engine, where=f"{ck.where}/{formats.CONFIG_FILE}", fix=config_fix,
                            target_hidden_size=target_hidden if isinstance(target_hidden, int) else None),
    ]


# --- live rows: F1, F6, F9 --------------------------------------------------------------------------------

def probe_live(server: str, prompts: list[dict[str, Any]]) -> tuple[float | None, list[dict[str, Any]]]:
    """Live τ over finished requests (client-side, never the server's cumulative average)."""
    metas = []
    for p in prompts:
        out = post_json(f"{server}/generate", {**p, "sampling_params": {"max_new_tokens": PROBE_MAX_NEW_TOKENS,
                                                                        "temperature": 0.0, "ignore_eos": True}})
        metas.append(out.get("meta_info") or {})
    spec = [m for m in metas if int(m.get("spec_verify_ct") or 0) > 0]
    return (acceptance_length_from_requests(spec) if spec else None), metas


def served_algorithm(path: Path, info: dict[str, Any], live_tau: float | None, *, where: str = "server") -> Finding:
    """F1 on what a server reports (`/server_info`, or the facts a benchmark recorded) for the draft at `path`."""
    tau = "n/a" if live_tau is None else f"{live_tau:.2f}"
    served = info.get("speculative_draft_model_path")
    other = f"; the server serves {served}, not this directory" if served and Path(served).resolve() != \
        path.resolve() else ""
    return check_algorithm(info.get("speculative_algorithm"), eagle3=True, where=where,
                           detail=f"; live τ {tau}{other}")


def probe_prompts(target_dir: Path | None) -> tuple[list[dict[str, Any]], list[list[int]] | None]:
    """(request bodies, token ids) for the probe: token ids from the target's tokenizer when there is one."""
    tokenizer = None
    if target_dir is not None:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target_dir)
        except (OSError, ValueError):
            tokenizer = None
    if tokenizer is None:
        return [{"text": p} for p in PROBE_PROMPTS], None
    ids = [[int(i) for i in tokenizer(p)["input_ids"]] for p in PROBE_PROMPTS]
    return [{"input_ids": i} for i in ids], ids


def served_layer_ids(ck: Checkpoint, num_layers: int, target_arch: str | None = None) -> list[int]:
    """The internal ids a server captures for this layout on a `target_arch` target: the recorded ones, else
    its defaults."""
    ids = formats.engine_layer_ids(ck.config, ck.engine)
    return from_engine(ids, ck.engine, target_arch) if ids else default_aux_layer_ids(num_layers)


def offline_tau(ck: Checkpoint, target_dir: Path, prompt_ids: list[list[int]], num_steps: int
                ) -> tuple[float | None, str]:
    """τ of this draft with the reference engine, loaded with SGLang's rules, capturing the trained layers."""
    from transformers import AutoModelForCausalLM

    from steps.lib.model.checkpoint_keys import key_mapping
    from steps.lib.model.reference_engine import Engine

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, use_safetensors=True,
                                                  key_mapping=key_mapping(target_dir)).eval()
    tmp = Path(tempfile.mkdtemp(prefix="doctor-"))
    try:
        sglang_dir = ck.path if ck.layout == "sglang" else convert(
            ck.path, tmp / "sglang", "sglang", num_target_layers=target.config.num_hidden_layers)
        draft, _ = load_sglang_draft(sglang_dir, target=target)
    except (ValueError, NotImplementedError, AttributeError, KeyError) as err:
        return None, f"offline τ not measured: {err}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    layer_ids = ck.trained_layer_ids or served_layer_ids(ck, target.config.num_hidden_layers,
                                                          (target.config.architectures or [None])[0])
    engine = Engine(target, None, draft, layer_ids=layer_ids, num_steps=num_steps)
    accepted = verify = 0
    for ids in prompt_ids:
        _, stats = engine.generate(ids, PROBE_MAX_NEW_TOKENS)
        accepted, verify = accepted + stats.accepted_drafts, verify + stats.verify_steps
    return (accepted + verify) / verify if verify else None, f"layers {layer_ids}, {num_steps} steps"


def live_checks(ck: Checkpoint, server: str, target_dir: Path | None,
                serve_record: list[dict[str, Any]] | None, earlier: list[Finding]) -> list[Finding]:
    """F6 (health), F1 (algorithm + probe τ), F9 (offline vs live)."""
    server = server.rstrip("/")
    try:
        info = get_json(f"{server}/server_info", timeout_s=30)
    except (urllib.error.URLError, OSError, ValueError) as err:
        return [server_unreachable(server, err)]
    bodies, prompt_ids = probe_prompts(target_dir)
    live, _ = probe_live(server, bodies)
    findings = [served_algorithm(ck.path, info, live, where=server), check_cuda_graph(info, serve_record, where=server)]
    offline, how = None, "no --target with a tokenizer: offline τ not measured"
    if target_dir is not None and prompt_ids is not None:
        k = int(info.get("speculative_num_steps") or formats.sglang.AUTO_NUM_STEPS)
        offline, how = offline_tau(ck, target_dir, prompt_ids, k)
    findings.append(compare_tau(offline, live, earlier + findings, how))
    return findings


def diagnose(path: str | Path, *, target: str | Path | None = None, server: str | None = None,
             context_length: int | None = None, trained_layer_ids: list[int] | None = None,
             serve_record: list[dict[str, Any]] | None = None) -> list[Finding]:
    """Every check on one draft directory (and a server serving it); each Finding names its catalogue row."""
    ck = read_checkpoint(path, trained_layer_ids)
    target_dir = Path(target) if target else None
    tcfg = formats.read_json(target_dir / "config.json") if target_dir else None
    findings = [check_layout(ck)]
    if ck.layout != "unknown":
        findings += offline_checks(ck, tcfg, context_length)
    if server:
        findings += live_checks(ck, server, target_dir, serve_record, findings)
    return findings
