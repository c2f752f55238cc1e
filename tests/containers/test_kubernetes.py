"""deploy/kubernetes/: the control plane's manifests parse, name only our images (containers/images.env) or
pinned upstream ones, run as the images' non-root user, and start one kubernetes worker per k8s pool whose
base job template (deploy/pools/<pool>.json) exists — with the GPU request on the gpu and serve pools."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.containers.conftest import REPO, read_images_env

MANIFESTS = REPO / "deploy" / "kubernetes" / "eaglenest.yaml"


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(MANIFESTS.read_text())}


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_kustomization_lists_the_manifests():
    kustomization = yaml.safe_load((MANIFESTS.parent / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [MANIFESTS.name]


def test_one_kubernetes_worker_per_k8s_pool_with_a_job_template(docs):
    pools = {}
    for key, doc in docs.items():
        if key.startswith("Deployment/worker-"):
            args = containers(doc)[0]["args"]
            assert args[args.index("--type") + 1] == "kubernetes"
            pools[key] = args[args.index("--pool") + 1]
            assert doc["spec"]["template"]["spec"]["serviceAccountName"] in {
                k.split("/")[1] for k in docs if k.startswith("ServiceAccount/")}
    assert sorted(pools.values()) == ["cpu-k8s", "gpu-k8s", "serve-k8s"]
    for pool in pools.values():
        template = json.loads((REPO / "deploy" / "pools" / f"{pool}.json").read_text())
        limits = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0][
            "resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (pool != "cpu-k8s"), pool


def test_images_are_ours_or_pinned_and_run_as_non_root(docs):
    ours = {v for k, v in read_images_env().items() if k.startswith("EAGLENEST_") and k.endswith("_IMAGE")}
    for key, doc in docs.items():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in containers(doc):
            image = container["image"]
            assert image in ours or (":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest")), (key, image)
            if image in ours:
                assert doc["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001, key


def test_the_worker_role_is_namespaced_and_covers_jobs_and_pod_logs(docs):
    rules = docs["Role/eaglenest-worker"]["rules"]
    assert any("jobs" in r["resources"] and "create" in r["verbs"] for r in rules)
    assert any("pods/log" in r["resources"] for r in rules)
    assert not any(k.startswith("ClusterRole") for k in docs)


def test_step_jobs_run_in_the_kustomized_namespace_as_their_own_account_with_s3_keys_from_a_secret(docs):
    """The k8s pools' Jobs: the namespace kustomization.yaml puts everything in (no `default`), the
    `eaglenest-job` service account (no API token), and the store's keys from the Secret `eaglenest-s3`
    through `envFrom` (never in the pool's job variables), rendered with Prefect's own template substitution
    (what the worker applies to the pool's defaults)."""
    from prefect.utilities.templating import apply_values

    from flows.prefect_setup import PoolSettings, pool_template

    namespace = yaml.safe_load((MANIFESTS.parent / "kustomization.yaml").read_text())["namespace"]
    job_account = docs["ServiceAccount/eaglenest-job"]
    assert job_account["automountServiceAccountToken"] is False
    for key, doc in docs.items():
        if key.startswith("Deployment/worker-"):
            api = {e["name"]: e.get("value") for e in containers(doc)[0]["env"]}["PREFECT_API_URL"]
            assert api == "http://prefect-server:4200/api", "a namespace in the URL would pin it"
    for pool in ("cpu-k8s", "gpu-k8s", "serve-k8s"):
        for settings, expected in ((PoolSettings(), namespace), (PoolSettings(k8s_namespace="ml-team"), "ml-team")):
            template = pool_template(pool, settings)
            defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
            manifest = apply_values(template["job_configuration"], defaults)["job_manifest"]
            assert manifest["metadata"]["namespace"] == expected, pool
            pod = manifest["spec"]["template"]["spec"]
            assert pod["serviceAccountName"] == "eaglenest-job", pool
            assert pod["containers"][0]["envFrom"] == [{"secretRef": {"name": "eaglenest-s3", "optional": True}}]
            assert "AWS_SECRET_ACCESS_KEY" not in json.dumps(template["variables"]["properties"]["env"])
