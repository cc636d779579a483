"""The operator's in-cluster login addresses the API by KUBERNETES_SERVICE_HOST/PORT (no DNS needed)."""

from __future__ import annotations

import pytest

from gpulens.capture.operator.login import in_cluster_server, login_in_cluster


@pytest.fixture
def sa_dir(tmp_path):
    (tmp_path / "token").write_text("tok-1\n")
    (tmp_path / "namespace").write_text("gpulens-system\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return tmp_path


ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def test_uses_service_env_not_kubernetes_default_svc(sa_dir):
    info = login_in_cluster(env=ENV, sa_dir=sa_dir)
    assert info is not None
    assert info.server == "https://10.96.0.1:443"
    assert "kubernetes.default" not in info.server
    assert info.token == "tok-1" and info.default_namespace == "gpulens-system"
    assert info.ca_path == str(sa_dir / "ca.crt")


def test_token_reread_on_every_login(sa_dir):
    assert login_in_cluster(env=ENV, sa_dir=sa_dir).token == "tok-1"
    (sa_dir / "token").write_text("tok-2")
    assert login_in_cluster(env=ENV, sa_dir=sa_dir).token == "tok-2"


def test_ipv6_host_bracketed():
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}) == "https://[fd00::1]:6443"


@pytest.mark.parametrize("env", [{}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, {"KUBERNETES_SERVICE_PORT": "443"}])
def test_not_in_a_pod_gives_none(sa_dir, env):
    assert login_in_cluster(env=env, sa_dir=sa_dir) is None


def test_no_token_gives_none(tmp_path):
    assert login_in_cluster(env=ENV, sa_dir=tmp_path) is None


@pytest.mark.parametrize("port", ["https", "0", "70000", "443/tcp"])
def test_bad_port_is_a_clear_error(port):
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_PORT"):
        in_cluster_server({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": port})
