"""`eaglenest stack up` against a real `prefect server start` and process worker (the `prefect_stack` fixture,
which runs `eaglenest stack up` and, at the end of the session, `eaglenest stack down` and checks nothing is left).

1. up registers every local deployment, both triggers as automations, and an online worker;
2. a deployment run is picked up by the worker, completes, writes its artifact to the stack's store and
   its result to the stack's result storage;
3. up again changes nothing (same processes, one automation per trigger);
4. `eaglenest stack status --json` reads the same state from the stack's directory;
5. `eaglenest stack register --all` registers the docker and kubernetes deployments against their pool
   templates (the server validates their job variables); they render, with the real worker classes, into GPU requests;
6. for an s3:// store the result storage is a prefect-aws S3Bucket that writes into the store's bucket
   through its endpoint (the `s3_endpoint` moto server on 127.0.0.1), with no keys saved in the block.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flows.prefect_setup import save_result_storage
from steps.lib.store import open_store
from tests.conftest import S3_BUCKET, eaglenest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = ("target", "datagen", "extract", "mapping", "train", "export", "verify", "serve", "benchmark", "gate")
LOCAL = {f"{s}/{s}-local" for s in STEPS} | {"eagle3-pipeline/tiny", "eagle3-pipeline/smollm2",
                                              "eaglenest-rollback/rollback-local", "dataset-sensor/sensor-local"}
#: what `stack up` registers: one automation per trigger, each with a description (the UI's "A custom trigger"
#: otherwise)
LOCAL_AUTOMATIONS = {"eaglenest-dataset-uploaded": 1, "eaglenest-dataset-uploaded-smollm2": 1,
                     "eaglenest-rollback-on-failure": 1}
#: a target step on a 2-core machine: a Python start, the tiny tokenizer, a few pre-training steps.
RUN_TIMEOUT_S = 900


def prefect(stack, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], env=stack.env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def automations(stack) -> dict[str, int]:
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(stack.api_url) as client:
        found = client.read_automations()
    assert all(a.description for a in found), [a.name for a in found if not a.description]
    names = [a.name for a in found]
    return {name: names.count(name) for name in names}


def pools(stack) -> set[str]:
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(stack.api_url) as client:
        return {p.name for p in client.read_work_pools()}


def test_up_registers_the_local_deployments_triggers_and_an_online_worker(prefect_stack):
    report = prefect_stack.status()
    assert report["healthy"]
    assert LOCAL <= set(report["deployments"]), sorted(LOCAL - set(report["deployments"]))
    assert [w["status"] for w in report["workers"]] == ["ONLINE"]
    assert automations(prefect_stack) == LOCAL_AUTOMATIONS
    assert pools(prefect_stack) == {"local"}, "docker / k8s pools only when asked for (--pools)"


def test_a_deployment_run_is_picked_up_by_the_worker_and_persists_its_result(prefect_stack):
    results = prefect_stack.results_dir
    before = set(results.iterdir())
    out = prefect(prefect_stack, "deployment", "run", "target/target-local", "--watch",
                  "-p", "config=configs/tiny.yaml", "-p", f"store={prefect_stack.store_uri}",
                  "-p", 'overrides=["target.tiny.pretrain_steps=5"]')
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "Completed" in out.stdout
    assert open_store(prefect_stack.store_uri).list("target"), "the run wrote no target artifact to the stack's store"
    record = [p for p in set(results.iterdir()) - before]
    assert record, f"no persisted result under {results}: the worker's result storage is not in effect"


def test_up_again_keeps_the_running_processes_and_one_automation_per_trigger(prefect_stack):
    """`eaglenest stack up` on a running stack (the fixture started it with the same command)."""
    pids = (prefect_stack.status()["server_pid"], prefect_stack.status()["worker_pid"])
    up = eaglenest("stack", "up", "--dir", str(prefect_stack.dir), "--port", str(prefect_stack.port),
                   "--store", prefect_stack.store_uri, "--no-ui", "--no-schedules", "--no-profile")
    assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
    assert f"Prefect API:  {prefect_stack.api_url}" in up.stdout
    assert f"store:        {prefect_stack.store_uri}" in up.stdout
    report = prefect_stack.status()
    assert (report["server_pid"], report["worker_pid"]) == pids
    assert LOCAL <= set(report["deployments"])
    assert automations(prefect_stack) == LOCAL_AUTOMATIONS


def test_status_cli_reads_the_stack_directory(prefect_stack):
    out = subprocess.run([sys.executable, "-m", "flows.stack_cli", "status", "--dir", str(prefect_stack.dir), "--json"],
                         env=prefect_stack.env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["api_url"] == prefect_stack.api_url and report["store"] == prefect_stack.store_uri
    assert report["result_storage"] == "local-file-system/eaglenest-results"


async def _render(stack, worker_config, deployment: str):
    """The job configuration a worker would build for `deployment`, from the server's pool and deployment."""
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(stack.api_url) as client:
        dep = await client.read_deployment_by_name(deployment)
        pool = await client.read_work_pool(dep.work_pool_name)
        return await worker_config.from_template_and_values(pool.base_job_template, dep.job_variables or {},
                                                            client=client)


def test_container_deployments_register_against_their_pools_and_render_gpu_requests(prefect_stack):
    from docker.types import HostConfig
    from prefect_docker.worker import DockerWorkerJobConfiguration
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    out = subprocess.run([sys.executable, "-m", "flows.stack_cli", "register", "--all", "--dir", str(prefect_stack.dir),
                          "--store", prefect_stack.store_uri], env=prefect_stack.env, cwd=REPO,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert automations(prefect_stack) == {**LOCAL_AUTOMATIONS, "eaglenest-dataset-uploaded-docker": 1,
                                         "eaglenest-rollback-on-failure-docker": 1}
    assert pools(prefect_stack) == {"local", "cpu-docker", "gpu-docker", "serve-docker", "cpu-k8s", "gpu-k8s",
                                    "serve-k8s"}

    train = asyncio.run(_render(prefect_stack, DockerWorkerJobConfiguration, "train/train-docker"))
    assert train.image == "localhost/eaglenest-gpu:0.1.0"
    assert "/scratch/eaglenest:/scratch" in train.volumes
    host = HostConfig(version="1.44", device_requests=train.container_create_kwargs["device_requests"],
                      shm_size=train.container_create_kwargs["shm_size"])
    assert host["DeviceRequests"][0]["Capabilities"] == [["gpu"]] and host["DeviceRequests"][0]["Count"] == -1
    assert host["ShmSize"] == 16 * 1024**3

    export = asyncio.run(_render(prefect_stack, DockerWorkerJobConfiguration, "export/export-docker"))
    assert export.image == "localhost/eaglenest-cpu:0.1.0" and not export.container_create_kwargs

    serve = asyncio.run(_render(prefect_stack, KubernetesWorkerJobConfiguration, "serve/serve-k8s"))
    pod = serve.job_manifest["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["containers"][0]["image"] == "localhost/eaglenest-serve:0.1.0"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert {"name": "scratch", "mountPath": "/scratch"} in pod["containers"][0]["volumeMounts"]
    assert serve.env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "s3-bucket/eaglenest-results"


def test_an_s3_store_gets_an_s3_result_block_writing_into_its_bucket(prefect_stack, s3_endpoint, monkeypatch,
                                                                      tmp_path):
    import boto3
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_aws import S3Bucket

    # save_result_storage reads the store's endpoint from the environment, as it does in a worker or the CLI
    monkeypatch.setenv("EAGLENEST_S3_ENDPOINT_URL", s3_endpoint)
    prefix = uuid.uuid4().hex  # the store: a fresh prefix of the shared bucket
    with temporary_settings(updates={PREFECT_API_URL: prefect_stack.api_url}):
        slug = save_result_storage(f"s3://{S3_BUCKET}/{prefix}", tmp_path, name="s3-results-test")
        block = S3Bucket.load("s3-results-test")
        block.write_path("probe", b"persisted")
    assert slug == "s3-bucket/s3-results-test"
    assert block.credentials.aws_access_key_id is None and block.credentials.aws_secret_access_key is None
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    body = s3.get_object(Bucket=S3_BUCKET, Key=f"{prefix}/prefect-results/probe")["Body"].read()
    assert body == b"persisted"
