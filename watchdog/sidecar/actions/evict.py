"""Reload method `evict` (Kubernetes fleet mode): ask the API server to evict the sidecar's own
pod, so its Deployment starts a fresh one while the PodDisruptionBudget keeps the rest of the
fleet serving.

The Eviction API, not a delete: an eviction honours the pod's PodDisruptionBudget. With
`maxUnavailable: 1`, replicas that see the same traffic and reach their limit together are
reloaded one at a time: the API server answers 201 to the first and 429 (Too Many Requests)
to the others until the first one's replacement is ready. A 429 is therefore "not done, try
later", never an error to escalate: the outcome is a failed reload, so the policy's cooldown
is the backoff before the next attempt (the forecast decides again then).

The pod is named by the downward API (`POD_NAME`, `POD_NAMESPACE`); credentials come from the
pod's service account (in-cluster config). The `kubernetes` client is an optional dependency
(extra `k8s`), imported only when an eviction is carried out; every failure becomes an
`ReloadOutcome`, never an exception into the sidecar's loop.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Optional

from torch_watchdog.sidecar.core.observations import ReloadOutcome

POD_NAME_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_NAMESPACE"
RETRY_AFTER_S = 10.0   # kubectl drain waits 5 s between eviction attempts; a replica restarts
                       # in tens of seconds
NOT_NOW = ("HTTP 429: the PodDisruptionBudget allows no eviction now (another replica is "
           f"reloading); not done, not counted, asked again in {RETRY_AFTER_S:.0f} s if still "
           "needed")
# What the other answers usually mean, for the operator reading the reload record.
_WHY = {403: "forbidden: the pod's service account needs create on pods/eviction "
             "(deploy/kubernetes/fleet/rbac.yaml)",
        404: "no such pod (POD_NAME / POD_NAMESPACE wrong, or already gone)",
        500: "server error (more than one PodDisruptionBudget selects this pod?)"}


def evict(name: str, namespace: str, timeout_s: float, api_client: Any = None) -> ReloadOutcome:
    """POST an Eviction for pod `namespace/name`. `api_client`: a kubernetes ApiClient (tests
    point one at a local endpoint); None: the in-cluster config of the pod's service account."""
    started = time.monotonic()

    def done(ok: bool, detail: str) -> ReloadOutcome:
        return ReloadOutcome(ok, detail, time.monotonic() - started)

    try:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
    except ImportError:
        return done(False, "the kubernetes package is not installed: pip install "
                           "'torch-compile-watchdog[k8s]'")
    try:
        if api_client is None:
            api_client = _in_cluster(client)
        body = client.V1Eviction(api_version="policy/v1", kind="Eviction",
                                 metadata=client.V1ObjectMeta(name=name, namespace=namespace))
        client.CoreV1Api(api_client).create_namespaced_pod_eviction(
            name=name, namespace=namespace, body=body, _request_timeout=timeout_s)
    except ApiException as e:
        if e.status == 429:
            return ReloadOutcome(False, NOT_NOW, time.monotonic() - started, RETRY_AFTER_S)
        return done(False, f"HTTP {e.status}: {_WHY.get(e.status, e.reason or 'eviction refused')}")
    except Exception as e:  # config, connection, timeout: reported, never raised
        return done(False, f"eviction failed: {type(e).__name__}: {str(e)[:200]}")
    return done(True, f"evicted pod {namespace}/{name}: its Deployment starts a new one")


def _in_cluster(client: Any) -> Any:
    from kubernetes import config

    # ConfigException outside a pod: reported by evict(); the client's loader is untyped
    config.load_incluster_config()  # type: ignore[no-untyped-call]
    return client.ApiClient()


def executor(timeout_s: float, environ: Optional[Mapping[str, str]] = None,
             api_client: Any = None) -> Callable[[set[int]], ReloadOutcome]:
    """The `evict` reload: the pids are not used (the whole pod goes)."""
    env = os.environ if environ is None else environ

    def run(pids: set[int]) -> ReloadOutcome:
        name, namespace = env.get(POD_NAME_ENV), env.get(POD_NAMESPACE_ENV)
        if not name or not namespace:
            return ReloadOutcome(False, f"{POD_NAME_ENV} and {POD_NAMESPACE_ENV} must be set from "
                                  "the downward API (deploy/kubernetes/deployment.yaml)", 0.0)
        return evict(name, namespace, timeout_s, api_client)

    return run
