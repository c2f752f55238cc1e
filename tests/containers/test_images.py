"""The built images, run with podman and no network (`make images-test`; needs scripts/build-images.sh first):
the cpu image runs the real export step on the tiny world's artifacts with the store mounted as a volume,
the reference server in the cpu image answers /health (through the image's own HEALTHCHECK), the serve image
would exec exactly the command `eaglenest serve --print-command` prints, and the gpu image's step CLIs load.

Built on CI's stand-in base (containers/standin.Dockerfile): this proves the Dockerfiles' own steps and the
entrypoint wiring, not CUDA or SGLang (docs/CLUSTER.md says what only a GPU host proves)."""

from __future__ import annotations

import json
import shlex
import time

import pytest

from steps.lib import artifacts
from tests.containers.conftest import podman

pytestmark = pytest.mark.images
#: a reference server loads the bigram target and draft in seconds; allow for a contended 2-core machine
HEALTHY_DEADLINE_S = 300


def run(image: str, *args: str, volumes: tuple[str, ...] = (), env: dict[str, str] | None = None,
        timeout: float = 600) -> str:
    """`podman run --rm --network none` as the image's own user; returns stdout, fails with stderr."""
    flags = [f"-v={v}" for v in volumes] + [f"-e={k}={v}" for k, v in (env or {}).items()]
    result = podman("run", "--rm", "--network", "none", *flags, image, *args, timeout=timeout, check=False)
    assert result.returncode == 0, f"podman run {image} {' '.join(args)}: exit {result.returncode}\n{result.stderr}"
    return result.stdout


def world_volume(w: dict) -> str:
    return f"{w['root']}:{w['root']}"


@pytest.fixture(scope="module")
def exported_in_image(tiny_world, images):
    """The cpu image's export step on the tiny world's draft: the store is the mounted host folder."""
    w = tiny_world
    out = run(images["EAGLENEST_CPU_IMAGE"], "export", "--config", str(w["config"]), "--store", w["store_uri"],
              "--draft", w["draft_id"], "--target", w["target_id"], "--json", volumes=(world_volume(w),))
    record = json.loads(out.strip().splitlines()[-1])     # `--json`: the artifact's kind, id, URI, metrics
    assert record["kind"] == "export" and record["uri"].endswith(f"/artifacts/export/{record['id']}")
    return w | {"export_id": record["id"]}


def test_cpu_image_runs_the_export_step_on_a_mounted_store(exported_in_image):

    w = exported_in_image
    manifest = w["store"].manifest("export", w["export_id"])  # reads the manifest only; export_dir fetches verified
    assert manifest.step == "export" and manifest.inputs == {"draft": w["draft_id"], "target": w["target_id"]}
    sglang_dir = artifacts.export_dir(w["store"], w["export_id"], "sglang")
    assert json.loads((sglang_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def serve_args(w: dict) -> list[str]:

    draft = artifacts.export_dir(w["store"], w["export_id"], "sglang")
    return ["--config", str(w["config"]), "--draft", str(draft), "--target-path", str(w["target_dir"])]


def test_serve_image_would_exec_exactly_the_printed_command(exported_in_image, images):
    w, image = exported_in_image, images["EAGLENEST_SERVE_IMAGE"]
    printed = shlex.split(run(image, "serve", *serve_args(w), "--print-command", volumes=(world_volume(w),)))
    execd = run(image, "sglang", *serve_args(w), volumes=(world_volume(w),), env={"EAGLENEST_DRY_RUN": "1"})
    assert execd.splitlines() == printed
    assert printed[:3] == ["python3", "-m", "sglang.launch_server"] and "EAGLE3" in printed


def test_reference_server_in_the_cpu_image_answers_health(exported_in_image, images):
    """The printed SGLang argv, served by the reference engine (same flags), healthy via the image's HEALTHCHECK."""
    w, image = exported_in_image, images["EAGLENEST_CPU_IMAGE"]
    argv = shlex.split(run(image, "serve", *serve_args(w), "--print-command", volumes=(world_volume(w),)))
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    port = argv[argv.index("--port") + 1]
    started = podman("run", "-d", "--network", "none", f"-v={world_volume(w)}",
                     f"-e=EAGLENEST_HEALTH_URL=http://127.0.0.1:{port}/health", image,
                     "python", "-m", "steps.lib.reference.server", *argv[3:], timeout=120)
    container = started.stdout.strip()
    try:
        deadline = time.monotonic() + HEALTHY_DEADLINE_S
        while True:
            check = podman("healthcheck", "run", container, check=False, timeout=60)
            if check.returncode == 0:
                break
            state = podman("inspect", "--format", "{{.State.Status}}", container, check=False).stdout.strip()
            assert state == "running", f"reference server exited: {podman('logs', container, check=False).stderr}"
            assert time.monotonic() < deadline, f"not healthy in {HEALTHY_DEADLINE_S} s: {check.stdout}{check.stderr}"
            time.sleep(2)
        info = podman("exec", container, "python", "-c",
                      f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/server_info')"
                      ".read().decode())", timeout=120)
        server_info = json.loads(info.stdout)
        assert server_info["speculative_algorithm"] == "EAGLE3" and server_info["engine"] == "reference"
        user = podman("exec", container, "id", "-u", timeout=60).stdout.strip()
        assert user == "10001"
    finally:
        podman("rm", "-f", container, check=False, timeout=120)


def test_gpu_image_step_clis_load(images):
    """Without a GPU only the wiring is checked: the GPU steps' CLIs import and answer --help."""
    for step in ("datagen", "extract", "train", "verify"):
        assert run(images["EAGLENEST_GPU_IMAGE"], step, "--help").startswith(f"usage: eaglenest {step} ")
