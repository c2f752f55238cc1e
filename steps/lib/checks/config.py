"""F7, the draft config schema: `draft_vocab_size` missing or null, an architecture the engine does not
serve as an EAGLE-3 draft, a tied head, and every other field an engine reads.

SGLang fails with AttributeError at startup without `draft_vocab_size` and replaces the draft's
lm_head by the target's when it is null (sglang.md §1.6); a `LlamaForCausalLM` draft is loaded as a
plain Llama. Each engine's schema as eaglenest writes it is its format's `fixed_fields` and
`required_fields` (`steps/lib/formats/<engine>.py`); `loader` marks the fields the engine's loader itself
needs, which is all doctor asks of a draft trained elsewhere.
"""

from __future__ import annotations

from typing import Any

from steps.lib.checks.finding import Finding
from steps.lib.formats import engine_format, layer_config

MISSING = object()
#: what a loader assumes for a field a foreign checkpoint leaves out (HF LlamaConfig defaults).
LOADER_DEFAULTS = {"tie_word_embeddings": False, "transformer_layer_config.tie_word_embeddings": False}
#: what fixes a directory eaglenest wrote: it is written by the export step only.
REEXPORT_FIX = "re-export the draft with `python -m steps.export` (it writes the engine config from the target)"


def get_field(cfg: dict[str, Any], dotted: str) -> Any:
    """`a.b.c` in nested dicts, or MISSING."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _draft_vocab_problem(value: Any) -> str | None:
    """The one field whose absence and whose null each fail silently in their own way."""
    if value is MISSING or value is None or not isinstance(value, int) or isinstance(value, bool):
        got = "nothing" if value is MISSING else repr(value)
        return (f"draft_vocab_size missing or null (got {got}): SGLang fails with AttributeError at startup "
                "when it is missing and replaces the draft's lm_head by the target's when it is null")
    return None


def config_problems(config: dict[str, Any], engine: str, *, loader_only: bool = False,
                    expect: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(field, what is wrong) for every F7 fault; `loader_only`: only what the engine's loader needs.

    `expect` (optional): `hidden_size` and `draft_vocab_size` of the target / trained draft, `dtype`."""
    out = []
    dv = _draft_vocab_problem(get_field(config, "draft_vocab_size"))
    if dv:
        out.append(("draft_vocab_size", dv))
    for dotted, typ in ([] if loader_only else engine_format(engine).required_fields):
        v = get_field(config, dotted)
        if dotted == "draft_vocab_size":
            continue
        if v is MISSING or v is None:
            out.append((dotted, "required field is missing or null"))
        elif not isinstance(v, typ) or isinstance(v, bool):
            out.append((dotted, f"expected {typ}, got {type(v).__name__} {v!r}"))
    for dotted, want, why, loader in engine_format(engine).fixed_fields:
        got = get_field(config, dotted)
        if loader_only and got is MISSING:
            got = LOADER_DEFAULTS.get(dotted, MISSING)
        if (loader or not loader_only) and got != want:
            out.append((dotted, f"expected {want!r}, got {'missing' if got is MISSING else repr(got)}: {why}"))
    if not loader_only:
        out += engine_format(engine).config_problems(config)
    out += _expectation_problems(config, engine, expect or {})
    return out


def _expectation_problems(config: dict[str, Any], engine: str, expect: dict[str, Any]) -> list[tuple[str, str]]:
    layer = layer_config(config, engine)
    out = []
    if "hidden_size" in expect:
        got = config.get("target_hidden_size") or layer.get("hidden_size")
        if got != expect["hidden_size"]:
            out.append(("target_hidden_size", f"expected {expect['hidden_size']} (the target's hidden_size), "
                        f"got {got!r}"))
    if "draft_vocab_size" in expect and config.get("draft_vocab_size") != expect["draft_vocab_size"]:
        out.append(("draft_vocab_size", f"expected {expect['draft_vocab_size']} (the trained draft), got "
                    f"{config.get('draft_vocab_size')!r}"))
    got_dtype = config.get("torch_dtype") or layer.get("torch_dtype")
    if "dtype" in expect and got_dtype != expect["dtype"]:
        out.append(("torch_dtype", f"expected {expect['dtype']!r}, got {got_dtype!r}"))
    return out


def config_findings(config: dict[str, Any], engine: str, where: str, *,
                    expect: dict[str, Any] | None = None) -> list[Finding]:
    """F7 for the strict checker and serve's preflight: one finding per field."""
    return [Finding("F7", "fail", f"{where}:{field}", problem, REEXPORT_FIX)
            for field, problem in config_problems(config, engine, expect=expect)]


def check_config_fields(config: dict[str, Any], engine: str, *, where: str, target_hidden_size: int | None = None,
                        fix: str = REEXPORT_FIX) -> Finding:
    """F7 on any checkpoint: what the engine's loader needs to build the right class with the right head."""
    expect = {} if target_hidden_size is None else {"hidden_size": target_hidden_size}
    problems = config_problems(config, engine, loader_only=True, expect=expect)
    if problems:
        return Finding("F7", "fail", where, "; ".join(f"{f}: {p}" for f, p in problems), fix)
    return Finding("F7", "pass", where, f"architectures={config.get('architectures')}, "
                   f"draft_vocab_size={config.get('draft_vocab_size')}")


def schema_verdict(findings: list[Finding], config: dict[str, Any], where: str) -> list[Finding]:
    """The schema findings of a config, or one F7 pass naming what was confirmed (serve's preflight prints it)."""
    return findings or [Finding("F7", "pass", where, f"{(config.get('architectures') or ['?'])[0]} config with an "
                                f"explicit draft_vocab_size={config.get('draft_vocab_size')}, as the engine needs")]


def unknown_layout(where: str, architectures: object, keys: list[str], rules: list[str]) -> Finding:
    """F7 for a directory no layout rule recognises: no engine would serve it as an EAGLE-3 draft."""
    return Finding("F7", "fail", where, f"layout not recognised: architectures={architectures!r}, keys e.g. "
                   f"{sorted(keys)[:3]}; rules: " + "; ".join(rules),
                   "export the draft as LlamaForCausalLMEagle3 (SGLang) or Eagle3Speculator (vLLM)")
