"""deploy/kubernetes/: kubectl parses every manifest, offline, and the objects fit together (issue 46).

No API server runs here. kubectl maps each manifest's kind to a resource through API discovery, even with
``--dry-run=client --validate=false``, so the test writes discovery documents for the kinds the manifests use
(``KINDS``) into a fresh ``--cache-dir``, in the layout kubectl itself writes there
(``discovery/<host>_<port>/servergroups.json`` and ``<group>/<version>/serverresources.json``; the same from kubectl
1.20, Debian's ``kubernetes-client``, to 1.32), and points kubectl at a loopback port this process holds bound but
not listening. A kind missing from the table makes kubectl ask that port, where the connection is refused: nothing
is sent anywhere else. See docs/kubernetes.md.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
NAMESPACE = "rankctl"
IMAGE = "ghcr.io/rankctl/rankctl:0.1.0"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian package kubernetes-client)")

# (group/version, kind, plural, namespaced): the API discovery kubectl is given; nothing else maps
KINDS = [
    ("v1", "Namespace", "namespaces", False),
    ("v1", "Secret", "secrets", True),
    ("v1", "Service", "services", True),
    ("v1", "ServiceAccount", "serviceaccounts", True),
    ("apps/v1", "StatefulSet", "statefulsets", True),
    ("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets", True),
    ("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies", True),
    ("rbac.authorization.k8s.io/v1", "Role", "roles", True),
    ("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", True),
    ("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets", True),
    ("kueue.x-k8s.io/v1beta1", "Topology", "topologies", False),
    ("kueue.x-k8s.io/v1beta1", "ResourceFlavor", "resourceflavors", False),
    ("kueue.x-k8s.io/v1beta1", "ClusterQueue", "clusterqueues", False),
    ("kueue.x-k8s.io/v1beta1", "LocalQueue", "localqueues", True),
    ("monitoring.coreos.com/v1", "PodMonitor", "podmonitors", True),
]
NAMESPACED = {kind: namespaced for _, kind, _, namespaced in KINDS}


def write_discovery(cache_dir: Path, server: str) -> None:
    """The discovery documents kubectl caches for ``server`` (``http://127.0.0.1:PORT``), for ``KINDS`` only."""
    root = cache_dir / "discovery" / re.sub(r"[^\w/.]", "_", server.split("://", 1)[1])
    versions: dict[str, list[str]] = {}
    for group_version, kind, plural, namespaced in KINDS:
        group, _, version = group_version.rpartition("/")
        if version not in versions.setdefault(group, []):
            versions[group].append(version)
        path = root / group_version / "serverresources.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        listed = json.loads(path.read_text()) if path.exists() else {
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": []}
        listed["resources"].append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                                    "kind": kind, "verbs": ["create", "delete", "get", "list", "patch", "update"]})
        path.write_text(json.dumps(listed))

    def gv(group: str, version: str) -> dict[str, str]:
        return {"groupVersion": f"{group}/{version}" if group else version, "version": version}

    groups = [{"name": g, "versions": [gv(g, v) for v in vs], "preferredVersion": gv(g, vs[0])}
              for g, vs in versions.items()]
    (root / "servergroups.json").write_text(json.dumps({"kind": "APIGroupList", "apiVersion": "v1",
                                                        "groups": groups}))


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory: pytest.TempPathFactory):
    """Run kubectl offline: a kubeconfig naming a loopback port held bound and closed, fresh discovery each call."""
    home = tmp_path_factory.mktemp("kubectl")
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))   # never listen(): a connection there is refused, and no other process takes it
    server = f"http://127.0.0.1:{held.getsockname()[1]}"
    config = home / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "offline", "preferences": {},
        "clusters": [{"name": "offline", "cluster": {"server": server}}],
        "contexts": [{"name": "offline", "context": {"cluster": "offline", "user": "nobody"}}],
        "users": [{"name": "nobody", "user": {}}]}))
    calls = iter(range(1_000_000))

    def run(*args: str) -> subprocess.CompletedProcess:
        cache_dir = home / f"cache-{next(calls)}"
        write_discovery(cache_dir, server)
        return subprocess.run([KUBECTL, "--kubeconfig", str(config), "--cache-dir", str(cache_dir), *args],
                              capture_output=True, text=True, timeout=120, cwd=home,
                              env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home)})
    run.server = server   # type: ignore[attr-defined]
    try:
        yield run
    finally:
        held.close()


def created(run, *sources: str) -> list[dict]:
    """The objects ``kubectl create --dry-run=client`` makes of ``sources`` (-f FILE ... or -k DIR)."""
    done = run("create", "--dry-run=client", "--validate=false", "-o", "json", *sources)
    assert done.returncode == 0, done.stderr
    items, decoder, text, at = [], json.JSONDecoder(), done.stdout, 0
    while text[at:].strip():   # one JSON document per object, or one List (kubectl's versions differ)
        out, at = decoder.raw_decode(text, len(text) - len(text[at:].lstrip()))
        items += out["items"] if out.get("kind") == "List" else [out]
    return items


def manifests() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def objects(kubectl) -> dict[tuple[str, str], dict]:
    items = created(kubectl, *(a for p in manifests() for a in ("-f", str(p))))
    found = {(o["kind"], o["metadata"]["name"]): o for o in items}
    assert len(found) == len(items), "two objects of one kind share a name"
    return found


def pod_specs(objects: dict) -> dict[str, dict]:
    """Each workload's pod spec: the StatefulSets' and the JobSet's replicated jobs'."""
    out = {name: o["spec"]["template"]["spec"] for (kind, name), o in objects.items() if kind == "StatefulSet"}
    for (kind, name), o in objects.items():
        if kind == "JobSet":
            for rjob in o["spec"]["replicatedJobs"]:
                out[f"{name}/{rjob['name']}"] = rjob["template"]["spec"]["template"]["spec"]
    return out


def options(args: list[str]) -> dict[str, str]:
    """``--option value`` pairs (every option the manifests pass to ctl takes a value)."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return dict(zip(args[::2], args[1::2]))


def container(spec: dict, name: str) -> dict:
    [found] = [c for c in spec["containers"] if c["name"] == name]
    return found


def quantity(text: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units.get(unit, 1)


@cache
def help_text(command: str) -> str:
    done = subprocess.run([sys.executable, "-m", "rankctl.cli.main", command, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_kustomization_lists_every_manifest_and_kubectl_builds_it(kubectl, objects) -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == [p.name for p in manifests()]
    done = kubectl("kustomize", str(DEPLOY))
    assert done.returncode == 0, done.stderr
    built = {(o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(done.stdout) if o}
    assert built == set(objects)
    assert {(o["kind"], o["metadata"]["name"]) for o in created(kubectl, "-k", str(DEPLOY))} == set(objects)


def test_kubectl_parses_every_manifest(objects) -> None:
    kinds = sorted(kind for kind, _ in objects)
    assert set(kinds) == set(NAMESPACED)
    assert kinds.count("StatefulSet") == 2 and kinds.count("Service") == 3 and kinds.count("JobSet") == 1
    for (kind, name), o in objects.items():   # one namespace, and none on cluster-wide objects
        assert o["metadata"].get("namespace") == (NAMESPACE if NAMESPACED[kind] else None), (kind, name)
    assert ("Namespace", NAMESPACE) in objects
    images = {c["image"] for spec in pod_specs(objects).values()
              for c in spec.get("initContainers", []) + spec["containers"] if "rankctl" in c["image"]}
    assert images == {IMAGE}


def test_the_coordinators_run_on_the_etcd_members_and_the_workers_dial_the_coordinators(objects) -> None:
    coordinators, etcd = objects[("StatefulSet", "rankctl-coordinator")], objects[("StatefulSet", "etcd")]
    pods = pod_specs(objects)
    coordinator = container(pods["rankctl-coordinator"], "coordinator")
    assert coordinator["command"] == ["ctl", "coordinator"]
    args = options(coordinator["args"])
    members = ",".join(f"etcd-{i}.{etcd['spec']['serviceName']}.{NAMESPACE}.svc:2379"
                       for i in range(etcd["spec"]["replicas"]))
    assert args["--store"] == f"etcd://{members}/rankctl"
    service = coordinators["spec"]["serviceName"]
    assert args["--advertise-address"] == f"$(POD_NAME).{service}.{NAMESPACE}.svc"
    for name in (service, etcd["spec"]["serviceName"]):   # headless, and each member named before it is ready
        spec = objects[("Service", name)]["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    for (kind, name), o in objects.items():   # every Service selects the pods of some workload
        if kind == "Service":
            assert any(o["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()
                       for (k, _), s in objects.items() if k == "StatefulSet"), name

    [(_, jobset_name)] = [key for key in objects if key[0] == "JobSet"]
    jobset = objects[("JobSet", jobset_name)]
    [rjob] = jobset["spec"]["replicatedJobs"]
    job, notes = rjob["template"]["spec"], jobset["metadata"]["annotations"]
    worker = container(pods[f"{jobset_name}/{rjob['name']}"], "worker")
    assert worker["command"] == ["ctl", "worker"]
    args = options(worker["args"])
    assert args["--pool"] == notes["rankctl/pool"] and jobset_name.endswith(args["--pool"])
    assert args["--coordinator"] == ",".join(f"{coordinators['metadata']['name']}-{i}.{service}.{NAMESPACE}.svc:7420"
                                             for i in range(coordinators["spec"]["replicas"]))
    assert int(notes["rankctl/spares"]) >= 1 and rjob["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"] == int(notes["rankctl/nodes"]) + int(notes["rankctl/spares"])
    assert args["--slots"] == worker["resources"]["limits"]["nvidia.com/gpu"]
    for spec in pods.values():   # every $(VAR) an argument names is the container's own
        for c in spec.get("initContainers", []) + spec["containers"]:
            words = c.get("command", []) + c.get("args", [])
            assert all(isinstance(w, str) for w in words), c["name"]
            assert set(re.findall(r"\$\((\w+)\)", " ".join(words))) <= {e["name"] for e in c.get("env", [])}


def test_the_queue_admits_the_workers_and_every_reference_resolves(objects) -> None:
    jobset = next(o for (kind, _), o in objects.items() if kind == "JobSet")
    local = objects[("LocalQueue", jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"])]
    assert local["metadata"]["namespace"] == jobset["metadata"]["namespace"]
    queue = objects[("ClusterQueue", local["spec"]["clusterQueue"])]
    assert queue["spec"]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    [group] = queue["spec"]["resourceGroups"]
    for flavor in group["flavors"]:
        topology = objects[("ResourceFlavor", flavor["name"])]["spec"].get("topologyName")
        assert topology is None or ("Topology", topology) in objects
    [rjob] = jobset["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]
    levels = [lv["nodeLabel"] for (kind, _), o in objects.items() if kind == "Topology" for lv in o["spec"]["levels"]]
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"] in levels
    pods = rjob["template"]["spec"]["parallelism"]
    [worker] = pod["spec"]["containers"]
    asked = {**worker["resources"]["requests"], **worker["resources"]["limits"]}
    quota = {r["name"]: quantity(r["nominalQuota"]) for r in group["flavors"][0]["resources"]}
    assert set(group["coveredResources"]) == set(quota) <= set(asked)
    for name in quota:   # one allocation fits the queue, or Kueue would hold it forever
        assert quantity(asked[name]) * pods <= quota[name], name

    secrets = {name for kind, name in objects if kind == "Secret"}
    accounts = {"default"} | {name for kind, name in objects if kind == "ServiceAccount"}
    for spec in pod_specs(objects).values():
        assert {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v} <= secrets
        assert spec.get("serviceAccountName", "default") in accounts
    for (kind, _), o in objects.items():
        if kind == "PodMonitor":
            for endpoint in o["spec"]["podMetricsEndpoints"]:
                tls = endpoint["tlsConfig"]
                assert {tls["ca"]["secret"]["name"], tls["cert"]["secret"]["name"], tls["keySecret"]["name"]} <= secrets


@pytest.mark.parametrize("command", ["coordinator", "worker"])
def test_every_ctl_option_the_manifests_pass_exists(objects, command: str) -> None:
    used = {word for spec in pod_specs(objects).values() for c in spec["containers"]
            if c.get("command") == ["ctl", command] for word in c["args"] if word.startswith("--")}
    assert used
    for option in used:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text(command)), f"ctl {command}: {option}"


def test_a_broken_manifest_makes_kubectl_fail(kubectl, tmp_path: Path) -> None:
    good = (DEPLOY / "namespace.yaml").read_text()
    assert created(kubectl, "-f", str(DEPLOY / "namespace.yaml"))[0]["kind"] == "Namespace"
    refused = kubectl.server.split("://")[1]   # a kind not discovered: kubectl asks the held port, and only it
    cases = {"syntax.yaml": (good.replace("  name: rankctl", "  name: [rankctl"), "error converting YAML"),
             "unknown-kind.yaml": (good.replace("kind: Namespace", "kind: Namespaces"), refused),
             "unknown-group.yaml": (good.replace("apiVersion: v1", "apiVersion: example.com/v1"), refused)}
    for name, (text, said) in cases.items():
        assert text != good
        (tmp_path / name).write_text(text)
        done = kubectl("create", "--dry-run=client", "--validate=false", "-o", "json", "-f", str(tmp_path / name))
        assert done.returncode != 0 and said in done.stderr, (name, done.stderr)
        assert "connection refused" in done.stderr or said != refused, done.stderr
