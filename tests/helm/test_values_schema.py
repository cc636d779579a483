"""values.schema.json is enforced by the render itself: bad values never produce manifests."""

from __future__ import annotations

import pytest
from helm_python import HelmValuesError, HelmRenderError

from .chart import loaded, render

BAD = {
    "typo-at-top-level": ({"exporterr": {"enabled": True}}, "exporterr"),
    "typo-nested": ({"exporter": {"sysadmin": True}}, "sysadmin"),
    "port-as-text": ({"agent": {"port": "abc"}}, "/agent/port"),
    "port-out-of-range": ({"gateway": {"port": 70000}}, "/gateway/port"),
    "archive-not-a-uri": ({"archive": {"root": "my-bucket"}}, "/archive/root"),
    "socket-dir-too-long": ({"node": {"paths": {"sockets": "/run/" + "s" * 60}}}, "/node/paths/sockets"),
    "socket-dir-relative": ({"node": {"paths": {"sockets": "run/gpulens"}}}, "/node/paths/sockets"),
    "unknown-trigger": ({"agent": {"trigger": "magic"}}, "/agent/trigger"),
    "sys-admin-sneaked-in": ({"exporter": {"extraCapabilities": ["SYS_ADMIN"]}}, "/exporter/extraCapabilities"),
    "agent-sys-admin": ({"agent": {"extraCapabilities": ["SYS_ADMIN"]}}, "/agent/extraCapabilities"),
    "failure-policy": ({"webhook": {"failurePolicy": "Maybe"}}, "/webhook/failurePolicy"),
    "tls-mode": ({"webhook": {"tls": {"mode": "self"}}}, "/webhook/tls/mode"),
    "bad-interval": ({"monitoring": {"podMonitor": {"interval": "often"}}}, "/monitoring/podMonitor/interval"),
    "replicas-zero": ({"operator": {"replicas": 0}}, "/operator/replicas"),
    "labels-not-strings": ({"commonLabels": {"team": 7}}, "/commonLabels/team"),
    "nvml-unknown": ({"exporter": {"nvml": "on"}}, "/exporter/nvml"),
    "nvml-stub-relative": ({"exporter": {"nvml": "stub:var/lib/stub"}}, "/exporter/nvml"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_values_that_break_the_schema_are_refused_by_the_render(case):
    values, where = BAD[case]
    with pytest.raises(HelmValuesError) as err:
        render(values)
    assert where in str(err.value)
    with pytest.raises(HelmValuesError):
        loaded().validate_schema(values)


def test_good_values_pass_the_same_check():
    loaded().validate_schema({"agent": {"port": 19451}, "exporter": {"extraCapabilities": ["SYS_RESOURCE"]}})


@pytest.mark.parametrize("values,needle", [
    ({"dynolog": {"enabled": True}}, "dynolog.image.repository"),
    ({"webhook": {"tls": {"mode": "certManager"}}}, "issuerRef.name"),
])
def test_inconsistent_values_fail_with_a_message_that_says_what_to_set(values, needle):
    with pytest.raises(HelmRenderError) as err:
        render(values)
    assert needle in str(err.value)
