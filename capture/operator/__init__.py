"""The Kubernetes side of gpulens: one CaptureCoordinator (and coordinator Pod) per armed
(job, attempt), the arming webhook, and Lease-based leader election. The capture hot path never
passes through here (DESIGN.md, "Why one coordinator per job")."""

from .arming import ArmingResult, arm_pod
from .config import ArmingConfig, OperatorConfigError, CoordinatorConfig, LeaderElectionConfig, OperatorConfig, load_config
from .jobs import JobRef, OwnerRef, attempt_of_pod, job_of_pod
from .leadership import LeaseElector, decide
from .planning import JobPlan, group_pods, plan_job

__all__ = [
    "ArmingResult", "arm_pod", "ArmingConfig", "OperatorConfigError", "CoordinatorConfig", "LeaderElectionConfig",
    "OperatorConfig", "load_config", "JobRef", "OwnerRef", "attempt_of_pod", "job_of_pod", "LeaseElector",
    "decide", "JobPlan", "group_pods", "plan_job",
]
