"""The arming snippet in docs/kubernetes.md is a valid Job, and it is exactly what the webhook
adds to the same Job without the gpulens parts."""

from __future__ import annotations

import copy
import re

import jsonpatch
import kubernetes_validate
import yaml

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.arming import HOOK_VOLUME, IMAGE_ENV_CONTAINER, INIT_CONTAINER, arm_pod
from gpulens.capture.operator.config import ArmingConfig
from gpulens.capture.operator.jobs import job_of_pod

from ..helm.chart import REPO
from .test_arming import HOOK_ENV


def snippet(marker: str = "gpulens-arming-snippet") -> dict:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    m = re.search(rf"<!-- {marker} -->\s*```yaml\n(.*?)```", text, re.S)
    assert m, f"no ```yaml block after <!-- {marker} --> in docs/kubernetes.md"
    return yaml.safe_load(m.group(1))


def strip_gpulens(template: dict) -> dict:
    """The same pod template as a user would write it before arming (job id and attempt stay)."""
    t = copy.deepcopy(template)
    meta, spec = t["metadata"], t["spec"]
    meta["labels"].pop(L.ARMED)
    meta["annotations"].pop(L.LOCAL_WORLD_SIZE)
    if not meta["annotations"]:
        del meta["annotations"]
    spec["volumes"] = [v for v in spec.get("volumes", []) if not v["name"].startswith("gpulens-")]
    spec["initContainers"] = [c for c in spec.get("initContainers", []) if c["name"] != INIT_CONTAINER
                              and not c["name"].startswith(IMAGE_ENV_CONTAINER)]
    for key in ("volumes", "initContainers"):
        if not spec[key]:
            del spec[key]
    for c in spec["containers"]:
        c["env"] = [e for e in c.get("env", []) if e["name"] not in HOOK_ENV]
        c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if not m["name"].startswith("gpulens-")]
        for key in ("env", "volumeMounts"):
            if not c[key]:
                del c[key]
    return t


def test_the_snippet_is_a_valid_job():
    job = snippet()
    for version in ("1.27", "1.36"):
        kubernetes_validate.validate(job, version, strict=True)


def test_the_snippet_is_what_the_webhook_injects():
    job = snippet()
    armed_template = job["spec"]["template"]
    bare = strip_gpulens(armed_template)
    assert HOOK_VOLUME not in str(bare) and "GPULENS_" not in str(bare)
    image = next(c for c in armed_template["spec"]["initContainers"] if c["name"] == INIT_CONTAINER)["image"]
    result = arm_pod(bare, job["metadata"]["namespace"], ArmingConfig(), image)
    assert result.patch, result.reason
    assert jsonpatch.apply_patch(bare, result.patch) == armed_template
    # And the armed snippet is recognised as armed and grouped under its label's job id.
    assert arm_pod(armed_template, "ml", ArmingConfig(), image).reason == "already armed"
    assert job_of_pod(armed_template, "ml").job_id == armed_template["metadata"]["labels"][L.JOB]


def test_the_snippet_uses_the_chart_host_folders():
    from ..helm.chart import loaded
    paths = loaded().values["node"]["paths"]
    vols = {v["name"]: v.get("hostPath", {}).get("path") for v in snippet()["spec"]["template"]["spec"]["volumes"]}
    assert vols["gpulens-registry"] == paths["registry"]
    assert vols["gpulens-traces"] == paths["traces"]
    assert vols["gpulens-sockets"] == paths["sockets"]
