"""What eaglenest puts on a Prefect server: work pools, the result-storage block, the deployments of
`deploy/prefect.yaml`; and what it reads back (workers, deployment names). Used by `eaglenest stack up`
(the local stack) and `eaglenest stack register` (a server someone else runs: compose, a cluster).

Every function talks to the API the current settings name (`Stack._api()` points them at the stack).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from steps.registry import STEPS

STEP_NAMES = tuple(STEPS)

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "deploy" / "prefect.yaml"
POOLS_DIR = REPO_ROOT / "deploy" / "pools"

#: pool → (worker type, pool concurrency limit). A GPU pool runs one job at a time until you raise
#: the limit to its number of GPU hosts (`prefect work-pool set-concurrency-limit gpu-docker N`).
POOLS: dict[str, tuple[str, int | None]] = {
    "local": ("process", None),
    "cpu-docker": ("docker", None),
    "gpu-docker": ("docker", 1),
    "serve-docker": ("docker", 1),
    "cpu-k8s": ("kubernetes", None),
    "gpu-k8s": ("kubernetes", 1),
    "serve-k8s": ("kubernetes", 1),
}
#: `--pools` choices: the infrastructure a pool needs → its pools. Only `local` exists by default: a
#: docker or kubernetes pool with no worker sits red on the dashboard.
INFRASTRUCTURE: dict[str, tuple[str, ...]] = {
    "local": ("local",),
    "docker": ("cpu-docker", "gpu-docker", "serve-docker"),
    "k8s": ("cpu-k8s", "gpu-k8s", "serve-k8s"),
}
#: `prefect deploy -n` names (deploy/prefect.yaml) per infrastructure: the steps' `<step>-<kind>`, the tiny
#: pipeline on it, the rollback safety net and the dataset sensor (their own workers' pool). Exact names:
#: `-n flow/name` compares `flow` with the entrypoint's *function* name in Prefect 3.9.1, and patterns
#: deploy a match once per matching entry.
DEPLOYMENT_SETS: dict[str, tuple[str, ...]] = {
    "local": (*(f"{s}-local" for s in STEP_NAMES), "tiny", "smollm2", "rollback-local", "sensor-local"),
    "docker": (*(f"{s}-docker" for s in STEP_NAMES), "tiny-docker", "rollback-docker", "sensor-docker"),
    "k8s": (*(f"{s}-k8s" for s in STEP_NAMES), "tiny-k8s"),
}
RESULTS_BLOCK = "eaglenest-results"
DEPLOY_TIMEOUT_S = 900.0


class SetupError(RuntimeError):
    """A Prefect object could not be created; the message names which and why."""


def pools_for(infrastructure: Iterable[str]) -> list[str]:
    """The pools of each named infrastructure (`local`, `docker`, `k8s`), in POOLS order."""
    wanted = {pool for kind in infrastructure for pool in INFRASTRUCTURE[kind]}
    return [name for name in POOLS if name in wanted]


#: the Secret blocks `--s3-credentials` saves, referenced (not copied) by the docker pools' `env`: the worker
#: resolves `{{ prefect.blocks.secret.<name> }}` when it starts a container, so the keys stay out of the
#: pool's job variables (which the UI shows) and out of every log.
S3_SECRET_BLOCKS = {"AWS_ACCESS_KEY_ID": "eaglenest-s3-access-key-id",
                    "AWS_SECRET_ACCESS_KEY": "eaglenest-s3-secret-access-key"}
#: plain settings the step containers need to reach the store, copied from the registering environment
S3_SETTINGS = ("EAGLENEST_STORE", "EAGLENEST_S3_ENDPOINT_URL", "AWS_DEFAULT_REGION")


@dataclass(frozen=True)
class PoolSettings:
    """Defaults written into the pools' base job templates at registration (each stays a job variable a
    deployment or a run may override): the docker network the step containers join, extra `env` for the
    docker pools, and the Kubernetes namespace of the step Jobs."""
    docker_network: str | None = None
    docker_env: dict[str, str] = field(default_factory=dict)
    k8s_namespace: str | None = None


def pool_template(name: str, settings: PoolSettings = PoolSettings(), pools_dir: Path = POOLS_DIR) -> dict[str, Any]:
    """`<pools_dir>/<name>.json` with `settings` applied to its variables' defaults."""
    template = json.loads((pools_dir / f"{name}.json").read_text())
    variables = template["variables"]["properties"]
    kind = POOLS[name][0]
    if kind == "docker" and settings.docker_network:
        variables["networks"]["default"] = [settings.docker_network]
    if kind == "docker" and settings.docker_env:
        variables["env"]["default"] = {**variables["env"].get("default", {}), **settings.docker_env}
    if kind == "kubernetes" and settings.k8s_namespace:
        variables["namespace"]["default"] = settings.k8s_namespace
    return template


def s3_container_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The docker pools' `env` that reaches the store: the plain settings of `environ` verbatim, the keys as
    references to the Secret blocks `save_s3_secrets` writes."""
    env = {k: environ[k] for k in S3_SETTINGS if environ.get(k)}
    return env | {variable: f"{{{{ prefect.blocks.secret.{block} }}}}" for variable, block in S3_SECRET_BLOCKS.items()}


def save_s3_secrets(environ: Mapping[str, str]) -> list[str]:
    """Save the S3 keys of `environ` as Secret blocks (their names); SetupError naming a missing key."""
    from prefect.blocks.system import Secret

    missing = [k for k in S3_SECRET_BLOCKS if not environ.get(k)]
    if missing:
        raise SetupError(f"--s3-credentials: {', '.join(missing)} not set in this environment (the keys the step "
                         "containers use for the store); export them, or leave the flag out")
    for variable, block in S3_SECRET_BLOCKS.items():
        Secret(value=environ[variable]).save(block, overwrite=True)
    return list(S3_SECRET_BLOCKS.values())


def create_pools(names: Iterable[str], settings: PoolSettings = PoolSettings(),
                 pools_dir: Path = POOLS_DIR) -> list[str]:
    """Create or update each pool from its base job template (`pool_template`), with its concurrency limit."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    names = list(names)
    with get_client(sync_client=True) as client:
        for name in names:
            pool_type, limit = POOLS[name]
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type,
                                                   base_job_template=pool_template(name, settings, pools_dir),
                                                   concurrency_limit=limit), overwrite=True)
    return names


def deploy(names: Iterable[str] | None, *, env: Mapping[str, str] | None = None, log: Path | None = None) -> None:
    """`prefect --no-prompt deploy -n NAME ...` (None: `--all`) of deploy/prefect.yaml from the repository
    root (so local runs get it as their working directory); raises SetupError naming the log when it fails."""
    argv = [sys.executable, "-m", "prefect", "--no-prompt", "deploy",
            "--prefect-file", str(PREFECT_FILE.relative_to(REPO_ROOT))]
    argv += ["--all"] if names is None else [a for name in names for a in ("-n", name)]
    out = open(log, "wb") if log else None
    try:
        done = subprocess.run(argv, env=dict(env) if env is not None else None, cwd=REPO_ROOT, stdout=out,
                              stderr=subprocess.STDOUT if out else None, timeout=DEPLOY_TIMEOUT_S)
    finally:
        if out:
            out.close()
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log else ""
        raise SetupError(f"`prefect deploy` of {PREFECT_FILE} exited {done.returncode}"
                         + (f"; last lines of {log}:\n{tail}" if log else ""))


def save_result_storage(store: str | None, results_dir: Path, name: str = RESULTS_BLOCK) -> str:
    """Save the result-storage block for `store` (S3Bucket for s3://, else LocalFileSystem); its slug."""
    if store and store.startswith("s3://"):
        from prefect_aws import AwsCredentials, S3Bucket
        from prefect_aws.client_parameters import AwsClientParameters

        parsed = urlparse(store)
        endpoint = os.environ.get("EAGLENEST_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
        # no keys in the block: boto3 finds them in the environment of whoever reads or writes
        credentials = AwsCredentials(region_name=os.environ.get("AWS_DEFAULT_REGION"),
                                     aws_client_parameters=AwsClientParameters(endpoint_url=endpoint))
        credentials.save(name, overwrite=True)
        folder = "/".join(p for p in (parsed.path.strip("/"), "prefect-results") if p)
        S3Bucket(bucket_name=parsed.netloc, bucket_folder=folder, credentials=credentials).save(name, overwrite=True)
        return f"s3-bucket/{name}"
    from prefect.filesystems import LocalFileSystem

    results_dir.mkdir(parents=True, exist_ok=True)
    LocalFileSystem(basepath=str(results_dir)).save(name, overwrite=True)
    return f"local-file-system/{name}"


def pool_workers(pool: str) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        workers = client.read_workers_for_work_pool(pool)
    return [{"name": w.name, "status": str(getattr(w.status, "value", w.status)),
             "last_heartbeat": str(w.last_heartbeat_time)} for w in workers]


def deployment_names() -> list[str]:
    """Every registered deployment as `flow/deployment`, sorted."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())


def point_profile(api_url: str | None) -> None:
    """Make (or stop making) the current Prefect profile's CLI talk to this stack (`prefect config set`)."""
    from prefect.settings import update_current_profile

    update_current_profile({"PREFECT_API_URL": api_url})


def profile_api_url() -> str | None:
    """The API address the Prefect CLI would use now: $PREFECT_API_URL, else the current profile's (read at
    call time: Prefect's own settings are fixed when it is first imported)."""
    from prefect.settings import PREFECT_API_URL

    return os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
