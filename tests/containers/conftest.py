"""Shared pieces of the container tests: the image names, a Dockerfile reader, podman.

Tests marked `images` run the built images with podman; they are collected only when
EAGLENEST_TEST_IMAGES=1 (set by `make images-test`, after `scripts/build-images.sh` built them), and
deselected otherwise — never skipped, so a machine without podman does not count them as passed.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from steps.lib import artifacts

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
DOCKERFILES = {name: CONTAINERS / f"{name}.Dockerfile" for name in ("cpu", "gpu", "serve", "standin")}
IMAGES_ENV = CONTAINERS / "images.env"
BUILD_SCRIPT = REPO / "scripts" / "build-images.sh"
RUN_IMAGES_ENV = "EAGLENEST_TEST_IMAGES"


def pytest_configure(config):
    config.addinivalue_line("markers", f"images: runs the built images with podman (only with {RUN_IMAGES_ENV}=1)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(RUN_IMAGES_ENV) == "1":
        return
    deselected = [item for item in items if item.get_closest_marker("images")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("images")]


def read_images_env() -> dict[str, str]:
    """containers/images.env as a dict (plain KEY=VALUE lines, comments skipped)."""
    values = {}
    for line in IMAGES_ENV.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str     # the rest of the (joined) line
    line: int     # 1-based line where it starts


def read_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (enough for the checks here)."""
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT/CMD; raises if it is shell form."""
    args = instruction.args
    if instruction.keyword == "HEALTHCHECK":  # HEALTHCHECK [--option=v ...] CMD [...]
        args = args.partition("CMD ")[2]
    value = json.loads(args)
    assert isinstance(value, list), f"{instruction.keyword} at line {instruction.line} is not exec form"
    return value


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """podman with build-images.sh's storage and config (root, runc, the sandbox's rlimits)."""
    return subprocess.run([str(BUILD_SCRIPT), "podman", *args], capture_output=True, text=True,
                          timeout=timeout, check=check, cwd=REPO)


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    return read_images_env()


@pytest.fixture(scope="session")
def tiny_world(tmp_path_factory) -> dict:
    """A bigram target (hf_dir artifact), a copying draft and the config that names them, in one folder.

    The folder is owned by the images' user (uid 10001) when the tests run as root, and the images mount
    it at the same path, so every path in the config and the store means the same inside and out."""
    import yaml

    from steps import target
    from steps.lib.config import load_config
    from steps.lib.store import open_store
    from tests.builders import LAYER_IDS, bigram_target_dir, copying_draft, put_draft

    root = tmp_path_factory.mktemp("world")
    tdir = bigram_target_dir(root)
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "name": "containers", "target": {"source": "hf_dir", "path": str(tdir)},
        "extract": {"aux_layer_ids": list(LAYER_IDS)}, "export": {"dtype": "float32"},
        "serve": {"engine": "reference", "port": 30111, "num_steps": 3, "num_draft_tokens": 4}}))
    store_uri = f"file://{root}/store"
    store = open_store(store_uri)
    target_id = target.run(load_config(config), store).id
    draft_id = put_draft(store, copying_draft(tdir), layer_ids=LAYER_IDS)
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "10001:10001", str(root)], check=True)
    return {"root": root, "config": config, "store_uri": store_uri, "store": store, "target_dir": tdir,
            "target_id": target_id, "draft_id": draft_id}


@pytest.fixture(scope="session")
def tiny_export(tiny_world) -> dict:
    """tiny_world's draft exported by the real export step on the host (SGLang + vLLM directories)."""
    from steps import export
    from steps.lib.config import load_config

    w = tiny_world
    export_id = export.run(load_config(w["config"]), w["store"], w["draft_id"], w["target_id"]).id
    if os.geteuid() == 0:
        subprocess.run(["chown", "-R", "10001:10001", str(w["root"])], check=True)
    return w | {"export_id": export_id, "draft_dir": artifacts.export_dir(w["store"], export_id, "sglang")}
