"""The manifest: what an artifact holds (files with size and sha256), what made it, and its own checksum."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, dataclass, field
from typing import Any

from steps.lib.errors import ArtifactError
from steps.lib.runtime.redaction import redact
from steps.lib.store.ids import canonical_json

MANIFEST = "manifest.json"


def is_data_file(rel: str) -> bool:
    """True for an artifact's data files; false for the manifest, `.partial/` records and temp files."""
    parts = rel.split("/")
    return rel != MANIFEST and not any(part.startswith(".") for part in parts)


@dataclass
class Manifest:
    kind: str
    id: str
    step: str
    inputs: dict[str, str] = field(default_factory=dict)
    config_hash: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)
    created: str = ""
    code_version: str = ""

    def _stored(self) -> dict[str, Any]:
        """Every field as stored: URLs without credentials (steps/lib/runtime/redaction.py), whatever a step put in."""
        return redact(dict(self.__dict__))

    def checksum(self) -> str:
        """sha256 of the canonical JSON of every field as stored: what `manifest_sha256` holds."""
        return hashlib.sha256(canonical_json(self._stored()).encode()).hexdigest()

    def to_json(self) -> str:
        """The stored form, with `manifest_sha256` over the rest, so an edited manifest is caught."""
        return json.dumps({**self._stored(), "manifest_sha256": self.checksum()}, indent=2, sort_keys=True,
                          default=str)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; unknown keys are ignored (newer writers), missing required ones raise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ArtifactError(f"manifest is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ArtifactError(f"manifest must be a JSON object, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for name, f in cls.__dataclass_fields__.items():
            if name in data:
                values[name] = data[name]
            elif f.default is not MISSING:
                values[name] = f.default
            elif f.default_factory is not MISSING:
                values[name] = f.default_factory()
            else:
                raise ArtifactError(f"manifest has no {name!r} field (expected {sorted(cls.__dataclass_fields__)})")
        m = cls(**values)
        # A manifest from before manifests carried checksums is read as it is (its files are still checked
        # by size on reuse and by sha256 on read); quarantining it would recompute a store's every artifact.
        if "manifest_sha256" in data and data["manifest_sha256"] != m.checksum():
            raise ArtifactError("manifest_sha256 does not match the manifest's content (edited by hand?)")
        return m

    def file(self, path: str) -> dict[str, Any]:
        for f in self.files:
            if f["path"] == path:
                return f
        raise ArtifactError(f"artifact {self.kind}/{self.id} has no file {path!r}")

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files)
