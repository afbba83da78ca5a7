"""Membership's part of the fleet file, and where the Kubernetes API is (the only module reading the env).

``membership:`` reloads the fleet file (``reload``, ``reload_interval_s``) and bounds a leaving
instance's drain (``drain_timeout_s``).  ``discovery:`` finds instances through the Kubernetes API: the
EndpointSlices of a ``service`` or the pods of an InferencePool (``pool``), in ``namespace``, with
``http_port``, ``events_port`` (a port name or number; null: ask each instance's
``GET /kv_event_sources``), ``replay_port`` and ``dp_size``; docs/configuration.md lists every field.

Data-parallel size: an EndpointSlice carries its Service's labels but no annotations, so the size is
read from the label ``dp_size_label`` on the Service (no RBAC beyond list/watch of EndpointSlices, and a
relabelled Service is followed through MODIFIED events); ``dp_size`` overrides it, and a pool reads the
same label on each pod.  All pods of one Service share one size.

Where the API server is: ``api_url`` (with a token file and CA), else in a pod the service account, else a
kubeconfig and context (``kubeconfig`` / ``context``, ``$KUBECONFIG``, ``~/.kube/config``).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from pathlib import Path

import msgspec

from indexer.errors import ConfigError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class MembershipConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reload: bool = True
    """Watch the fleet file and apply changes to ``instances`` while running (other sections: restart)."""
    reload_interval_s: float = 1.0
    """How often the fleet file is read and hashed."""
    drain_timeout_s: float = 30.0
    """A leaving instance gets this long for its in-flight requests to finish before it is dropped."""

    def validate(self) -> None:
        if self.reload_interval_s <= 0 or self.drain_timeout_s < 0:
            raise ConfigError("membership: reload_interval_s must be > 0 and drain_timeout_s >= 0")


class DiscoveryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    service: str | None = None
    """The vLLM Service whose EndpointSlices are watched (label ``kubernetes.io/service-name``)."""
    pool: str | None = None
    """Or: the InferencePool (``inference.networking.k8s.io/v1``) whose selected pods are the fleet."""
    namespace: str | None = None
    """Its namespace; default: the router's own (from the service account)."""
    api_url: str | None = None
    """The API server; default: in-cluster, ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``."""
    token_file: str | None = None
    """Bearer token file, re-read on every request (kubelet rotates it); default: the service account's."""
    ca_file: str | None = None
    """CA bundle for the API server; default: the service account's ``ca.crt``."""
    insecure_skip_tls_verify: bool = False
    """Do not verify the API server's certificate (test clusters only)."""
    kubeconfig: str | None = None
    """A kubeconfig file, for a router outside the cluster (``api_url`` unset, not in a pod)."""
    context: str | None = None
    """The kubeconfig context; default: its current context."""
    http_port: str | int = "http"
    """The OpenAI server's port: a port name in the EndpointSlice, or a number."""
    events_port: str | int | None = "kv-events"
    """vLLM's KV-event publisher port (name or number); None: route by load only."""
    replay_port: str | int | None = "kv-replay"
    """vLLM's replay ROUTER port (name or number); None: no replay."""
    dp_size: int | None = None
    """Data-parallel ranks per pod; None: the slice label ``dp_size_label``, or 1."""
    dp_size_label: str = "kvrouter.io/dp-size"
    """Service label (copied onto its EndpointSlices) giving the data-parallel size."""
    topic: str = ""
    """Subscription prefix for every discovered instance."""
    models: list[str] = []
    """Models every discovered instance serves; empty: whatever its /v1/models says."""
    weight: float = 1.0
    """Relative capacity of every discovered instance."""
    page_size: int = 500
    """LIST page size (``limit``); continued with the ``continue`` token."""
    watch_timeout_s: int = 300
    """``timeoutSeconds`` of each WATCH; the server ends it then and we resume from the last version."""
    backoff_min_s: float = 0.5
    """First retry delay after an API error; doubles (with jitter) up to ``backoff_max_s``."""
    backoff_max_s: float = 30.0

    @property
    def source(self) -> str:
        """What is watched, for logs and task names: ``service/<name>`` or ``inferencepool/<name>``."""
        return f"service/{self.service}" if self.service else f"inferencepool/{self.pool}"

    def validate(self) -> None:
        if bool(self.service) == bool(self.pool):
            raise ConfigError(
                "discovery: give exactly one of service (EndpointSlices) or pool (InferencePool)"
            )
        if self.context is not None and self.api_url is not None:
            raise ConfigError("discovery: context is a kubeconfig's; it cannot go with api_url")
        for label, p in (
            ("http", self.http_port),
            ("events", self.events_port),
            ("replay", self.replay_port),
        ):
            if isinstance(p, int) and not 0 < p < 65536:
                raise ConfigError(f"discovery.{label}_port out of range: {p}")
            if isinstance(p, str) and not p:
                raise ConfigError(f"discovery.{label}_port: empty port name")
        if self.dp_size is not None and self.dp_size < 1:
            raise ConfigError("discovery.dp_size must be >= 1")
        if self.page_size < 1 or self.watch_timeout_s < 1:
            raise ConfigError("discovery: page_size and watch_timeout_s must be >= 1")
        if not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ConfigError("discovery: need 0 < backoff_min_s <= backoff_max_s")


class KubeConnection(msgspec.Struct, frozen=True):
    """Where and how to reach the API server (resolved once, at startup)."""

    base_url: str
    """``https://host:port`` (or ``http://`` for a local fake), no trailing slash; empty with a kubeconfig
    (its context names the server)."""
    namespace: str
    """Namespace of the watched Service or pool; empty with a kubeconfig: the context's, else ``default``."""
    token: str | None = None
    """A fixed bearer token (tests); ``token_file`` wins when both are set."""
    token_file: str | None = None
    """Bearer token file, read on every request."""
    ca_file: str | None = None
    verify: bool = True
    kubeconfig: str | None = None
    """Connect as this kubeconfig says (server, credentials, exec plugins) instead of the fields above."""
    context: str | None = None

    def bearer(self) -> str | None:
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip() or None
            except OSError:
                return self.token
        return self.token

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What aiohttp takes as ``ssl=``: True (system CAs), False (no verification) or a context."""
        if not self.base_url.startswith("https://"):
            return True
        if not self.verify:
            return False
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else True


def kube_connection(
    cfg: DiscoveryConfig,
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> KubeConnection:
    """Resolve ``cfg`` against the in-cluster environment (service account files, service env vars)."""
    env = os.environ if env is None else env
    base = cfg.api_url
    in_pod = bool(env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT"))
    if base is None and (cfg.kubeconfig or cfg.context or not in_pod):
        path = cfg.kubeconfig or _default_kubeconfig(env)
        if path is None:
            raise ConfigError(
                "discovery: no api_url, not in a cluster (KUBERNETES_SERVICE_HOST unset) and no kubeconfig"
            )
        return KubeConnection("", cfg.namespace or "", kubeconfig=path, context=cfg.context)
    if base is None:
        host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
        base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    namespace = cfg.namespace
    if namespace is None:
        try:
            namespace = (sa_dir / "namespace").read_text().strip()
        except OSError:
            raise ConfigError("discovery: no namespace and no service account namespace file") from None
    token_file = cfg.token_file
    if token_file is None and (sa_dir / "token").exists():
        token_file = str(sa_dir / "token")
    ca = cfg.ca_file
    if ca is None and (sa_dir / "ca.crt").exists():
        ca = str(sa_dir / "ca.crt")
    return KubeConnection(
        base.rstrip("/"),
        namespace,
        token_file=token_file,
        ca_file=ca,
        verify=not cfg.insecure_skip_tls_verify,
    )


def _default_kubeconfig(env: Mapping[str, str]) -> str | None:
    """``$KUBECONFIG`` (its first file), else ``~/.kube/config`` if it exists."""
    first = next((p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p), None)
    if first:
        return first
    home = env.get("HOME")
    config = Path(home) / ".kube" / "config" if home else None
    return str(config) if config is not None and config.exists() else None
