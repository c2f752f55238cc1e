"""F2, weight keys: the serving loader drops a key without a word and that weight stays random.

SGLang 0.5.23 renames a few substrings, accepts an optional `model.` prefix and silently drops any
other name (`draft_model.`, `transformer.`, `model.model.`); vLLM refuses unknown names. Two views of
one report: what the engine's own loader does with each key (`resolve`, doctor's view of any
checkpoint), and whether each key is exactly what eaglenest writes (`exact`, the export's strict
checker: a name the loader happens to rename today may be dropped by another version).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steps.lib.checks.finding import Finding
from steps.lib.draft_config import DraftConfig
from steps.lib.formats import (
    CANONICAL_KEYS,
    INDEX_DTYPES,
    KEY_MAPS,
    OPTIONAL_KEYS,
    RESOLVERS,
    expected_shapes,
)

#: tensors a server cannot serve without (the vocab map is F3's: its presence depends on the vocab sizes).
REQUIRED_KEYS = tuple(k for k in CANONICAL_KEYS if k not in OPTIONAL_KEYS and k not in INDEX_DTYPES)
#: what fixes a directory whose tensors are wrong: export writes every key by a table.
REEXPORT_FIX = ("re-export the draft from its trained checkpoint (steps.export writes every key, the strict "
                "checker refuses missing ones)")


@dataclass
class KeyReport:
    """Every weight key accounted for: landed (canonical → keys), unknown/dropped, missing, wrong shape or dtype."""
    loaded: dict[str, list[str]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    dtypes: list[tuple[str, str, str]] = field(default_factory=list)


def key_report(tensors: dict[str, tuple[tuple[int, ...], str]], engine: str, shape: DraftConfig | None, *,
               exact: bool, dtype: str | None = None) -> KeyReport:
    """Map every key (→ (shape, dtype)) to a canonical name by the engine's exact names (`exact`) or its loader's
    rules, then compare shapes with `shape` and float dtypes with `dtype` (index maps are F3's)."""
    to_canonical = {v: k for k, v in KEY_MAPS[engine].items()}
    shapes = expected_shapes(shape) if shape else {}
    report = KeyReport()
    for key in sorted(tensors):
        canonical = to_canonical.get(key) if exact else RESOLVERS[engine](key).canonical
        if canonical is None:
            report.unknown.append(key)
            continue
        report.loaded.setdefault(canonical, []).append(key)
        if canonical in INDEX_DTYPES:
            continue
        got_shape, got_dtype = tensors[key]
        if shapes and got_shape != shapes[canonical]:
            report.shapes.append((key, got_shape, shapes[canonical]))
        if dtype and got_dtype != dtype:
            report.dtypes.append((key, got_dtype, dtype))
    report.missing = [k for k in REQUIRED_KEYS if k not in report.loaded]
    return report


def unknown_key_message(key: str, engine: str) -> str:
    """Why a key outside the exact key set matters: the loader drops it, or only this version renames it."""
    res = RESOLVERS[engine](key)
    if res.action == "dropped":
        return (f"not a {engine} draft key; the {engine} loader "
                + ("drops it without a word and that weight stays random" if engine == "sglang"
                   else "refuses it or drops it") + f"; expected one of the {len(CANONICAL_KEYS)} keys of "
                "steps/lib/formats/ KEY_MAPS")
    return (f"{engine} would load it as {res.canonical}, but it is not the exact name eaglenest writes "
            f"({KEY_MAPS[engine].get(res.canonical or '', '?')}); other versions drop it")


def key_findings(tensors: dict[str, tuple[tuple[int, ...], str]], engine: str, shape: DraftConfig | None, *,
                 dtype: str | None, where: str) -> list[Finding]:
    """F2 for the strict checker: one finding per key that is not exactly eaglenest's, missing, or misshapen."""
    r = key_report(tensors, engine, shape, exact=True, dtype=dtype)
    out = [Finding("F2", "fail", f"{where}:{k}", unknown_key_message(k, engine), REEXPORT_FIX) for k in r.unknown]
    out += [Finding("F2", "fail", f"{where}:{k}", f"shape {list(got)}, expected {list(want)} from config.json",
                    REEXPORT_FIX) for k, got, want in r.shapes]
    out += [Finding("F2", "fail", f"{where}:{k}", f"dtype {got}, expected {want}", REEXPORT_FIX)
            for k, got, want in r.dtypes]
    out += [Finding("F2", "fail", f"{where}:{KEY_MAPS[engine][k]}", "missing: the engine keeps it uninitialised "
                    "without an error", REEXPORT_FIX) for k in r.missing]
    return out


def dropped_prefix(key: str, engine: str) -> str | None:
    """The leading components whose removal makes the loader map `key` (`draft_model.fc.weight` → `draft_model.`)."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        if RESOLVERS[engine](".".join(parts[i:])).action != "dropped":
            return ".".join(parts[:i]) + "."
    return None


def renames_for(keys: list[str], engine: str) -> list[tuple[str, str]] | None:
    """The prefix renames (OLD, NEW) that give every key one of the engine's exact names (`decoder.` →
    `midlayer.`, `draft_model.` → ``), for `eaglenest convert --rename`; None when some key has none."""
    exact = set(KEY_MAPS[engine].values())
    layer = KEY_MAPS[engine]["midlayer.self_attn.q_proj.weight"].removesuffix("self_attn.q_proj.weight")
    renames: list[tuple[str, str]] = []
    for key in keys:
        parts = key.split(".")
        found = next(((".".join(parts[:i]) + ".", new) for i in range(1, len(parts)) for new in ("", layer)
                      if new + ".".join(parts[i:]) in exact), None)
        if found is None:
            return None
        if found not in renames:
            renames.append(found)
    return renames


def check_keys(tensors: dict[str, tuple[tuple[int, ...], str]], engine: str, shape: DraftConfig | None, *,
               where: str, convert: str | None = None) -> Finding:
    """F2 on any checkpoint, by the engine's own loader rules: one finding naming every dropped or missing key.
    `convert`: the `eaglenest convert SRC DST --to ENGINE` command that rewrites this directory; the fix for
    dropped keys is then that command with the renames that map them."""
    r = key_report(tensors, engine, shape, exact=False)
    problems, fixes = [], []
    if r.unknown:
        prefixes = sorted({p for p in (dropped_prefix(k, engine) for k in r.unknown) if p})
        renames = renames_for(r.unknown, engine)
        problems.append(f"{len(r.unknown)} key(s) the {engine} loader drops without a word: {r.unknown[:4]}"
                        + (f"; they carry the prefix {prefixes} that the loader does not strip" if prefixes else ""))
        if convert and renames:
            args = " ".join(f"--rename {old}={new}" for old, new in renames)
            fixes.append(f"rename them ({', '.join(f'{o}* → {n}*' for o, n in renames)}): `{convert} {args}`")
        else:
            fixes.append(f"rename the keys without {prefixes} (the layer is `midlayer.*` or `layers.0.*`, optionally "
                         "`model.`-prefixed)" if prefixes else
                         "remove or rename keys that are not EAGLE-3 draft parameters (steps/lib/formats/ KEY_MAPS)")
    if r.missing:
        problems.append(f"never set, so the served draft keeps random weights there: {r.missing}")
    problems += [f"{k} has shape {list(got)}, config.json implies {list(want)}" for k, got, want in r.shapes]
    if not problems:
        return Finding("F2", "pass", where, f"all {len(tensors)} keys map to {engine} parameters; shapes match "
                       "config.json")
    return Finding("F2", "fail", where, "; ".join(problems) + " (accept length ≈1)", "; ".join(fixes) or REEXPORT_FIX)
