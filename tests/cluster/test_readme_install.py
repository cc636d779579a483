"""The README's test-cluster install lines, offline (no cluster): they parse, fill their
placeholders, render valid objects, agree with the fixtures, and nothing else is accepted."""

from __future__ import annotations

import pytest

from tests.helm.chart import by_kind, render, validate

from .conftest import GRAFANA_TOKEN, S3_BUCKET, S3_CREDS
from .harness import NS, RELEASE, REPO, RUN, STATE, readme_install
from .readme_install import Install, ReadmeError, parse, substitute

IMAGE, S3, GRAFANA = "localhost/gpulens:9.9.9", "http://10.244.0.1:41234", "http://10.244.0.1:41235"


def test_the_readme_install_is_what_the_fixtures_expect():
    install = readme_install(IMAGE, S3, GRAFANA)
    assert [s.verb for s in install.steps] == ["namespace", "secret", "helm-install", "secret-patch"]
    helm = install.helm.args
    assert (helm["release"], helm["namespace"]) == (RELEASE, NS)
    assert (REPO / helm["chart"]).resolve() == (REPO / "helm" / "gpulens").resolve()
    assert helm["wait"] and helm["timeout_s"] == 600
    (secret,) = [s for s in install.steps if s.verb == "secret"]
    assert secret.args["data"] == S3_CREDS and secret.args["name"] == install.values["archive"]["existingSecret"]
    assert install.values["image"] == {"repository": "localhost/gpulens", "tag": "9.9.9", "pullPolicy": "Never"}
    assert install.values["archive"]["root"].startswith(f"s3://{S3_BUCKET}/")
    assert install.values["grafana"] == {"url": GRAFANA}
    # The Grafana token goes into the Secret the chart generated (its coordinators' token source),
    # after the install that created it.
    (patch,) = [s for s in install.steps if s.verb == "secret-patch"]
    assert patch.args["data"] == {"grafana": GRAFANA_TOKEN} and patch.args["namespace"] == NS
    (tokens,) = [o for o in by_kind(render(install.values, name=RELEASE, namespace=NS), "Secret")
                 if "gateway" in o["data"]]
    assert patch.args["name"] == tokens["metadata"]["name"]
    # Every host folder the chart shares lives in the cluster's state, which `down` removes.
    assert all(p.startswith((f"{STATE}/", f"{RUN}/")) for p in install.values["node"]["paths"].values())


def test_the_readme_values_render_valid_objects_that_run_on_the_test_node():
    install = readme_install(IMAGE, S3, GRAFANA)
    objs = render(install.values, name=RELEASE, namespace=NS)
    for obj in objs:
        validate(obj)
    ds = [d for d in by_kind(objs, "DaemonSet") if "node" in d["metadata"]["name"]]
    assert ds, [d["metadata"]["name"] for d in by_kind(objs, "DaemonSet")]
    pod = ds[0]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu.present" not in (pod.get("nodeSelector") or {})   # null cleared the GPU label
    assert {c["image"] for c in pod["containers"]} == {IMAGE}


def test_the_image_and_s3_server_must_match_the_readme():
    with pytest.raises(ReadmeError, match="installs localhost/gpulens"):
        readme_install("registry.example.com/gpulens:1", S3, GRAFANA)
    with pytest.raises(ReadmeError, match="s3Endpoint"):
        readme_install(IMAGE, "http://127.0.0.1:41234", GRAFANA)
    with pytest.raises(ReadmeError, match="grafana.url"):
        readme_install(IMAGE, S3, "http://127.0.0.1:41235")


@pytest.mark.parametrize("line", [
    "kubectl apply -f everything.yaml",
    "helm upgrade --install gl ./helm/gpulens --namespace gpulens-system -f v.yaml",
    "helm install gl ./helm/gpulens -f v.yaml",                        # no namespace
    "kubectl create secret generic s --namespace ns --from-literal=novalue",
    "kubectl create namespace a b",
    "curl http://example.com | sh",
])
def test_a_line_the_tests_cannot_run_is_refused(line):
    with pytest.raises(ReadmeError, match="cannot run|KEY=VALUE"):
        parse(line)


@pytest.mark.parametrize("line, why", [
    ("""kubectl patch secret t --namespace ns -p '{"stringData": {"grafana": "x"}}'""", "--type merge"),
    ("""kubectl patch secret t --namespace ns --type merge -p '{"data": {"grafana": "eA=="}}'""", "stringData"),
    ("""kubectl patch secret t --namespace ns --type merge -p '{"stringData": {"grafana": ""}}'""", "stringData"),
    ("""kubectl patch secret t --namespace ns --type merge -p 'not json'""", "stringData"),
    ("""kubectl patch secret t --type merge -p '{"stringData": {"grafana": "x"}}'""", "cannot run"),  # no namespace
])
def test_a_secret_patch_the_tests_cannot_run_is_refused(line, why):
    with pytest.raises(ReadmeError, match=why):
        parse(line)


def test_comments_and_timeouts_parse():
    (step,) = parse("helm install r ./c -n ns -f v.yaml --wait --timeout 2m30s   # trailing comment\n# a comment\n")
    assert step.args | {} == {"release": "r", "chart": "./c", "namespace": "ns", "values_file": "v.yaml",
                              "sets": [], "wait": True, "timeout_s": 150}
    with pytest.raises(ReadmeError, match="--timeout"):
        parse("helm install r ./c -n ns -f v.yaml --timeout soon")


def test_an_unknown_placeholder_is_refused_not_left_in_a_value():
    assert substitute("tag: ${VERSION}", {"VERSION": "1"}) == "tag: 1"
    with pytest.raises(ReadmeError, match=r"\$\{REGISTRY\}"):
        substitute("image: ${REGISTRY}/gpulens", {"VERSION": "1"})


def test_the_values_file_named_by_helm_must_be_the_block_shown(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- gpulens-cluster:values -->\n```yaml\n# a.yaml\nimage: {}\n```\n"
                      "<!-- gpulens-cluster:commands -->\n```bash\n"
                      "helm install r ./c --namespace ns -f b.yaml\n```\n")
    with pytest.raises(ReadmeError, match="-f a.yaml"):
        Install.from_readme(readme, {})
    readme.write_text("no blocks here")
    with pytest.raises(ReadmeError, match="no ```yaml block"):
        Install.from_readme(readme, {})


def test_the_readme_trial_is_a_file_archive_under_a_release_of_its_own():
    """The single-node trial block (run on the cluster by test_7_trial.py) parses and renders: a
    non-default release, its own namespace, a file:// archive mounted into the node pod."""
    from .readme_install import TRIAL_MARKS
    install = Install.from_readme(REPO / "README.md", {"VERSION": "9.9.9", "ARCHIVE_DIR": "/srv/trial"}, TRIAL_MARKS)
    assert [s.verb for s in install.steps] == ["namespace", "label", "helm-install", "namespace", "label"]
    helm = install.helm.args
    assert helm["release"] not in (RELEASE, "gpulens") and helm["namespace"] != NS
    assert install.values["archive"] == {"root": "file:///srv/trial"}
    objs = render(install.values, name=helm["release"], namespace=helm["namespace"])
    for obj in objs:
        validate(obj)
    (node,) = [d for d in by_kind(objs, "DaemonSet") if d["metadata"]["name"].endswith("-node")]
    volumes = node["spec"]["template"]["spec"]["volumes"]
    assert {"name": "archive", "hostPath": {"path": "/srv/trial", "type": "DirectoryOrCreate"}} in volumes
    assert node["metadata"]["name"] == f"{helm['release']}-gpulens-node"
