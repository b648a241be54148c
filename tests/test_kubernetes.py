"""deploy/kubernetes/: render the kustomizations offline and validate every object.

The CI machine has no cluster and (usually) no kubectl, so a small renderer here
applies the kustomization subset the manifests use: ``resources`` (files and
directories), ``configMapGenerator`` (files; ``behavior: replace``) with fixed names,
and ``patches`` as strategic merge patches (lists of named items merged by name,
``$patch: delete``). A kustomization using anything else fails the test, so the
renderer cannot silently drift from kustomize. Where ``kubectl`` is on PATH its
``kubectl kustomize`` output must equal ours.

Built-in kinds are validated strictly against Kubernetes 1.30's OpenAPI schemas
(PyPI ``kubernetes-validate``, offline). PodMonitor and PrometheusRule are Prometheus
Operator CRDs: their structure is checked here, and the PrometheusRule must carry
exactly the groups of dashboards/prometheus/kvguard-rules.yml (a drift test).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

from kvguard.config.settings import parse_config

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (test extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e .[test]"
)

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
KUSTOMIZATIONS = [BASE, *OVERLAYS]
RULES = ROOT / "dashboards" / "prometheus" / "kvguard-rules.yml"
RENDER_SCRIPT = ROOT / "scripts" / "render-k8s-rules.py"
KUBERNETES_VERSION = "1.30.0"
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "configMapGenerator",
    "generatorOptions",
    "patches",
}
Obj = dict[str, Any]


# ------------------------------------------------------------------ the renderer
def load_documents(path: Path) -> list[Obj]:
    """The YAML documents of one manifest file (empty documents dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def render(directory: Path) -> list[Obj]:
    """What ``kustomize build directory`` gives, for the subset our manifests use."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text(encoding="utf-8"))
    unknown = set(spec) - SUPPORTED_KEYS
    assert not unknown, f"{directory}: the test renderer does not support {sorted(unknown)}"
    assert spec.get("generatorOptions", {}) in ({}, {"disableNameSuffixHash": True})
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        target = (directory / entry).resolve()
        objects += render(target) if target.is_dir() else load_documents(target)
    for generator in spec.get("configMapGenerator", []):
        assert set(generator) <= {"name", "files", "behavior"}, generator
        data = {
            Path(f).name: (directory / f).read_text(encoding="utf-8") for f in generator["files"]
        }
        made = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}}
        made["data"] = data
        behavior = generator.get("behavior", "create")
        existing = find(objects, "ConfigMap", generator["name"], required=False)
        if behavior == "replace":
            assert existing is not None, f"replace of a missing ConfigMap {generator['name']}"
            existing["data"] = data
        else:
            assert behavior == "create", behavior
            assert existing is None, f"ConfigMap {generator['name']} generated twice"
            objects.append(made)
    for patch in spec.get("patches", []):
        assert set(patch) == {"path"}, f"only strategic merge patch files are rendered: {patch}"
        for doc in load_documents(directory / patch["path"]):
            target = find(objects, doc["kind"], doc["metadata"]["name"])
            merged = strategic_merge(target, doc)
            objects[objects.index(target)] = merged
    return objects


def find(objects: list[Obj], kind: str, name: str, *, required: bool = True) -> Obj | None:
    """The object of that kind and name."""
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    assert not required, f"no {kind} {name}"
    return None


def merge_key(items: list[Any]) -> str | None:
    """The key a strategic merge matches list items on (None: replace the list)."""
    if items and all(isinstance(i, dict) and "name" in i for i in items):
        return "name"
    return None


def strategic_merge(base: Any, patch: Any) -> Any:
    """``patch`` applied to ``base`` (maps merge; named items merge or delete by name)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and merge_key(patch) == "name":
        assert merge_key(base) == "name", f"cannot merge {patch} into {base}"
        out = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, b in enumerate(out) if b["name"] == item["name"]), None)
            if item.get("$patch") == "delete":
                assert index is not None, f"$patch: delete of a missing item {item['name']}"
                del out[index]
            elif index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item)
        return out
    return copy.deepcopy(patch)


def by_identity(objects: list[Obj]) -> dict[tuple[str, str], Obj]:
    """Objects keyed by (kind, name); names are unique per kind in one rendering."""
    keyed = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(keyed) == len(objects), "two objects share a kind and a name"
    return keyed


def canonical(value: Any) -> Any:
    """``value`` with lists of named items sorted by name.

    kustomize puts patched items first; the order of containers, env vars (none refers
    to another), volumes and mounts carries no meaning in these manifests.
    """
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [canonical(v) for v in value]
        return sorted(items, key=lambda i: i["name"]) if merge_key(items) == "name" else items
    return value


RENDERED = {path.name: render(path) for path in KUSTOMIZATIONS}


def rendering(name: str) -> dict[tuple[str, str], Obj]:
    """One kustomization's objects by (kind, name)."""
    return by_identity(RENDERED[name])


def container(objects: dict[tuple[str, str], Obj], name: str) -> Obj:
    """A container of the vllm Deployment."""
    spec = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    matches = [c for c in spec["containers"] if c["name"] == name]
    assert len(matches) == 1, f"no container {name}"
    return matches[0]


def kvguard_config(objects: dict[tuple[str, str], Obj]) -> dict[str, Any]:
    """The kvguard.toml of the rendering's ConfigMap, parsed."""
    text = objects[("ConfigMap", "kvguard-config")]["data"]["kvguard.toml"]
    return tomllib.loads(text)


# ------------------------------------------------------------------ rendering and schemas
def test_the_renderer_merges_by_name_deletes_and_replaces_scalars_lists():
    """The strategic merge subset: named items merge or go, other lists are replaced."""
    base = {"c": [{"name": "a", "x": 1, "l": [1, 2]}, {"name": "b"}], "k": {"p": 1, "q": 2}}
    patch = {"c": [{"name": "a", "l": [3]}, {"name": "b", "$patch": "delete"}], "k": {"q": 5}}
    assert strategic_merge(base, patch) == {
        "c": [{"name": "a", "x": 1, "l": [3]}],
        "k": {"p": 1, "q": 5},
    }


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_every_object_validates_against_the_kubernetes_schemas(path):
    """Each built-in object passes kubernetes-validate, strict (no unknown fields)."""
    objects = RENDERED[path.name]
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kubectl_kustomize_renders_the_same(path):
    """Where kubectl is installed, its kustomize output equals this renderer's."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH: only the test's own renderer was checked")
    done = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    theirs = by_identity([d for d in yaml.safe_load_all(done.stdout) if d])
    assert canonical(theirs) == canonical(by_identity(RENDERED[path.name]))


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_the_kvguard_config_in_every_variant_is_valid(path):
    """The config parser of kvguard accepts each ConfigMap's kvguard.toml."""
    objects = rendering(path.name)
    config = parse_config(kvguard_config(objects), env={})
    assert config.engine.url == "http://127.0.0.1:8000"
    assert config.server.listen == "0.0.0.0:9108"


# ------------------------------------------------------------------ what the base promises
def test_base_routes_clients_through_kvguard_and_keeps_vllm_on_loopback():
    """Service -> kvguard's proxy port; vLLM on 127.0.0.1; the proxy forwards there."""
    objects = rendering("base")
    service = objects[("Service", "vllm")]
    (port,) = service["spec"]["ports"]
    kvguard = container(objects, "kvguard")
    ports = {p["name"]: p["containerPort"] for p in kvguard["ports"]}
    assert port["targetPort"] == "proxy"
    config = kvguard_config(objects)
    assert config["proxy"]["enabled"] is True
    assert config["proxy"]["listen"] == f"0.0.0.0:{ports['proxy']}"
    vllm = container(objects, "vllm")
    assert "--host=127.0.0.1" in vllm["args"]
    assert "--port=8000" in vllm["args"]
    assert "ports" not in vllm  # nothing on the pod's network


def test_base_probes_readiness_on_readyz_and_liveness_on_healthz():
    """/readyz gates the pod (so shedding pods leave the Service); /healthz is liveness."""
    kvguard = container(rendering("base"), "kvguard")
    assert kvguard["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvguard-api"}
    assert kvguard["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvguard-api"}
    assert {p["name"]: p["containerPort"] for p in kvguard["ports"]}["kvguard-api"] == 9108


def test_kvguard_runs_hardened_with_requests_and_limits():
    """Non-root, read-only root filesystem, no escalation, no capabilities, bounded."""
    kvguard = container(rendering("base"), "kvguard")
    context = kvguard["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert set(kvguard["resources"]) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(kvguard["resources"]["limits"])


def test_config_from_a_configmap_and_the_token_from_a_secret():
    """kvguard.toml is mounted from the ConfigMap; the engine token comes from a Secret."""
    objects = rendering("base")
    kvguard = container(objects, "kvguard")
    mounts = {m["name"]: m["mountPath"] for m in kvguard["volumeMounts"]}
    assert mounts["kvguard-config"] == "/etc/kvguard"
    assert kvguard["args"] == ["run", "--config", "/etc/kvguard/kvguard.toml"]
    env = {e["name"]: e for e in kvguard["env"]}
    secret = env["KVGUARD_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] == "vllm-api-key"
    text = json.dumps(objects[("ConfigMap", "kvguard-config")])
    assert "token =" not in text  # no secret in the ConfigMap


def test_images_are_marked_placeholders_without_a_registry_host():
    """No kvguard image is published: each is a marked placeholder, and no host is named."""
    for name, objects in RENDERED.items():
        for obj in objects:
            if obj["kind"] != "Deployment":
                continue
            for item in obj["spec"]["template"]["spec"]["containers"]:
                image = item["image"]
                first = image.split("/")[0]
                assert "/" not in image or not re.search(r"[.:]", first), f"{name}: {image}"
                if image.startswith("kvguard"):
                    assert "placeholder" in image, f"{name}: {image}"


# ------------------------------------------------------------------ the variants
def test_watch_only_has_no_proxy_and_serves_the_engine_directly():
    """Watch-only: proxy off, the Service targets vLLM, readiness still gates the pod."""
    objects = rendering("watch-only")
    config = kvguard_config(objects)
    assert config["proxy"]["enabled"] is False
    assert config["proxy"]["fail_readiness_at"] == "critical"
    (port,) = objects[("Service", "vllm")]["spec"]["ports"]
    vllm = container(objects, "vllm")
    assert port["targetPort"] == "engine"
    assert {p["name"] for p in vllm["ports"]} == {"engine"}
    kvguard = container(objects, "kvguard")
    assert [p["name"] for p in kvguard["ports"]] == ["kvguard-api"]
    assert kvguard["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_supervisor_runs_vllm_as_kvguard_s_child_with_the_gpus():
    """Supervisor: one container, `kvguard run … -- vllm serve …`, holding the GPUs."""
    objects = rendering("supervisor")
    spec = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    assert [c["name"] for c in spec["containers"]] == ["kvguard"]
    kvguard = spec["containers"][0]
    args = kvguard["args"]
    assert args[0] == "run"
    assert args[args.index("--") + 1 : args.index("--") + 3] == ["vllm", "serve"]
    tp = next(a for a in args if a.startswith("--tensor-parallel-size="))
    config = kvguard_config(objects)
    assert config["reconfigure"]["mode"] == "supervisor"
    assert int(tp.split("=")[1]) == config["model"]["tp"] == 4
    assert kvguard["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert kvguard["securityContext"]["readOnlyRootFilesystem"] is True
    # vLLM writes caches: a scratch volume, since the root filesystem is read-only.
    assert "/tmp" in {m["mountPath"] for m in kvguard["volumeMounts"]}  # noqa: S108


def test_supervisor_has_a_user_name_a_weights_cache_and_an_optional_hf_token():
    """UID 65532 has no passwd entry; 70B weights need a PVC, not the 20Gi scratch volume."""
    objects = rendering("supervisor")
    spec = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    kvguard = container(objects, "kvguard")
    env = {e["name"]: e for e in kvguard["env"]}
    # getpass.getuser() (torch inductor) reads these before the passwd database.
    assert env["USER"]["value"]
    assert env["LOGNAME"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in kvguard["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    cache = volumes[mounts[env["HF_HOME"]["value"]]]
    claim = objects[("PersistentVolumeClaim", cache["persistentVolumeClaim"]["claimName"])]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi")
    assert int(size.removesuffix("Gi")) >= 160  # Llama-3.1-70B in bf16 is ~140 GB
    assert spec["securityContext"]["fsGroup"] == kvguard["securityContext"]["runAsUser"]
    assert_optional_hf_token(env)


def assert_optional_hf_token(env: dict[str, Obj]) -> None:
    """HF_TOKEN comes from a Secret, optional so public models need none."""
    ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True
    assert (ref["name"], ref["key"]) == ("hf-token", "token")


def test_base_vllm_takes_an_optional_hf_token_for_gated_models():
    """Llama is gated: the base's vLLM reads HF_TOKEN from an optional Secret."""
    vllm = container(rendering("base"), "vllm")
    assert_optional_hf_token({e["name"]: e for e in vllm["env"]})


def test_fp8_rollout_gives_kvguard_the_rights_its_script_needs():
    """Command mode: the script sets the env var vLLM's args read; RBAC allows exactly that."""
    objects = rendering("fp8-rollout")
    config = kvguard_config(objects)
    assert config["reconfigure"]["mode"] == "command"
    script_path = config["reconfigure"]["command"][1]
    script = objects[("ConfigMap", "kvguard-config")]["data"][Path(script_path).name]
    assert "VLLM_KV_CACHE_DTYPE=${KVGUARD_KV_CACHE_DTYPE}" in script
    vllm = container(objects, "vllm")
    assert "--kv-cache-dtype=$(VLLM_KV_CACHE_DTYPE)" in vllm["args"]
    assert "VLLM_KV_CACHE_DTYPE" in {e["name"] for e in vllm["env"]}
    spec = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "kvguard"
    role = objects[("Role", "kvguard-fp8-rollout")]
    patchers = [r for r in role["rules"] if "patch" in r["verbs"]]
    assert patchers == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "resourceNames": ["vllm"],
            "verbs": ["get", "patch", "watch"],
        }
    ]


SA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_fp8_rollout_mounts_the_api_token_into_kvguard_only():
    """The token that may patch the Deployment is in kvguard's container, never in vLLM's."""
    objects = rendering("fp8-rollout")
    spec = objects[("Deployment", "vllm")]["spec"]["template"]["spec"]
    # No automount: it would put the token into every container of the pod.
    assert spec.get("automountServiceAccountToken") is False
    assert objects[("ServiceAccount", "kvguard")].get("automountServiceAccountToken") is False
    token_volumes = {
        v["name"]
        for v in spec["volumes"]
        if any("serviceAccountToken" in src for src in v.get("projected", {}).get("sources", []))
    }
    assert len(token_volumes) == 1
    for item in spec["containers"] + spec.get("initContainers", []):
        mounted = {m["name"]: m for m in item.get("volumeMounts", [])}
        has_token = bool(token_volumes & set(mounted))
        assert has_token == (item["name"] == "kvguard"), item["name"]
    kvguard = container(objects, "kvguard")
    (mount,) = [m for m in kvguard["volumeMounts"] if m["name"] in token_volumes]
    # Where kubectl's in-cluster config finds token, ca.crt and namespace.
    assert (mount["mountPath"], mount["readOnly"]) == (SA_PATH, True)
    (volume,) = [v for v in spec["volumes"] if v["name"] in token_volumes]
    paths = set()
    for source in volume["projected"]["sources"]:
        for kind in ("configMap", "downwardAPI"):
            paths |= {i["path"] for i in source.get(kind, {}).get("items", [])}
        paths |= {source.get("serviceAccountToken", {}).get("path")} - {None}
    assert paths == {"token", "ca.crt", "namespace"}
    # kubectl caches discovery under $HOME; the root filesystem is read-only.
    env = {e["name"]: e.get("value") for e in kvguard["env"]}
    mounts = {m["mountPath"]: m["name"] for m in kvguard["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts[env["HOME"]]]


# ------------------------------------------------------------------ CRDs and generated files
def test_podmonitor_scrapes_kvguard_s_port_under_a_kvguard_job():
    """monitoring.coreos.com/v1 PodMonitor on the kvguard-api port; job from the pod label."""
    objects = rendering("base")
    monitor = objects[("PodMonitor", "kvguard")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"jobLabel", "selector", "podMetricsEndpoints"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
    assert (endpoint["port"], endpoint["path"]) == ("kvguard-api", "/metrics")
    template = objects[("Deployment", "vllm")]["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The alerts match job=~"kvguard.*": the job label's value must start so.
    assert labels[monitor["spec"]["jobLabel"]].startswith("kvguard")


def test_prometheusrule_holds_exactly_the_rules_file_s_groups():
    """A drift test: the PrometheusRule's groups equal dashboards/prometheus/kvguard-rules.yml."""
    rule = rendering("base")[("PrometheusRule", "kvguard")]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"}
        for item in group["rules"]:
            assert ("alert" in item) != ("record" in item)
            assert isinstance(item["expr"], str)
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_grafana_dashboard_configmaps_carry_the_generated_dashboards():
    """Each dashboard JSON, unchanged, in a ConfigMap labelled for Grafana's sidecar."""
    objects = rendering("base")
    for name in ("kvguard-overview", "kvguard-fleet"):
        config_map = objects[("ConfigMap", f"{name}-dashboard")]
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        source = ROOT / "dashboards" / "grafana" / f"{name}.json"
        assert json.loads(config_map["data"][f"{name}.json"]) == json.loads(source.read_text())


def test_generated_manifests_are_current():
    """scripts/render-k8s-rules.py --check: the committed files match their sources."""
    done = subprocess.run(
        [sys.executable, str(RENDER_SCRIPT), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
