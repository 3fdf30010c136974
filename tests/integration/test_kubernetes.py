"""deploy/kubernetes/: every manifest passes the Kubernetes API schemas (kubernetes-validate,
offline), the pod is wired as docs/deploy.md says, the PrometheusRule carries exactly the rules
of config/prometheus/ (and promtool accepts them), the liveness backstop fails only for a live
restart request, and the `evict` reload drives the real kubernetes client against a local
API endpoint that answers 201, then 429."""
from __future__ import annotations

import copy
import glob
import http.server
import json
import os
import shutil
import subprocess
import threading

import pytest
import yaml

from tests.conftest import ROOT, restart_requester
from torch_watchdog.sidecar import config as sidecar_config
from torch_watchdog.sidecar.actions import evict, executors

kv = pytest.importorskip("kubernetes_validate")
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
CRDS = {"PodMonitor", "PrometheusRule"}  # Prometheus Operator kinds: no bundled schema
# the oldest release whose schemas have everything used (native sidecars, resource.k8s.io/v1)
# and the newest the validator bundles
VERSIONS = ("1.34", kv.utils.latest_version())
SOCKET_DIR = "/run/torch-watchdog"
BUNDLE_DIR = "/var/cache/torch-watchdog"
MARKER = "/run/torch-watchdog/restart-requested"


def manifests() -> dict[str, list[dict]]:
    out = {}
    for path in sorted(glob.glob(os.path.join(DEPLOY, "**", "*.yaml"), recursive=True)):
        with open(path) as fh:
            out[os.path.relpath(path, DEPLOY)] = [d for d in yaml.safe_load_all(fh) if d]
    return out


def one(kind: str, file: str) -> dict:
    docs = [d for d in manifests()[file] if d["kind"] == kind]
    assert len(docs) == 1, f"{file}: {len(docs)} {kind}"
    return docs[0]


def pod_spec() -> dict:
    return one("Deployment", "deployment.yaml")["spec"]["template"]["spec"]


def containers() -> tuple[dict, dict]:
    spec = pod_spec()
    (sidecar,) = spec["initContainers"]
    (server,) = spec["containers"]
    return sidecar, server


# -- schemas ---------------------------------------------------------------------------------
def test_every_manifest_passes_the_kubernetes_schemas():
    found = manifests()
    assert {"deployment.yaml", "configmap.yaml", "pvc.yaml", "podmonitor.yaml",
            "prometheusrule.yaml", "fleet/pdb.yaml", "fleet/rbac.yaml",
            "node/daemonset.yaml"} <= set(found)
    kinds = set()
    for docs in found.values():
        for doc in docs:
            kinds.add(doc["kind"])
            if doc["kind"] in CRDS:
                continue  # checked by the tests below (structure, promtool)
            for version in VERSIONS:
                # strict: an unknown field (a typo) is an error, not silently dropped
                kv.validate(doc, version, strict=True)
    assert kinds >= {"Deployment", "ConfigMap", "PersistentVolumeClaim", "ServiceAccount",
                     "ResourceClaimTemplate", "PodDisruptionBudget", "Role", "RoleBinding",
                     "DaemonSet", "PodMonitor", "PrometheusRule"}


def test_the_validator_rejects_a_broken_deployment():
    """The check above can fail: a misspelt field and a wrong type are caught."""
    good = one("Deployment", "deployment.yaml")
    typo = copy.deepcopy(good)
    typo["spec"]["template"]["spec"]["initContainers"][0]["restartPolicyy"] = "Always"
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["replicas"] = "two"
    for bad in (typo, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, VERSIONS[0], strict=True)


# -- the pod ---------------------------------------------------------------------------------
def test_the_sidecar_is_a_native_sidecar_sharing_an_in_memory_socket_volume():
    spec = pod_spec()
    sidecar, server = containers()
    assert sidecar["restartPolicy"] == "Always"
    # the agent's pids must be the sidecar's (its receiver drops any other as spoofed)
    assert spec["shareProcessNamespace"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
              for c in (sidecar, server)}
    socket_volume = mounts["torch-watchdog"][SOCKET_DIR]
    assert mounts["server"][SOCKET_DIR] == socket_volume
    assert volumes[socket_volume]["emptyDir"]["medium"] == "Memory"
    # the bundle: a persistent volume in the server, at the path the warm restart uses
    bundle = volumes[mounts["server"][BUNDLE_DIR]]
    claim = one("PersistentVolumeClaim", "pvc.yaml")["metadata"]["name"]
    assert bundle["persistentVolumeClaim"]["claimName"] == claim
    # one GPU claim, named by both containers: the sidecar's NVML sees the server's GPU
    (gpu,) = spec["resourceClaims"]
    assert gpu["resourceClaimTemplateName"] == one("ResourceClaimTemplate",
                                                   "gpu-claim.yaml")["metadata"]["name"]
    for c in (sidecar, server):
        assert c["resources"]["claims"] == [{"name": gpu["name"]}]
    # the socket path the sidecar listens on is the one the agent sends to
    cfg = yaml.safe_load(one("ConfigMap", "configmap.yaml")["data"]["watchdog.yaml"])
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["TORCH_WATCHDOG_SOCKET"] == cfg["agent"]["socket_path"]
    assert os.path.dirname(cfg["agent"]["socket_path"]) == SOCKET_DIR


def test_no_probe_asks_the_sidecar_and_only_the_sidecar_holds_the_api_token():
    spec = pod_spec()
    sidecar, server = containers()
    sidecar_ports = {p["name"] for p in sidecar["ports"]} | {p["containerPort"]
                                                             for p in sidecar["ports"]}
    for c in (sidecar, server):
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            get = (c.get(probe) or {}).get("httpGet")
            assert get is None or get["port"] not in sidecar_ports, (c["name"], probe)
    assert "exec" in server["livenessProbe"]
    assert spec["automountServiceAccountToken"] is False
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    assert token in {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert token not in {m["mountPath"] for m in server["volumeMounts"]}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar["env"]
           if "valueFrom" in e}
    assert env == {evict.POD_NAME_ENV: "metadata.name",
                   evict.POD_NAMESPACE_ENV: "metadata.namespace"}


def _liveness(marker: str) -> int:
    _, server = containers()
    argv = [a.replace(MARKER, marker) for a in server["livenessProbe"]["exec"]["command"]]
    assert argv[0] == "sh" and argv != server["livenessProbe"]["exec"]["command"]
    return subprocess.run(argv, timeout=30).returncode


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[19]  # field 22


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_the_liveness_backstop_fails_only_while_the_requesting_process_lives(tmp_path):
    marker = str(tmp_path / "restart-requested")
    assert _liveness(marker) == 0                                  # no request
    with restart_requester(marker) as asker:                       # the agent's own request
        assert _liveness(marker) != 0                              # asked, still running
        pid, ticks = open(marker).read().split()[:2]
        with open(marker, "w") as fh:                              # same pid, other process
            fh.write(f"{pid} {int(ticks) + 1}\n")
        assert _liveness(marker) == 0
        for junk in ("", "drain\n", "12ab 34\n", f"{pid}\n", "* *\n"):  # malformed
            with open(marker, "w") as fh:
                fh.write(junk)
            assert _liveness(marker) == 0, junk
        with open(marker, "w") as fh:
            fh.write(f"{pid} {ticks}")                             # no newline: still read
        assert _liveness(marker) != 0
        # forged: a live process that did not write the file (a sleep, pid 1) runs on for
        # ever; the probe would fail for ever, restarting a healthy server every minute
        other = subprocess.Popen(["sleep", "60"])
        try:
            for forged in (f"{other.pid} {_start_time(other.pid)}\n", f"1 {_start_time(1)}\n"):
                with open(marker, "w") as fh:
                    fh.write(forged)
                assert _liveness(marker) == 0, forged
        finally:
            other.kill()
            other.wait()
        assert asker.poll() is None
    # the process that asked is gone (the container restarted, the file outlived it)
    with open(marker, "w") as fh:
        fh.write(f"{pid} {ticks}\n")
    assert _liveness(marker) == 0


# -- the sidecar's config ----------------------------------------------------------------------
def _sidecar_config(file: str, kind_doc: str = "ConfigMap") -> dict:
    docs = [d for d in manifests()[file] if d["kind"] == kind_doc]
    return yaml.safe_load(docs[0]["data"]["watchdog.yaml"])


@pytest.mark.parametrize("file", ["configmap.yaml", "fleet/configmap.yaml",
                                  "node/daemonset.yaml"])
def test_each_configmap_is_a_valid_sidecar_config(file):
    data = _sidecar_config(file)
    problems = []
    try:
        sidecar_config.from_mapping(data)
    except sidecar_config.ConfigError as e:
        problems = e.problems
    if "agent" not in sidecar_config.RELOAD_METHODS:  # the drain method lands separately
        problems = [p for p in problems if not (p.startswith("reload.method")
                                                and "'agent'" in p)]
    assert problems == []


def test_agent_is_the_default_reload_and_fleet_mode_changes_only_that():
    base, fleet = _sidecar_config("configmap.yaml"), _sidecar_config("fleet/configmap.yaml")
    assert base["reload"] == {"method": "agent"}
    assert fleet["reload"] == {"method": "evict"}
    assert {**fleet, "reload": base["reload"]} == base
    assert one("ConfigMap", "fleet/configmap.yaml")["metadata"] == \
        one("ConfigMap", "configmap.yaml")["metadata"]  # applying it replaces the default
    assert _sidecar_config("node/daemonset.yaml")["gpu"]["attribution"] == "process"
    node = one("DaemonSet", "node/daemonset.yaml")["spec"]["template"]["spec"]
    assert node["hostPID"] is True


# -- fleet mode: PodDisruptionBudget and RBAC ---------------------------------------------------
def test_fleet_mode_budget_and_rbac_cover_the_pod():
    labels = one("Deployment", "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    pdb = one("PodDisruptionBudget", "fleet/pdb.yaml")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    role = one("Role", "fleet/rbac.yaml")
    rules = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert rules == {("pods/eviction", "create"), ("pods", "get")}
    binding = one("RoleBinding", "fleet/rbac.yaml")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = one("ServiceAccount", "serviceaccount.yaml")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert pod_spec()["serviceAccountName"] == account


# -- monitoring: PodMonitor and PrometheusRule -------------------------------------------------
def test_the_podmonitor_scrapes_the_sidecar_as_job_torch_watchdog():
    monitor = one("PodMonitor", "podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    labels = one("Deployment", "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    sidecar, _ = containers()
    port = {p["name"]: p["containerPort"] for p in sidecar["ports"]}[endpoint["port"]]
    cfg = _sidecar_config("configmap.yaml")
    assert port == cfg["metrics_port"] and cfg["metrics_address"] == "0.0.0.0"
    job = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert job == [{"targetLabel": "job", "replacement": "torch-watchdog"}]  # the rules' job


def test_the_prometheusrule_is_generated_from_the_shipped_rules():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "generate_prometheusrule", os.path.join(DEPLOY, "generate_prometheusrule.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    with open(os.path.join(DEPLOY, "prometheusrule.yaml")) as fh:
        shipped = fh.read()
    assert shipped == gen.render(), ("deploy/kubernetes/prometheusrule.yaml is out of date: "
                                     "run deploy/kubernetes/generate_prometheusrule.py")
    rule = one("PrometheusRule", "prometheusrule.yaml")
    with open(os.path.join(ROOT, "config", "prometheus", "torch-watchdog-rules.yml")) as fh:
        assert rule["spec"] == {"groups": yaml.safe_load(fh)["groups"]}


def test_promtool_accepts_the_embedded_rules_and_their_unit_tests_pass(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (.ci/run installs it)")
    rule = one("PrometheusRule", "prometheusrule.yaml")
    # the embedded rules, under the name the shipped unit tests load
    (tmp_path / "torch-watchdog-rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    shutil.copy(os.path.join(ROOT, "config", "prometheus", "torch-watchdog-rules.test.yml"),
                tmp_path)
    for args in (["check", "rules", "torch-watchdog-rules.yml"],
                 ["test", "rules", "torch-watchdog-rules.test.yml"]):
        r = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


# -- the evict reload, through the real kubernetes client --------------------------------------
class FakeApiServer:
    """The API server's eviction endpoint on loopback: answers each POST with the next of
    `statuses` and records what was asked."""

    def __init__(self, statuses: list[int]):
        self.statuses = list(statuses)
        self.requests: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.command, self.path, body))
                status = outer.statuses.pop(0)
                if status == 201:
                    reply = {"kind": "Status", "apiVersion": "v1", "status": "Success"}
                else:
                    reply = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "code": status, "reason": "TooManyRequests",
                             "message": "Cannot evict pod as it would violate the pod's "
                                        "disruption budget."}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        if self.thread.is_alive():
            self.httpd.shutdown()
            self.httpd.server_close()


@pytest.fixture
def api():
    pytest.importorskip("kubernetes")
    servers = []

    def make(statuses):
        from kubernetes import client
        server = FakeApiServer(statuses)
        servers.append(server)
        conf = client.Configuration(host=server.url)
        return server, client.ApiClient(conf)

    yield make
    for s in servers:
        s.close()


def test_evict_201_is_a_reload_done_and_429_is_not_done(api):
    server, api_client = api([201, 429])
    env = {"POD_NAME": "inference-server-7d9f-abcde", "POD_NAMESPACE": "serving"}
    run = evict.executor(10.0, environ=env, api_client=api_client)
    first, second = run({123}), run({123})
    assert first.ok and "serving/inference-server-7d9f-abcde" in first.detail
    assert not second.ok and second.detail == evict.NOT_NOW
    assert second.retry_after_s == evict.RETRY_AFTER_S and first.retry_after_s is None
    path = "/api/v1/namespaces/serving/pods/inference-server-7d9f-abcde/eviction"
    assert [(m, p) for m, p, _ in server.requests] == [("POST", path)] * 2
    body = server.requests[0][2]
    assert body["kind"] == "Eviction" and body["apiVersion"] == "policy/v1"
    assert body["metadata"] == {"name": "inference-server-7d9f-abcde", "namespace": "serving"}


def test_evict_without_rbac_says_what_is_missing(api):
    _, api_client = api([403])
    outcome = evict.evict("p", "ns", 10.0, api_client)
    assert not outcome.ok and "pods/eviction" in outcome.detail


def test_evict_with_the_api_server_unreachable_fails_with_a_reason(api):
    server, api_client = api([])
    server.close()  # nothing listens there any more
    outcome = evict.evict("p", "ns", 2.0, api_client)
    assert not outcome.ok and outcome.detail.startswith("eviction failed")
    assert outcome.seconds < 30


def test_evict_outside_a_pod_fails_with_a_reason_and_never_raises(monkeypatch):
    pytest.importorskip("kubernetes")
    run = evict.executor(1.0, environ={})
    outcome = run(set())
    assert not outcome.ok and "POD_NAME" in outcome.detail
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    outcome = evict.evict("p", "ns", 1.0)  # in-cluster config: there is none here
    assert not outcome.ok and outcome.detail.startswith("eviction failed")


def test_reload_method_evict_is_configurable_and_dispatched(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    cfg = sidecar_config.from_mapping({"reload": {"method": "evict"}})
    outcome = executors.executor(cfg.reload, None)(set())
    assert not outcome.ok and "POD_NAME" in outcome.detail  # the evict executor, outside a pod
