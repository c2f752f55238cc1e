"""Reading configs: YAML file → dotted overrides (`train.lr=3e-4`, parsed as YAML) → the schema.

Errors name the file and the field. The resolved config and its hash go into every manifest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from steps.lib.config.schema import PipelineConfig
from steps.lib.errors import ConfigError


def _set_dotted(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set `a.b.c` to value; a numeric key indexes a list (`dataset.sources.0.count=20000` sets the first
    source's count, which a whole-list override would have to repeat every entry for)."""
    keys = dotted.split(".")
    node: Any = data
    for k in keys[:-1]:
        if isinstance(node, list):
            node = node[_list_index(node, k, dotted, source)]
        else:
            node = node.setdefault(k, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"{source}: override {dotted!r}: {k!r} is not a section")
    if isinstance(node, list):
        node[_list_index(node, keys[-1], dotted, source)] = value
    else:
        node[keys[-1]] = value


def _list_index(items: list, key: str, dotted: str, source: str) -> int:
    if not key.isdigit() or int(key) >= len(items):
        raise ConfigError(f"{source}: override {dotted!r}: {key!r} is not an index of a list of {len(items)} "
                          f"(0 to {len(items) - 1})")
    return int(key)


def apply_overrides(data: dict[str, Any], overrides: list[str] | None, source: str) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML) to raw config data."""
    data = json.loads(json.dumps(data))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        _set_dotted(data, key.strip(), yaml.safe_load(raw), source)
    return data


def _field_name(loc: tuple) -> str:
    """A dotted field name from pydantic's location, less the union branches it adds for a field of
    several types (`train.epochs.constrained-float` is `train.epochs`)."""
    parts = [str(p) for p in loc if isinstance(p, int) or str(p).isidentifier()]
    return ".".join(parts) or "(top level)"


def _format_validation_error(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid config"]
    by_field: dict[str, list[str]] = {}        # a union field fails once per branch: one line for them all
    for e in err.errors():
        field = _field_name(e["loc"])
        if e["type"] == "extra_forbidden":
            by_field.setdefault(field, []).append("unknown field; check the spelling against "
                                                  "steps/lib/config/schema.py")
        elif e["type"] == "missing":
            by_field.setdefault(field, []).append("required field is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # A cross-field rule's input is a whole section; echoing it buries the message.
            got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
            reasons = by_field.setdefault(field, [])
            reasons.append(msg if reasons and got and reasons[-1].endswith(got) else msg + got)
    for field, reasons in by_field.items():
        lines.append(f"  - {field}: {' or '.join(reasons)}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(source, err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read, override and validate a YAML config; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found (shipped, by name: {', '.join(shipped_configs())})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return parse_config(apply_overrides(data, overrides, str(path)), str(path))


def config_dict(section: BaseModel | dict[str, Any]) -> dict[str, Any]:
    return section.model_dump(mode="json") if isinstance(section, BaseModel) else section


def section_hash(section: BaseModel | dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a config (section)."""
    blob = json.dumps(config_dict(section), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"


def shipped_configs() -> list[str]:
    """The names of the configs in configs/ (`tiny`, `smollm2-135m`, ...)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def find_config(name_or_path: str) -> Path:
    """`tiny` → configs/tiny.yaml (the shipped ones, from any working directory); a path is returned as is,
    except a relative `configs/<name>.yaml` that is not here: the shipped one of that name."""
    p = Path(name_or_path)
    shipped = CONFIGS_DIR.parent / p
    if not p.exists() and not p.is_absolute() and p.parent == Path("configs") and shipped.is_file():
        return shipped
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return CONFIGS_DIR / f"{name_or_path}.yaml"
