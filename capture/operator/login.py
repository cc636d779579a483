"""In-cluster login for kopf that addresses the API the way the kubernetes clients do.

kopf's own service-account login hard-codes https://kubernetes.default.svc, which needs cluster
DNS for the apiserver's Service; every official client instead uses the KUBERNETES_SERVICE_HOST
and KUBERNETES_SERVICE_PORT variables the kubelet puts in every pod. The token is re-read on every
call (kopf re-logs in on 401), because projected tokens rotate.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Mapping

import kopf

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The priority kopf gives its own service-account login (above a kubeconfig's).
PRIORITY = 20

__all__ = ["in_cluster_server", "login_in_cluster"]


def in_cluster_server(env: Mapping[str, str]) -> str | None:
    """The API URL from the pod's environment, or None outside a pod (either variable missing)."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", "").strip(), env.get("KUBERNETES_SERVICE_PORT", "").strip()
    if not host or not port:
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"KUBERNETES_SERVICE_PORT is not a port: {port!r}")
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass                                   # a host name: used as is
    return f"https://{host}:{int(port)}"


def login_in_cluster(*, env: Mapping[str, str], sa_dir: Path = SA_DIR,
                     settings: kopf.OperatorSettings | None = None, **_: Any) -> kopf.ConnectionInfo | None:
    """ConnectionInfo from the pod's service account; None when not in a pod (no token or no env)."""
    server = in_cluster_server(env)
    token_path = sa_dir / "token"
    if server is None or not token_path.is_file():
        return None
    token = token_path.read_text(encoding="utf-8").strip()
    ns_path, ca_path = sa_dir / "namespace", sa_dir / "ca.crt"
    return kopf.ConnectionInfo(
        server=server,
        ca_path=str(ca_path) if ca_path.is_file() else None,
        token=token or None,
        default_namespace=(ns_path.read_text(encoding="utf-8").strip() or None) if ns_path.is_file() else None,
        trust_env=settings.networking.trust_env if settings is not None else False,
        priority=PRIORITY,
    )
