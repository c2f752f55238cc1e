"""Doctor: why does this EAGLE-3 draft get no acceptance? Every catalogue check on any checkpoint directory.

Reads: a draft directory in any known layout (eaglenest's `sglang/` or `vllm/` export, SpecForge's
SGLang export, a speculators directory, EAGLE's official release), optionally the target's HF
directory (`--target`), a running server speaking SGLang's API (`--server`) and a serve record
(`--serve-record`: the start attempts `steps.serve` writes). Writes nothing; prints one line per
check (`--json`: `{"ok", "checks": [{"id", "status", "evidence", "fix"}]}`) and exits 1 on any FAIL.

The layout comes from an explicit rules table over config.json and the weight keys (never from the
path). Each check names its failure-catalogue row:
- F2 every weight key lands in a parameter of the serving loader (SGLang's/vLLM's own rules,
  `steps.formats.*_resolve`); dropped keys and their common prefix are named; shapes match config.
- F3 `d2t` present when the draft vocab is reduced, int64, offsets (not absolute ids), in range,
  consistent with `t2d` (`steps.mapping.validate_vocab`).
- F4 which aux layers the server will capture (convention per layout, `steps.layers`), capturable
  in the target, equal to the layers the draft was trained on when the export manifest records them.
- F5 `max_position_embeddings` against the target's context. F7 `draft_vocab_size` and architecture.
- F1 / F6 with `--server`: the served algorithm, a probe's live τ, CUDA graphs, start attempts.
- F9 with `--target` and `--server`: offline τ (reference engine) vs live τ on the same prompts;
  offline good + live ≈ 1 means serving is misconfigured, not training.

    eaglenest doctor PATH [--target DIR] [--server URL] [--context-length N] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import urllib.error
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steps import formats
from steps.checks.vocab import vocab_problem
from steps.launch import get_json, post_json
from steps.layers import check_capturable, default_aux_layer_ids, from_engine
from steps.metrics import acceptance_length_from_requests
from steps.serve import NON_AUX_ALGORITHMS, PLUS_ONE_ONLY_IF_FIRST_IS_ONE, Finding

#: live τ at or below this is "no acceptance" (τ counts the bonus token: 1.0 = nothing accepted).
ZERO_ACCEPTANCE_TAU = 1.1
#: how the layout is recognised: (name, engine whose loader serves it, rule in words, predicate on
#: (config, weight keys)). First match wins; the order puts the most specific marker first.
LAYOUT_RULES: tuple[tuple[str, str, str, Any], ...] = (
    ("speculators", "vllm", "speculators_model_type == 'eagle3' (speculators Eagle3SpeculatorConfig)",
     lambda c, k: c.get("speculators_model_type") == "eagle3"),
    ("sglang", "sglang", "architectures[0] == 'LlamaForCausalLMEagle3' (eaglenest / SpecForge SGLang export)",
     lambda c, k: _arch(c) == "LlamaForCausalLMEagle3"),
    ("eagle-official", "sglang", "architectures[0] == 'LlamaForCausalLM' and a `midlayer.*` key (EAGLE release)",
     lambda c, k: _arch(c) == "LlamaForCausalLM" and any(x.startswith("midlayer.") for x in k)),
)
LAYOUT_ENGINE = {name: engine for name, engine, _, _ in LAYOUT_RULES}
#: short held-out prompts for the live / offline τ probe (not in any training source eaglenest uses).
PROBE_PROMPTS = ("Explain why the sky is blue in two sentences.",
                 "Write a Python function that reverses a linked list.",
                 "List three differences between TCP and UDP.",
                 "What is the capital of Australia, and why is it not Sydney?")
PROBE_MAX_NEW_TOKENS = 32


def _arch(config: dict[str, Any]) -> str | None:
    return (config.get("architectures") or [None])[0]


def detect_layout(config: dict[str, Any], keys: list[str]) -> str:
    """The first rule of LAYOUT_RULES that matches, or 'unknown'."""
    for name, _, _, rule in LAYOUT_RULES:
        if rule(config, keys):
            return name
    return "unknown"


# --- the checkpoint, read once ---------------------------------------------------------------------

@dataclass
class Checkpoint:
    path: Path
    layout: str
    engine: str                                   # whose loader rules apply
    config: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], str]]  # key → (shape, dtype)
    trained_layer_ids: list[int] | None           # internal, from the export manifest when there is one

    @property
    def where(self) -> str:
        return str(self.path)

    def layer_config(self) -> dict[str, Any]:
        return formats.layer_config(self.config, self.engine)

    def resolve(self, key: str) -> formats.Resolution:
        return formats.RESOLVERS[self.engine](key)

    def tensor(self, canonical: str) -> torch.Tensor | None:
        key = next((k for k in self.tensors if self.resolve(k).canonical == canonical), None)
        if key is None:
            return None
        with safe_open(str(self.path / formats.WEIGHTS_FILE), "pt") as f:
            return f.get_tensor(key)


def read_checkpoint(path: str | Path, trained_layer_ids: list[int] | None = None) -> Checkpoint:
    path = Path(path)
    for name in (formats.CONFIG_FILE, formats.WEIGHTS_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: missing; a draft directory holds config.json and "
                                    "model.safetensors")
    config = json.loads((path / formats.CONFIG_FILE).read_text())
    with safe_open(str(path / formats.WEIGHTS_FILE), "pt") as f:
        tensors = {k: (tuple(f.get_slice(k).get_shape()),
                       formats.ST_DTYPES.get(f.get_slice(k).get_dtype(), f.get_slice(k).get_dtype()))
                   for k in f.keys()}
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
    if ck.layout == "unknown":
        return Finding("F7", "fail", f"{ck.where}: layout not recognised: architectures={_arch(ck.config)!r}, "
                       f"keys e.g. {sorted(ck.tensors)[:3]}; rules: " + "; ".join(r[2] for r in LAYOUT_RULES),
                       "export the draft as LlamaForCausalLMEagle3 (SGLang) or Eagle3Speculator (vLLM)")
    rule = next(r[2] for r in LAYOUT_RULES if r[0] == ck.layout)
    return Finding("LAYOUT", "pass", f"{ck.where}: {ck.layout} layout ({rule}); served by {ck.engine}'s "
                   "loader rules")


# --- F2: keys and shapes ---------------------------------------------------------------------------

def dropped_prefix(key: str, resolve: Any) -> str | None:
    """The leading components whose removal makes the loader map `key` (`draft_model.fc.weight` → `draft_model.`)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        if resolve(".".join(parts[i:])).action != "dropped":
            return ".".join(parts[:i]) + "."
    return None


def check_keys(ck: Checkpoint) -> Finding:
    """F2: every key lands in a parameter; every required parameter is set; shapes match config."""
    dropped, loaded = [], {}
    for key in ck.tensors:
        res = ck.resolve(key)
        if res.action == "dropped":
            dropped.append(key)
        elif res.canonical:
            loaded.setdefault(res.canonical, []).append(key)
    required = [k for k in formats.CANONICAL_KEYS if k not in formats.OPTIONAL_KEYS and k != "d2t"]
    missing = [k for k in required if k not in loaded]
    problems, fixes = [], []
    if dropped:
        prefixes = sorted({p for p in (dropped_prefix(k, ck.resolve) for k in dropped) if p})
        problems.append(f"{len(dropped)} key(s) the {ck.engine} loader drops without a word: {sorted(dropped)[:4]}"
                        + (f"; they carry the prefix {prefixes} that the loader does not strip" if prefixes else ""))
        fixes.append(f"rename the keys without {prefixes} (the layer is `midlayer.*` or `layers.0.*`, "
                     "optionally `model.`-prefixed)" if prefixes else
                     "remove or rename keys that are not EAGLE-3 draft parameters (steps/formats.KEY_MAPS)")
    if missing:
        problems.append(f"never set, so the served draft keeps random weights there: {missing}")
    problems += shape_problems(ck, loaded)
    if not problems:
        return Finding("F2", "pass", f"{ck.where}: all {len(ck.tensors)} keys map to {ck.engine} parameters; "
                       "shapes match config.json")
    return Finding("F2", "fail", f"{ck.where}/{formats.WEIGHTS_FILE}: " + "; ".join(problems) + " (accept length ≈1)",
                   "; ".join(fixes) or "re-export the draft from its trained checkpoint (steps.export writes "
                   "every key, the strict checker refuses missing ones)")


def shape_problems(ck: Checkpoint, loaded: dict[str, list[str]]) -> list[str]:
    try:
        shapes = formats.expected_shapes(formats.draft_shape(ck.config, ck.engine))
    except (KeyError, TypeError, ValueError):
        return []          # config fields missing: F7 names them
    out = []
    for canonical, keys in loaded.items():
        for key in keys:
            got = ck.tensors[key][0]
            want = shapes.get(canonical)
            if want and got != want and canonical not in ("d2t", "t2d"):
                out.append(f"{key} has shape {list(got)}, config.json implies {list(want)}")
    return out


# --- F3: the vocab map --------------------------------------------------------------------------------

def check_vocab(ck: Checkpoint, target: dict[str, Any] | None) -> Finding:
    lc = ck.layer_config()
    draft_vocab, vocab = ck.config.get("draft_vocab_size"), lc.get("vocab_size")
    if target and isinstance(target.get("vocab_size"), int) and vocab != target["vocab_size"]:
        return Finding("F3", "fail", f"{ck.where}: vocab_size={vocab!r} but the target's is {target['vocab_size']}",
                       "vocab_size must be the target's vocab (embed_tokens is the target's)")
    if not isinstance(draft_vocab, int) or not isinstance(vocab, int):
        return Finding("F3", "skip", f"{ck.where}: draft_vocab_size={draft_vocab!r}, vocab_size={vocab!r} "
                       "(see F7); vocab map not checked")
    d2t, t2d = ck.tensor("d2t"), ck.tensor("t2d")
    if d2t is None:
        if draft_vocab < vocab:
            return Finding("F3", "fail", f"{ck.where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} and no "
                           "d2t: the server uses draft ids as target ids (garbage drafts, τ ≈ 1)",
                           "add d2t (int64 offsets, target_id = i + d2t[i]) from the training vocab map")
        return Finding("F3", "pass", f"{ck.where}: full-vocab draft, no d2t needed")
    problem = vocab_problem(d2t, t2d, draft_vocab, vocab)
    if problem:
        return Finding("F3", "fail", f"{ck.where}/{formats.WEIGHTS_FILE}:d2t: {problem}",
                       "store d2t as int64 offsets d2t = ids - arange(draft_vocab) with ids the sorted target "
                       "ids of the draft vocab (steps.mapping.build_vocab)")
    return Finding("F3", "pass", f"{ck.where}: d2t int64 offsets for {draft_vocab} draft ids, in [0, {vocab})"
                   + (", consistent with t2d" if t2d is not None else " (no t2d: training-only, fine)"))


# --- F4: aux layers ----------------------------------------------------------------------------------

def served_layer_ids(ck: Checkpoint, num_layers: int | None) -> tuple[list[int] | None, str]:
    """(internal ids the server captures, how they were read) for this layout."""
    ids = formats.engine_layer_ids(ck.config, ck.engine)
    if ids:
        where = "eagle_config.eagle_aux_hidden_state_layer_ids" if ck.engine == "sglang" else \
            "eagle_aux_hidden_state_layer_ids"
        return from_engine(ids, ck.engine), f"{where}={ids} ({ck.engine} convention)"
    if num_layers is None:
        return None, "no ids recorded: the server captures its defaults [2, N//2, N-3] (N unknown without --target)"
    return default_aux_layer_ids(num_layers), "no ids recorded: the server's defaults [2, N//2, N-3]"


def check_layers(ck: Checkpoint, target: dict[str, Any] | None) -> Finding:
    if ck.engine == "sglang" and not (ck.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            and "eagle_aux_hidden_state_layer_ids" in ck.config:
        return Finding("F4", "fail", f"{ck.where}: aux ids only at the top level "
                       f"({ck.config['eagle_aux_hidden_state_layer_ids']}); SGLang reads capture ids from "
                       "eagle_config only and captures its defaults",
                       "write them as eagle_config.eagle_aux_hidden_state_layer_ids (SGLang ids = internal − 1), "
                       "e.g. `eaglenest convert` of the speculators directory")
    n = target.get("num_hidden_layers") if target else None
    try:
        captured, how = served_layer_ids(ck, n)
    except ValueError as err:
        return Finding("F4", "fail", f"{ck.where}: {err}", "record explicit aux layer ids in the draft config")
    if captured is None:
        return Finding("F4", "warn", f"{ck.where}: {how}", "pass --target to check them against the target")
    evidence = f"{ck.where}: {how} → the server captures internal (HF hidden_states) {captured}"
    if n is not None:
        try:
            check_capturable(captured, int(n))
        except ValueError as err:
            return Finding("F4", "fail", f"{evidence}: {err}",
                           "train on capturable layers (internal ids 1..N−1; the last layer's output never is)")
        arch = _arch(target or {})
        if ck.engine == "sglang" and arch in PLUS_ONE_ONLY_IF_FIRST_IS_ONE and captured[0] != 2:
            return Finding("F4", "fail", f"{evidence}; but a {arch} target adds +1 only when the first id is 1",
                           "train with aux ids starting at internal 2 (the default [2, N//2, N-3])")
    trained = ck.trained_layer_ids
    if trained is not None and trained != captured:
        return Finding("F4", "fail", f"{evidence}, but the draft was trained on internal {trained} (export "
                       "manifest): acceptance quietly lower",
                       f"re-export so the config records {trained} in the {ck.engine} convention (steps.export)")
    return Finding("F4", "pass", evidence + ("" if trained is None else f" = the trained layers {trained}")
                   + ("" if n is None else f"; capturable in a {n}-layer target"))


# --- F5, F7: config fields ------------------------------------------------------------------------------

def check_context(ck: Checkpoint, target: dict[str, Any] | None, context_length: int | None) -> Finding:
    mpe = ck.layer_config().get("max_position_embeddings")
    serving = context_length or (target or {}).get("max_position_embeddings")
    if serving is None:
        return Finding("F5", "skip", f"{ck.where}: max_position_embeddings={mpe!r}; no target context to "
                       "compare (pass --target or --context-length)")
    if not isinstance(mpe, int) or mpe < int(serving):
        return Finding("F5", "fail", f"{ck.where}: max_position_embeddings={mpe!r} < target context {serving}: "
                       "SGLang refuses to start (or SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN hides it)",
                       f"set max_position_embeddings to {serving} (steps.export sets it from the target), or "
                       f"serve with --context-length {mpe}")
    return Finding("F5", "pass", f"{ck.where}: max_position_embeddings={mpe} ≥ target context {serving}")


def check_config_fields(ck: Checkpoint, target: dict[str, Any] | None) -> Finding:
    """F7: what the loader needs to build the right class with the right head."""
    problems, fix = [], "re-export with steps.export, or `eaglenest convert PATH OUT --to sglang`"
    if ck.layout == "eagle-official":
        problems.append(f"architectures={ck.config.get('architectures')!r}: SGLang loads it as a plain "
                        "LlamaForCausalLM (startup AttributeError on hot_token_id with EAGLE3)")
        fix = (f"repackage for SGLang: `eaglenest convert {ck.path} OUT --to sglang --num-target-layers N` "
               "(architectures LlamaForCausalLMEagle3, explicit eagle_config ids)")
    elif ck.layout == "sglang" and ck.config.get("model_type") != "llama":
        problems.append(f"model_type={ck.config.get('model_type')!r}, SGLang builds the config class from 'llama'")
    dv = ck.config.get("draft_vocab_size", formats.MISSING)
    if dv is formats.MISSING:
        problems.append("draft_vocab_size missing (SGLang: AttributeError at startup)")
    elif not isinstance(dv, int) or isinstance(dv, bool):
        problems.append(f"draft_vocab_size={dv!r}: null makes SGLang replace the draft's lm_head by the target's")
    lc = ck.layer_config()
    if lc.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings=true: the trained lm_head is replaced by the embedding")
    if target and isinstance(target.get("hidden_size"), int):
        th = ck.config.get("target_hidden_size") or lc.get("hidden_size")
        if th != target["hidden_size"]:
            problems.append(f"target_hidden_size={th!r} but the target's hidden_size is {target['hidden_size']}")
    if problems:
        return Finding("F7", "fail", f"{ck.where}/{formats.CONFIG_FILE}: " + "; ".join(problems), fix)
    note = "" if ck.engine == "sglang" else " (vLLM/speculators; for SGLang: `eaglenest convert PATH OUT --to sglang`)"
    return Finding("F7", "pass", f"{ck.where}: architectures={ck.config.get('architectures')}, "
                   f"draft_vocab_size={dv}{note}")


# --- live checks: F1, F6, F9 ------------------------------------------------------------------------------

def probe_live(server: str, prompts: list[dict[str, Any]]) -> tuple[float | None, list[dict[str, Any]]]:
    """Live τ over finished requests (client-side, never the server's cumulative average)."""
    metas = []
    for p in prompts:
        out = post_json(f"{server}/generate", {**p, "sampling_params": {"max_new_tokens": PROBE_MAX_NEW_TOKENS,
                                                                        "temperature": 0.0, "ignore_eos": True}})
        metas.append(out.get("meta_info") or {})
    spec = [m for m in metas if int(m.get("spec_verify_ct") or 0) > 0]
    return (acceptance_length_from_requests(spec) if spec else None), metas


def check_algorithm(ck: Checkpoint, info: dict[str, Any], live_tau: float | None) -> Finding:
    algo = str(info.get("speculative_algorithm") or "").upper()
    tau = "n/a" if live_tau is None else f"{live_tau:.2f}"
    served = info.get("speculative_draft_model_path")
    other = f"; the server serves {served}, not this directory" if served and Path(served).resolve() != \
        ck.path.resolve() else ""
    if algo in NON_AUX_ALGORITHMS:
        return Finding("F1", "fail", f"server runs --speculative-algorithm {algo} with an EAGLE-3 draft: no aux "
                       f"capture, fc skipped; live τ {tau}{other}",
                       "restart with --speculative-algorithm EAGLE3 (derive the command with steps.serve)")
    if algo != "EAGLE3":
        return Finding("F1", "fail", f"server speculative_algorithm={algo or 'none'}: the draft is not used; "
                       f"live τ {tau}{other}", "restart with --speculative-algorithm EAGLE3")
    return Finding("F1", "pass", f"server runs EAGLE3; live τ {tau}{other}")


def check_cuda_graph(info: dict[str, Any], serve_record: list[dict[str, Any]] | None) -> Finding:
    launch = str(info.get("launch_command") or "")
    disabled = bool(info.get("disable_cuda_graph")) or info.get("cuda_graph_backend_decode") == "disabled" \
        or "--disable-cuda-graph" in launch or "--cuda-graph-backend-decode disabled" in launch
    attempts = "" if not serve_record else "; start attempts: " + "; ".join(
        f"cuda_graph={a.get('cuda_graph')} → {str(a.get('outcome'))[:80]} ({a.get('seconds')} s)" for a in serve_record)
    if disabled:
        return Finding("F6", "warn", f"server healthy with CUDA graphs disabled (slower decode){attempts}",
                       "if the start with graphs hung, debug capture: --cuda-graph-max-bs-decode 1..8, "
                       "--debug-cuda-graph (sglang.md §5)")
    return Finding("F6", "pass", f"server healthy with CUDA graphs on{attempts}")


def compare_tau(offline: float | None, live: float | None, earlier: list[Finding], how: str = "") -> Finding:
    """F9: offline good + live ≈ 1 ⇒ serving is misconfigured, not training."""
    failing = sorted({f.id for f in earlier if f.status == "fail"})
    rows = (f" (failing checks: {', '.join(failing)})" if failing else "") + (f" [offline: {how}]" if how else "")
    if live is None:
        return Finding("F9", "skip", f"no live τ (no --server, or no speculative meta_info); offline τ "
                       f"{'n/a' if offline is None else f'{offline:.2f}'}")
    if live > ZERO_ACCEPTANCE_TAU and (offline is None or live >= 0.8 * offline):
        return Finding("F9", "pass", f"live τ {live:.2f}" + ("" if offline is None else f", offline τ {offline:.2f}"))
    if offline is None:
        return Finding("F9", "fail", f"live τ {live:.2f}: no acceptance{rows}; offline τ not measured",
                       "fix the failing rows above; pass --target to measure offline τ and tell serving from "
                       "training apart")
    if offline > ZERO_ACCEPTANCE_TAU and live <= ZERO_ACCEPTANCE_TAU:
        return Finding("F9", "fail", f"offline τ {offline:.2f} (reference engine, same prompts) but live τ "
                       f"{live:.2f}: serving is misconfigured, not training{rows}",
                       "fix the serving rows above (F1 flags, F2 keys, F3 d2t, F4 layers); do not retrain")
    if live <= ZERO_ACCEPTANCE_TAU:
        fix = (f"fix {', '.join(failing)} first: the offline engine loads this directory with the server's own "
               "rules, so a broken checkpoint is broken for both" if failing else
               "the checkpoint serves as written: the draft is undertrained or trained for another target; "
               "check data and training")
        return Finding("F9", "fail", f"offline τ {offline:.2f} and live τ {live:.2f}: the draft accepts nothing "
                       f"even offline{rows}", fix)
    return Finding("F9", "warn", f"live τ {live:.2f} < 0.8 × offline τ {offline:.2f}: acceptance quietly lower",
                   "check F4 (captured layers) and the serving flags")


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


def offline_tau(ck: Checkpoint, target_dir: Path, prompt_ids: list[list[int]], num_steps: int
                ) -> tuple[float | None, str]:
    """τ of this draft with the reference engine, loaded with SGLang's rules, capturing the trained layers."""
    from transformers import AutoModelForCausalLM

    from steps.engine import Engine

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, use_safetensors=True).eval()
    tmp = Path(tempfile.mkdtemp(prefix="doctor-"))
    try:
        sglang_dir = ck.path if ck.layout == "sglang" else _as_sglang(ck, tmp, target.config.num_hidden_layers)
        draft, _ = formats.load_sglang_draft(sglang_dir, target=target)
    except (ValueError, NotImplementedError, AttributeError, KeyError) as err:
        return None, f"offline τ not measured: {err}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    layer_ids = ck.trained_layer_ids or served_layer_ids(ck, target.config.num_hidden_layers)[0]
    engine = Engine(target, None, draft, layer_ids=layer_ids, num_steps=num_steps)
    accepted = verify = 0
    for ids in prompt_ids:
        _, stats = engine.generate(ids, PROBE_MAX_NEW_TOKENS)
        accepted, verify = accepted + stats.accepted_drafts, verify + stats.verify_steps
    return (accepted + verify) / verify if verify else None, f"layers {layer_ids}, {num_steps} steps"


def _as_sglang(ck: Checkpoint, tmp: Path, num_layers: int) -> Path:
    from steps.convert import convert

    return convert(ck.path, tmp / "sglang", "sglang", num_target_layers=num_layers)


def live_checks(ck: Checkpoint, server: str, target_dir: Path | None,
                serve_record: list[dict[str, Any]] | None, earlier: list[Finding]) -> list[Finding]:
    """F6 (health), F1 (algorithm + probe τ), F9 (offline vs live)."""
    server = server.rstrip("/")
    try:
        info = get_json(f"{server}/server_info", timeout_s=30)
    except (urllib.error.URLError, OSError, ValueError) as err:
        return [Finding("F6", "fail", f"{server}/server_info did not answer: {err}",
                        "start the server (steps.serve retries once without CUDA graphs) and read its log")]
    bodies, prompt_ids = probe_prompts(target_dir)
    live, _ = probe_live(server, bodies)
    findings = [check_algorithm(ck, info, live), check_cuda_graph(info, serve_record)]
    offline, how = None, "no --target with a tokenizer: offline τ not measured"
    if target_dir is not None and prompt_ids is not None:
        offline, how = offline_tau(ck, target_dir, prompt_ids, int(info.get("speculative_num_steps") or 3))
    findings.append(compare_tau(offline, live, earlier + findings, how))
    return findings


# --- run ----------------------------------------------------------------------------------------------

def run(path: str | Path, *, target: str | Path | None = None, server: str | None = None,
        context_length: int | None = None, trained_layer_ids: list[int] | None = None,
        serve_record: list[dict[str, Any]] | None = None) -> list[Finding]:
    """Every check on one draft directory; each Finding names its catalogue row."""
    ck = read_checkpoint(path, trained_layer_ids)
    target_dir = Path(target) if target else None
    tcfg = json.loads((target_dir / "config.json").read_text()) if target_dir else None
    findings = [check_layout(ck)]
    if ck.layout != "unknown":
        findings += [check_keys(ck), check_vocab(ck, tcfg), check_layers(ck, tcfg),
                     check_context(ck, tcfg, context_length), check_config_fields(ck, tcfg)]
    if server:
        findings += live_checks(ck, server, target_dir, serve_record, findings)
    return findings


def report(findings: list[Finding]) -> dict[str, Any]:
    """The --json shape: statuses upper-case, as printed."""
    return {"ok": not any(f.status == "fail" for f in findings),
            "checks": [{**asdict(f), "status": f.status.upper()} for f in findings]}


def read_serve_record(path: Path) -> list[dict[str, Any]]:
    """Start attempts: a JSON list (what `steps.serve` prints) or a manifest/dict holding `attempts`."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = data.get("attempts") or (data.get("meta") or {}).get("attempts") or []
    return list(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eaglenest doctor", description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a draft directory (any layout: SGLang, speculators, EAGLE official)")
    ap.add_argument("--target", default=None, help="the target model's HF directory (config.json, weights)")
    ap.add_argument("--server", default=None, help="base URL of a running server speaking SGLang's API")
    ap.add_argument("--context-length", type=int, default=None, help="the serving context length (F5)")
    ap.add_argument("--trained-layer-ids", default=None,
                    help="comma-separated internal aux ids the draft was trained on (F4)")
    ap.add_argument("--serve-record", default=None, help="JSON file of start attempts from steps.serve (F6)")
    ap.add_argument("--json", action="store_true", help='print {"ok", "checks": [...]} only')
    args = ap.parse_args(argv)
    trained = [int(i) for i in args.trained_layer_ids.split(",")] if args.trained_layer_ids else None
    record = read_serve_record(Path(args.serve_record)) if args.serve_record else None
    try:
        findings = run(args.path, target=args.target, server=args.server, context_length=args.context_length,
                       trained_layer_ids=trained, serve_record=record)
    except FileNotFoundError as err:
        print(f"eaglenest doctor: {err}", file=sys.stderr)
        return 2
    out = report(findings)
    print(json.dumps(out, indent=2) if args.json else "\n".join(str(f) for f in findings))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
