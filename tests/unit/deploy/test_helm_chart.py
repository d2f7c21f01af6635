"""The Helm chart (charts/baton) lints, renders for every values file in charts/baton/ci, and every
rendered manifest validates strictly against the Kubernetes schemas; the rendered objects wire what
the services really read (every BATON_* setting, probes on real health endpoints, GPUs = TP size).

No helm binary: `helm-python-sdk` embeds Helm's engine; `kubernetes-validate` carries the schemas.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import BatonSettings
from services.gateway.settings import GatewaySettings
from tests.support.required import require_module

CHART = Path(__file__).resolve().parents[3] / "charts" / "baton"
VALUES_FILES = ["default", *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
KUBE_VERSION = "1.30.0"
# Custom resources the chart may emit (Prometheus operator, KEDA): no schema ships for them.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
# Settings the chart fills in itself from other values (service addresses, model, metrics port, the
# gateway's gRPC port, TLS files and usage spool, which need ports and volumes beside the setting).
# The cluster token comes from its own Secret (clusterAuth).
CHART_COMPUTED = {"scheduler_address", "safety_address", "model", "served_model_name", "billing_metrics_port",
                  "grpc_port", "grpc_tls_cert", "grpc_tls_key", "usage_spool_dir", "cluster_token"}

Manifest = dict[str, Any]


def _values(name: str) -> dict[str, Any]:
    return {} if name == "default" else yaml.safe_load((CHART / "ci" / name).read_text())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    helm = require_module("helm_python")
    out: dict[str, list[Manifest]] = {}
    for name in VALUES_FILES:
        chart = helm.Chart.load(str(CHART))
        files = chart.render(_values(name), name="baton", namespace="llm")
        out[name] = [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
                     for doc in yaml.safe_load_all(text) if doc]
    return out


def _find(docs: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def _container(deployment: Manifest) -> Manifest:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_chart_lints_strictly(values_file: str) -> None:
    helm = require_module("helm_python")
    report = helm.lint(str(CHART), _values(values_file), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == []


@pytest.mark.parametrize("values_file", VALUES_FILES)
def test_rendered_manifests_validate_strictly(rendered: dict[str, list[Manifest]], values_file: str) -> None:
    kv = require_module("kubernetes_validate")
    for doc in rendered[values_file]:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] and doc["metadata"]["name"] and doc["spec"]
            continue
        try:
            kv.validate(doc, KUBE_VERSION, strict=True)
        except kv.ValidationError as e:  # its str() dumps the whole schema: name the field instead
            where = "/".join(str(p) for p in e.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {where}", pytrace=False)


def test_every_platform_setting_is_wired(rendered: dict[str, list[Manifest]]) -> None:
    """Each BatonSettings / GatewaySettings field is a chart value (ConfigMap or Secret) or computed."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    offered = set(values["settings"]) | (set(values["secrets"]) - {"existingSecret"}) | CHART_COMPUTED
    fields = set(BatonSettings.model_fields) | set(GatewaySettings.model_fields)
    assert fields - offered == set()
    assert offered - fields == set()  # nothing the code does not read


def test_configmap_passes_structured_settings_as_json(rendered: dict[str, list[Manifest]]) -> None:
    data = _find(rendered["xpyd-tp-values.yaml"], "ConfigMap", "baton-settings")["data"]
    assert data["BATON_SCHEDULER_ADDRESS"] == "baton-scheduler:50070"
    assert data["BATON_SAFETY_ADDRESS"] == "baton-safety:50071"
    assert data["BATON_MODEL"] == "/models/Llama-3.3-70B-Instruct"
    slos = GatewaySettings.model_validate({"slos": yaml.safe_load(data["BATON_SLOS"])}).slos
    assert slos["enterprise"].ttft_ms == 1000
    assert "BATON_PRICING" not in data  # null: the code's default applies


def test_external_endpoints_come_from_the_secret(rendered: dict[str, list[Manifest]]) -> None:
    secret = _find(rendered["one-gpu-values.yaml"], "Secret", "baton-secrets")["stringData"]
    assert secret == {"BATON_DATABASE_URL": "postgresql://baton:baton@postgres:5432/baton",
                      "BATON_REDIS_URL": "redis://redis:6379/0", "BATON_KAFKA_BOOTSTRAP": "kafka:9092"}
    docs = rendered["external-values.yaml"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    env_from = _container(_find(docs, "Deployment", "baton-gateway"))["envFrom"]
    assert {"secretRef": {"name": "baton-external"}} in env_from


def test_fleets_take_one_gpu_per_tensor_parallel_rank(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["xpyd-tp-values.yaml"]
    for fleet, tp, replicas in (("prefill", 2, None), ("decode", 4, None)):
        deployment = _find(docs, "Deployment", f"baton-worker-{fleet}")
        container = _container(deployment)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert f"--tensor-parallel-size={tp}" in container["args"]
        assert f"--role={fleet}" in container["args"]
        assert deployment["spec"].get("replicas") == replicas  # KEDA owns the replica count
        assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert _find(docs, "Service", f"baton-worker-{fleet}")["spec"]["clusterIP"] == "None"
        _find(docs, "ScaledObject", f"baton-worker-{fleet}")
        _find(docs, "PodDisruptionBudget", f"baton-worker-{fleet}")


def test_cpu_values_run_one_colocated_worker_without_gpus(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["cpu-values.yaml"]
    workers = [d for d in docs if d["kind"] == "Deployment" and "worker" in d["metadata"]["name"]]
    assert [w["metadata"]["name"] for w in workers] == ["baton-worker-both"]
    container = _container(workers[0])
    assert "--device=cpu" in container["args"] and "--role=both" in container["args"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_probes_use_each_services_health_endpoint(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["default"]
    gateway = _container(_find(docs, "Deployment", "baton-gateway"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for name, port, service in (("baton-scheduler", 50070, "baton.v1.Scheduler"),
                                ("baton-safety", 50071, "baton.v1.Safety"),
                                ("baton-worker-decode", 50060, "baton.v1.Worker")):
        probe = _container(_find(docs, "Deployment", name))["readinessProbe"]["grpc"]
        assert probe == {"port": port, "service": service}


def test_workers_advertise_their_pod_ip_to_the_scheduler(rendered: dict[str, list[Manifest]]) -> None:
    container = _container(_find(rendered["default"], "Deployment", "baton-worker-prefill"))
    assert "--advertise-address=$(POD_IP):50060" in container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["BATON_WORKER_SCHEDULER"] == "baton-scheduler:50070"
    assert env["BATON_WORKER_METRICS_PORT"] == "9090"


def test_observability_objects_are_optional(rendered: dict[str, list[Manifest]]) -> None:
    kinds = {d["kind"] for d in rendered["default"]}
    assert kinds.isdisjoint(CRD_KINDS)
    docs = rendered["xpyd-tp-values.yaml"]
    rules = _find(docs, "PrometheusRule", "baton")["spec"]["groups"][0]["rules"]
    assert {"BatonNoDecodeWorkers", "BatonKVCacheFull", "BatonBillingStalled"} <= {r["alert"] for r in rules}
    dashboard = _find(docs, "ConfigMap", "baton-dashboard")
    assert yaml.safe_load(dashboard["data"]["baton.json"])["uid"] == "baton-overview"


def _gateway(docs: list[Manifest]) -> tuple[Manifest, Manifest, dict[str, str]]:
    """The gateway's container, pod spec and the settings ConfigMap's data."""
    deployment = _find(docs, "Deployment", "baton-gateway")
    return _container(deployment), deployment["spec"]["template"]["spec"], \
        _find(docs, "ConfigMap", "baton-settings")["data"]


def _ports(spec: Manifest) -> dict[str, int]:
    return {p["name"]: p.get("containerPort", p.get("port")) for p in spec["ports"]}


def test_gateway_serves_grpc_and_spools_usage_on_an_empty_dir_by_default(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["default"]
    container, pod, data = _gateway(docs)
    assert _ports(container)["grpc"] == 8001 and data["BATON_GRPC_PORT"] == "8001"
    assert _ports(_find(docs, "Service", "baton-gateway")["spec"])["grpc"] == 8001
    assert "BATON_GRPC_TLS_CERT" not in data and "BATON_GRPC_TLS_KEY" not in data
    assert data["BATON_USAGE_SPOOL_DIR"] == "/var/lib/baton/usage-spool"
    assert {"name": "usage-spool", "mountPath": "/var/lib/baton/usage-spool"} in container["volumeMounts"]
    assert {"name": "usage-spool", "emptyDir": {}} in pod["volumes"]


def test_gateway_grpc_tls_and_a_persistent_spool_come_from_values(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["xpyd-tp-values.yaml"]
    container, pod, data = _gateway(docs)
    assert _ports(container)["grpc"] == 9443 and data["BATON_GRPC_PORT"] == "9443"
    assert _ports(_find(docs, "Service", "baton-gateway")["spec"])["grpc"] == 9443
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["grpc-tls"]["readOnly"] is True
    tls_dir = mounts["grpc-tls"]["mountPath"]
    assert (data["BATON_GRPC_TLS_CERT"], data["BATON_GRPC_TLS_KEY"]) == (f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["grpc-tls"]["secret"] == {"secretName": "baton-grpc-tls"}
    assert volumes["usage-spool"]["persistentVolumeClaim"] == {"claimName": "baton-usage-spool"}
    assert "model" in volumes and "model" in mounts  # the model volume is still there beside them


def test_gateway_grpc_can_be_turned_off(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["cpu-values.yaml"]
    container, _, data = _gateway(docs)
    assert "grpc" not in _ports(container) and "BATON_GRPC_PORT" not in data
    assert "grpc" not in _ports(_find(docs, "Service", "baton-gateway")["spec"])


INTERNAL = ("baton-scheduler", "baton-safety", "baton-worker-prefill", "baton-worker-decode")


def _token_ref(deployment: Manifest, variable: str = "BATON_CLUSTER_TOKEN") -> dict[str, str]:
    env = {e["name"]: e for e in _container(deployment)["env"]}
    return env[variable]["valueFrom"]["secretKeyRef"]


def test_every_internal_service_and_the_gateway_get_the_generated_cluster_token(
        rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["default"]
    data = _find(docs, "Secret", "baton-cluster-token")["data"]
    token = base64.b64decode(data["cluster-token"]).decode()
    assert len(token) == 48 and token.isalnum()
    assert set(data) == {"cluster-token"}  # no rotation under way
    for name in (*INTERNAL, "baton-gateway"):
        assert _token_ref(_find(docs, "Deployment", name)) == {"name": "baton-cluster-token", "key": "cluster-token"}
        assert _token_ref(_find(docs, "Deployment", name), "BATON_CLUSTER_TOKEN_ROTATING") == {
            "name": "baton-cluster-token", "key": "rotating-cluster-token", "optional": True}


def test_the_cluster_token_can_come_from_values_or_an_existing_secret(rendered: dict[str, list[Manifest]]) -> None:
    data = _find(rendered["one-gpu-values.yaml"], "Secret", "baton-cluster-token")["data"]
    assert base64.b64decode(data["cluster-token"]).decode() == "one-gpu-cluster-token-from-values"
    assert base64.b64decode(data["rotating-cluster-token"]).decode() == "one-gpu-previous-cluster-token"
    docs = rendered["external-values.yaml"]
    assert not [d for d in docs if d["kind"] == "Secret"]
    for name in INTERNAL:
        assert _token_ref(_find(docs, "Deployment", name)) == {"name": "baton-external", "key": "BATON_CLUSTER_TOKEN"}


def test_only_the_releases_pods_reach_the_internal_ports(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["default"]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert sorted(policies) == sorted(INTERNAL)  # the gateway is the public edge
    for name, spec in policies.items():
        pod_labels = _find(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= pod_labels.items()
        assert spec["policyTypes"] == ["Ingress"]
        release_pods, metrics = spec["ingress"]
        assert release_pods == {"from": [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": "baton"}}}]}
        assert metrics == {"ports": [{"port": 9090, "protocol": "TCP"}]}  # any source: Prometheus
    spec = _find(rendered["one-gpu-values.yaml"], "NetworkPolicy", "baton-worker-both")["spec"]
    assert spec["ingress"][1]["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    assert not [d for d in rendered["external-values.yaml"] if d["kind"] == "NetworkPolicy"]


def test_a_token_rotation_step_rolls_every_pod_that_reads_the_token(rendered: dict[str, list[Manifest]]) -> None:
    def checksums(docs: list[Manifest]) -> set[str]:
        return {d["spec"]["template"]["metadata"]["annotations"]["checksum/cluster-auth"]
                for d in docs if d["kind"] == "Deployment"}

    default = checksums(rendered["default"])
    assert len(default) == 1  # every Deployment, workers included, carries it
    assert checksums(rendered["one-gpu-values.yaml"]).isdisjoint(default)  # other token values: other pods


def test_safety_encoder_pools_and_batching_are_wired_to_its_settings(rendered: dict[str, list[Manifest]]) -> None:
    from services.safety.main import SafetySettings

    container = _container(_find(rendered["default"], "Deployment", "baton-safety"))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    capacity = {k: v for k, v in env.items() if k.startswith("BATON_SAFETY_") and k != "BATON_SAFETY_POLICY_FILE"}
    assert {k.removeprefix("BATON_SAFETY_").lower() for k in capacity} <= set(SafetySettings.model_fields)
    settings = SafetySettings(**{k.removeprefix("BATON_SAFETY_").lower(): v for k, v in capacity.items()})
    assert (settings.encoder_runtime, settings.batching, settings.batch_wait_ms, settings.output_threads,
            settings.batch_max_texts) == ("onnx", "auto", 2.0, None, None)


def test_kv_tiers_come_from_fleet_values_with_an_empty_dir_for_the_disk_tier(
        rendered: dict[str, list[Manifest]]) -> None:
    worker = _find(rendered["one-gpu-values.yaml"], "Deployment", "baton-worker-both")
    args = _container(worker)["args"]
    assert {"--host-kv-gib=16", "--disk-kv-dir=/var/lib/baton-kv", "--disk-kv-gib=64",
            "--kv-load-min-speedup=1"} <= set(args)
    mounts = {m["name"]: m["mountPath"] for m in _container(worker)["volumeMounts"]}
    volumes = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    assert mounts["kv-disk"] == "/var/lib/baton-kv" and volumes["kv-disk"]["emptyDir"] == {"sizeLimit": "65Gi"}
    default_worker = _find(rendered["default"], "Deployment", "baton-worker-decode")
    assert not [a for a in _container(default_worker)["args"] if "kv-gib" in a]  # off unless asked


def _render_with_both_fleet(**fleet: Any) -> list[Manifest]:
    """cpu-values.yaml with its `both` fleet changed, on CUDA."""
    helm = require_module("helm_python")
    values = _values("cpu-values.yaml")
    values["workerDefaults"]["device"] = "cuda"
    values["fleets"]["both"].update(fleet)
    files = helm.Chart.load(str(CHART)).render(values, name="baton", namespace="llm")
    return [doc for path, text in sorted(files.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def test_an_expert_parallel_fleet_takes_one_gpu_per_expert_rank(rendered: dict[str, list[Manifest]]) -> None:
    container = _container(_find(_render_with_both_fleet(expertParallelSize=4), "Deployment", "baton-worker-both"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "--expert-parallel-size=4" in container["args"] and "--tensor-parallel-size=1" in container["args"]
    default = _container(_find(rendered["xpyd-tp-values.yaml"], "Deployment", "baton-worker-decode"))
    assert "--expert-parallel-size=1" in default["args"]


def test_the_moe_example_serves_the_model_from_expert_parallel_both_workers(
        rendered: dict[str, list[Manifest]]) -> None:
    """charts/baton/ci/moe-ep-values.yaml: Qwen3-30B-A3B on 2 co-located workers of 4 expert ranks each."""
    docs = rendered["moe-ep-values.yaml"]
    worker = _find(docs, "Deployment", "baton-worker-both")
    container = _container(worker)
    assert worker["spec"]["replicas"] == 2 and container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"--role=both", "--expert-parallel-size=4", "--model=/models/Qwen3-30B-A3B"} <= set(container["args"])
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] in (
        "baton-worker-prefill", "baton-worker-decode")]


def test_a_pipeline_fleet_takes_tensor_times_pipeline_gpus(rendered: dict[str, list[Manifest]]) -> None:
    fleet = _render_with_both_fleet(tensorParallelSize=2, pipelineParallelSize=2)
    container = _container(_find(fleet, "Deployment", "baton-worker-both"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"--tensor-parallel-size=2", "--pipeline-parallel-size=2"} <= set(container["args"])
    default = _container(_find(rendered["xpyd-tp-values.yaml"], "Deployment", "baton-worker-decode"))
    assert "--pipeline-parallel-size=1" in default["args"]


def test_a_disaggregated_fleet_takes_its_pipeline_stages() -> None:
    decode = _container(_find(_render_with_both_fleet(role="decode", pipelineParallelSize=2), "Deployment",
                              "baton-worker-both"))
    assert "--pipeline-parallel-size=2" in decode["args"] and decode["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize(("fleet", "message"), [
    ({"pipelineParallelSize": 2, "expertParallelSize": 2}, "pipelineParallelSize and expertParallelSize cannot"),
    ({"expertParallelSize": 2, "tensorParallelSize": 2}, "cannot both be above 1"),
    ({"expertParallelSize": 2, "role": "prefill"}, "needs role both"),
])
def test_unsupported_expert_parallel_fleets_fail_to_render(fleet: dict[str, Any], message: str) -> None:
    errors = require_module("helm_python.errors")
    with pytest.raises(errors.HelmRenderError, match=message):
        _render_with_both_fleet(**fleet)


def test_fp8_weights_and_kv_cache_come_from_fleet_values(rendered: dict[str, list[Manifest]]) -> None:
    args = _container(_find(_render_with_both_fleet(quantization="fp8", kvCacheDtype="fp8_e4m3"), "Deployment",
                            "baton-worker-both"))["args"]
    assert {"--quantization=fp8", "--kv-cache-dtype=fp8_e4m3"} <= set(args)
    default = _container(_find(rendered["default"], "Deployment", "baton-worker-decode"))["args"]
    assert "--kv-cache-dtype=auto" in default and not [a for a in default if a.startswith("--quantization")]
