"""Label, annotation and name conventions shared by the operator, the webhook and the chart.

They live in one module because three parties must agree on them byte for byte: the webhook
stamps them on trainer pods, the operator groups pods by them, and the coordinator selects its
targets with them (docs/kubernetes.md lists them for operators of the cluster).
"""

from __future__ import annotations

import hashlib
import re

GROUP = "gpulens.dev"
VERSION = "v1alpha1"
PLURAL = "capturecoordinators"
KIND = "CaptureCoordinator"
API_VERSION = f"{GROUP}/{VERSION}"

# On trainer pods (set by the webhook or by the documented snippet).
ARMED = "gpulens.dev/armed"                         # "true": the operator gives its job a coordinator
JOB = "gpulens.dev/job"                             # job id (GPULENS_JOB_ID); optional when the pod has an owner job
ATTEMPT = "gpulens.dev/attempt"                     # attempt number (GPULENS_ATTEMPT); default 0
ARM_OPT_OUT = "gpulens.dev/arm"                     # "false" on a pod: the webhook leaves it alone
LOCAL_WORLD_SIZE = "gpulens.dev/local-world-size"   # annotation: worker processes per pod
WORLD_SIZE = "gpulens.dev/world-size"               # annotation: worker processes in the job (optional)
BASE_RANK = "gpulens.dev/base-rank"                 # annotation: global rank of the pod's local rank 0 (optional)
CONTAINERS = "gpulens.dev/containers"               # annotation: comma list of containers to arm (default: the first)
SERVING = "gpulens.dev/serving"                     # set by the webhook on serving pods: Deployment, StatefulSet or LeaderWorkerSet
ARM_OPT_IN = "true"                                 # gpulens.dev/arm=true on a serving pod template: arm this workload

# On namespaces: the webhook only runs where this is set (opt-in per namespace).
NAMESPACE_ARMING = "gpulens.dev/arming"
NAMESPACE_ARMING_VALUE = "enabled"
# On namespaces: also arm every serving workload's pods here (a second webhook entry selects it).
NAMESPACE_SERVING = "gpulens.dev/serving"

# On objects the operator creates.
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "app.kubernetes.io/name"
COORDINATOR_OF = "gpulens.dev/coordinator"          # the CaptureCoordinator an object belongs to
MANAGER = "gpulens-operator"

# Labels other controllers put on the pods they create.
BATCH_JOB_NAME = "batch.kubernetes.io/job-name"
LEGACY_JOB_NAME = "job-name"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
JOBSET_RESTART = "jobset.sigs.k8s.io/restart-attempt"
PYTORCHJOB_NAME = "training.kubeflow.org/job-name"
POD_TEMPLATE_HASH = "pod-template-hash"             # Deployment -> ReplicaSet -> pods: the revision
CONTROLLER_REVISION_HASH = "controller-revision-hash"   # StatefulSet pods: the ControllerRevision's name
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_REVISION = "leaderworkerset.sigs.k8s.io/template-revision-hash"
SERVING_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")

_LABEL_VALUE = re.compile(r"\A(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_DNS_INVALID = re.compile(r"[^a-z0-9-]+")


def is_label_value(value: str) -> bool:
    return len(value) <= 63 and bool(_LABEL_VALUE.fullmatch(value))


def dns_name(*parts: str, max_len: int = 63) -> str:
    """A DNS-1035 label from `parts` joined by '-': lower case, at most `max_len` characters.

    A name that had to change (case, characters, length) gets a short hash of the original, so
    two jobs whose names sanitize alike still get distinct objects.
    """
    raw = "-".join(parts)
    clean = _DNS_INVALID.sub("-", raw.lower()).strip("-") or "x"
    if not clean[0].isalpha():
        clean = "g-" + clean
    if clean == raw and len(clean) <= max_len:
        return clean
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return f"{clean[: max_len - 9].rstrip('-')}-{digest}"


def coordinator_name(job_id: str, attempt: int) -> str:
    """The CaptureCoordinator (and its Pod) for one (job, attempt)."""
    return dns_name("gpulens", job_id, f"a{attempt}")


def service_name(job_id: str) -> str:
    """One stable Service per job: the gateway's URL template needs only (namespace, job)."""
    return dns_name("gpulens", job_id)
