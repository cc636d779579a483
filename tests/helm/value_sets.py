"""Named value sets the chart must render and validate with (defaults included)."""

EVERYTHING = {
    "image": {"repository": "registry.example.com/ml/gpulens", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "commonLabels": {"team": "ml-platform"},
    "tokens": {"existingSecret": "gpulens-tokens-sealed"},
    "archive": {"root": "s3://traces/gpulens", "s3Endpoint": "https://minio.storage.svc:9000",
                "existingSecret": "gpulens-s3"},
    "grafana": {"url": "https://grafana.example.com"},
    "exporter": {"sysAdmin": True, "extraCapabilities": ["SYS_RESOURCE"], "dcgmUrl": "http://127.0.0.1:9400/metrics"},
    "dynolog": {"enabled": True, "image": {"repository": "registry.example.com/dynolog", "tag": "0.6.0"}},
    "operator": {"replicas": 3, "resyncIntervalSeconds": 30},
    "coordinator": {"captureDefaults": {"durationMs": 5000, "activities": ["CPU_OP", "CUDA_RUNTIME", "KERNEL"]},
                    "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/gpulens"},
                    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infra", "effect": "NoSchedule"}]},
    "gateway": {"basicAuthSecret": "alertmanager-basic-auth", "service": {"type": "LoadBalancer"}},
    "monitoring": {"serviceMonitor": {"enabled": True, "additionalLabels": {"release": "kps"}},
                   "podMonitor": {"enabled": True, "interval": "15s", "additionalLabels": {"release": "kps"}},
                   "prometheusRule": {"enabled": True, "additionalLabels": {"release": "kps"},
                                      "runbookBaseUrl": "https://wiki.example.com/gpulens/runbooks"}},
    "dashboards": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "GPU"}},
}

MINIMAL = {
    "operator": {"enabled": False},
    "gateway": {"enabled": False},
    "webhook": {"enabled": False},
    "exporter": {"enabled": False},
    "rbac": {"create": False},
}

CERT_MANAGER = {"webhook": {"tls": {"mode": "certManager",
                                    "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "selfsigned"}}}}}

NO_HOST_NETWORK = {"node": {"hostNetwork": False, "nodeSelector": {"nvidia.com/gpu.present": None,   # Helm merges maps: null removes a default
                                             "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                            "paths": {"registry": "/data/gpulens/reg", "traces": "/data/gpulens/traces",
                                      "sockets": "/run/gl", "state": "/data/gpulens/agent"}},
                   "archive": {"root": "file:///var/lib/gpulens/archive"}}

VALUE_SETS = {"defaults": {}, "everything": EVERYTHING, "minimal": MINIMAL, "cert-manager": CERT_MANAGER,
              "no-host-network": NO_HOST_NETWORK}
