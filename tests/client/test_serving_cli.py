"""`gpulens capture start` on a serving workload through a gateway that knows no pods, as the chart's
gateway in a cluster (a URL template, no `gpulens up` routes file): issue 43 item 12. The CLI names
the workload and the replica; the gateway tells the revision from the Deployment pod's name, and
the coordinator captures that replica and its peers. A real CLI subprocess, the real gateway and a
real serving coordinator (its agent a double)."""

from __future__ import annotations

import pytest

from gpulens.capture.gateway import Router
from tests.client.test_cli import cli
from tests.gateway.conftest import GATEWAY_TOKEN, http  # noqa: F401  (fixture)
from tests.gateway.test_serving import REV, serving_stack

REPLICA = f"{REV}-x2x9z"


@pytest.fixture
async def cluster_gateway(tmp_path, http):  # noqa: F811
    """Routes by template only, every job to the one coordinator (the chart's `{service}` template
    resolves through cluster DNS, which a test on loopback does not have)."""
    async with serving_stack(tmp_path, http, router=lambda curl: Router(template=curl)) as s:
        yield s


async def test_a_replica_and_its_peer_from_the_cli_through_a_gateway_without_a_pod_map(cluster_gateway):
    url, gw, c = cluster_gateway
    code, out, err = await cli("start", "--namespace", "serve", "--workload", "Deployment/web", "--pod", REPLICA,
                               "--peers", "1", "--duration-ms", "200", "--wait", token=GATEWAY_TOKEN, url=url)
    assert code == 0, (out, err)
    rec = c.captures[out.split()[0]]
    assert rec.request.job_id == REV and rec.request.pods == (REPLICA,) and rec.request.peers == 1
    pods = sorted(p.target.pod for p in rec.targets.values())
    assert len(pods) == 2 and REPLICA in pods and all(p.startswith(f"{REV}-") for p in pods), pods
    assert rec.fully_succeeded


async def test_routing_by_pod_alone_says_to_name_the_workload(cluster_gateway):
    """What the issue met: `--pod` alone through such a gateway; the pod map it needs is not there."""
    url, gw, c = cluster_gateway
    code, out, err = await cli("start", "--namespace", "serve", "--pod", REPLICA, token=GATEWAY_TOKEN, url=url)
    assert code == 2 and "belongs to no known job" in err and "--workload Deployment/NAME" in err, err
    assert c.captures == {}


@pytest.mark.parametrize("args, says", [
    (["--peers", "1", "--job", REV], "--peers needs --pod"),
    (["--pod", REPLICA, "--replicas", "2", "--workload", "Deployment/web"], "with --pod use --peers"),
    (["--workload", "Deployment/web"], "--workload needs --pod"),
])
async def test_serving_flags_that_do_not_go_together_are_refused_before_sending(cluster_gateway, args, says):
    url, gw, c = cluster_gateway
    code, out, err = await cli("start", "--namespace", "serve", *args, token=GATEWAY_TOKEN, url=url)
    assert code == 2 and says in err, err
    assert c.captures == {}


async def test_n_replicas_of_a_revision_from_the_cli(cluster_gateway):
    url, gw, c = cluster_gateway
    code, out, err = await cli("start", "--namespace", "serve", "--job", REV, "--replicas", "3", "--duration-ms",
                               "200", "--wait", token=GATEWAY_TOKEN, url=url)
    assert code == 0, (out, err)
    rec = c.captures[out.split()[0]]
    assert rec.request.replicas == 3 and len({p.target.pod for p in rec.targets.values()}) == 3
