"""deploy/compose.yaml, read as compose would: it parses, every service it names exists, every image
is either one of ours (containers/images.env) or a pinned upstream image, the pool templates and the
files it mounts exist, MinIO notifies the adapter on `datasets/`, and nothing listens beyond 127.0.0.1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.containers.conftest import REPO, read_images_env

COMPOSE = REPO / "deploy" / "compose.yaml"
#: `${NAME:-default}` / `${NAME:?message}` / `${NAME}` interpolation, as compose does it
VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution with `env` (an unset `:?` variable fails, like `docker compose config`)."""
    def value(match: re.Match) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""
    return VARIABLE.sub(value, text.replace("$$", "\0")).replace("\0", "$")


def env_example() -> dict[str, str]:
    lines = (REPO / "deploy" / "compose.env.example").read_text().splitlines()
    return {line.split("=", 1)[0]: "x" for line in lines if "=" in line and not line.startswith("#")}


@pytest.fixture(scope="module")
def compose() -> dict:
    env = read_images_env() | dict.fromkeys(env_example(), "set-in-dot-env")
    return yaml.safe_load(interpolate(COMPOSE.read_text(), env))


def test_every_required_variable_is_in_the_env_example():
    names = {m.group(1) for m in VARIABLE.finditer(COMPOSE.read_text()) if m.group(2) == "?"}
    assert names <= set(env_example()), names - set(env_example())
    with pytest.raises(KeyError, match="set .* in deploy/.env"):
        interpolate(COMPOSE.read_text(), read_images_env())


def test_the_stack_has_server_database_storage_adapter_and_one_worker_per_pool(compose):
    services = compose["services"]
    assert {"postgres", "prefect-server", "minio", "minio-init", "minio-adapter", "prefect-deploy", "worker-cpu",
            "worker-gpu", "worker-serve"} <= set(services)
    assert services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://prefect:set-in-dot-env@postgres:5432/")
    pools = {name: s["command"][s["command"].index("--pool") + 1] for name, s in services.items()
             if name.startswith("worker-")}
    assert pools == {"worker-cpu": "cpu-docker", "worker-gpu": "gpu-docker", "worker-serve": "serve-docker"}
    for name in pools:
        assert services[name]["command"][services[name]["command"].index("--type") + 1] == "docker"


def test_every_dependency_names_a_service_that_exists(compose):
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown service {dependency}"


def test_images_are_ours_or_pinned_upstream(compose):
    ours = {v for k, v in read_images_env().items() if k.startswith("EAGLENEST_") and k.endswith("_IMAGE")}
    for name, service in compose["services"].items():
        image = service["image"]
        if image.startswith("localhost/eaglenest-"):
            assert image in ours, f"{name}: {image} is not built by scripts/build-images.sh (containers/images.env)"
        else:
            registry, _, rest = image.partition("/")
            assert "." in registry and ":" in rest and not image.endswith(":latest"), f"{name}: {image} is not pinned"


def test_named_volumes_are_declared_and_bind_mounts_exist(compose):
    declared = set(compose.get("volumes", {}))
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith(("/", ".")):
                assert source.startswith("/var/run/docker.sock") or (COMPOSE.parent / source).exists(), (name, source)
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


def register_args(compose: dict):
    """The compose deploy job's `eaglenest stack register ...`, parsed by the CLI's own parser."""
    from flows.stack_cli import build_parser

    command = compose["services"]["prefect-deploy"]["command"]
    assert command[:3] == ["eaglenest", "stack", "register"], command
    return build_parser().parse_args(command[1:][1:])


def test_the_deploy_job_registers_the_docker_pools_deployments_rollback_and_sensor(compose):
    from flows.prefect_setup import DEPLOYMENT_SETS, INFRASTRUCTURE, pools_for

    args = register_args(compose)
    assert args.deployments == ["docker"] and not args.all
    assert pools_for({*args.deployments, *args.pools}) == list(INFRASTRUCTURE["docker"])
    names = {d["name"]: d for d in yaml.safe_load((REPO / "deploy" / "prefect.yaml").read_text())["deployments"]}
    registered = DEPLOYMENT_SETS["docker"]
    assert {"tiny-docker", "rollback-docker", "sensor-docker"} <= set(registered) <= set(names)
    assert names["rollback-docker"]["triggers"][0]["expect"] == ["prefect.flow-run.Failed", "prefect.flow-run.Crashed"]
    assert all(names[n]["work_pool"]["name"].endswith("-docker") for n in registered), "no worker serves `local` here"
    assert "./:/opt/eaglenest/deploy:ro" in compose["services"]["prefect-deploy"]["volumes"]


def test_step_containers_join_the_network_and_reach_the_store_without_keys_in_job_variables(compose):
    """The docker pools as the deploy job writes them: containers on the compose network, the store's
    endpoint, and the keys only as references to Secret blocks (`s3-bucket/eaglenest-results` reads them)."""
    from flows.prefect_setup import S3_SECRET_BLOCKS, PoolSettings, pool_template, s3_container_env

    args = register_args(compose)
    service_env = compose["services"]["prefect-deploy"]["environment"]
    assert args.s3_credentials and args.store == service_env["EAGLENEST_STORE"] == "s3://eaglenest"
    settings = PoolSettings(docker_network=args.docker_network,
                            docker_env=s3_container_env({**service_env, "EAGLENEST_STORE": args.store}))
    for pool in ("cpu-docker", "gpu-docker", "serve-docker"):
        variables = pool_template(pool, settings)["variables"]["properties"]
        assert variables["networks"]["default"] == [compose["networks"]["default"]["name"]], pool
        env = variables["env"]["default"]
        assert env["EAGLENEST_S3_ENDPOINT_URL"] == "http://minio:9000" and env["EAGLENEST_STORE"] == "s3://eaglenest"
        assert env["PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK"] == "s3-bucket/eaglenest-results"
        for key, block in S3_SECRET_BLOCKS.items():
            assert env[key] == f"{{{{ prefect.blocks.secret.{block} }}}}", (pool, key)
            assert service_env[key] not in str(variables), f"{pool}: the key's value is in the job variables"


def test_minio_notifies_the_adapter_on_datasets_puts(compose):
    services = compose["services"]
    minio_env = services["minio"]["environment"]
    endpoint = minio_env["MINIO_NOTIFY_WEBHOOK_ENDPOINT_EAGLENEST"]
    adapter = services["minio-adapter"]["command"]
    assert endpoint == f"http://minio-adapter:{adapter[adapter.index('--port') + 1]}/"
    assert adapter[:3] == ["python", "-m", "flows.minio_adapter"] and (REPO / "flows" / "minio_adapter.py").is_file()
    assert minio_env["MINIO_NOTIFY_WEBHOOK_AUTH_TOKEN_EAGLENEST"] == services["minio-adapter"]["environment"][
        "EAGLENEST_ADAPTER_TOKEN"]
    init = services["minio-init"]["command"][0]
    assert "mc event add --ignore-existing eaglenest/eaglenest arn:minio:sqs::EAGLENEST:webhook" in init
    assert "--event put --prefix datasets/" in init
    assert services["minio-adapter"]["environment"]["EAGLENEST_STORE"] == "s3://eaglenest"


def test_ports_are_published_on_loopback_only(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this host"


def test_the_network_name_is_fixed_for_the_step_containers(compose):
    assert compose["networks"]["default"]["name"] == "eaglenest"


def test_compose_env_example_holds_no_secret_values():
    for line in (Path(REPO) / "deploy" / "compose.env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert line.endswith("="), f"{line}: the example must not carry a value"
