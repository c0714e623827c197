"""Small JSON schemas for the custom resources the Helm chart renders (fields it uses).

Not the CRDs themselves (KubeRay, Prometheus Operator and KEDA ship those): enough to catch a
misspelt or mistyped field in our templates, offline. Keyed by (apiVersion, kind).
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string"}
_INT = {"type": "integer"}
_MAP_STR = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "labels": _MAP_STR, "annotations": _MAP_STR},
}
# A pod template: validated in full against the Kubernetes schema by the test itself.
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object",
                                                           "required": ["containers"]}},
}
_RAY_START_PARAMS = _MAP_STR  # KubeRay: every rayStartParams value is a string

_WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams",
                 "template"],
    "additionalProperties": False,
    "properties": {
        "groupName": _STR,
        "replicas": {"type": "integer", "minimum": 0},
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 0},
        "rayStartParams": _RAY_START_PARAMS,
        "template": _POD_TEMPLATE,
    },
}

RAYCLUSTER: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["headGroupSpec", "workerGroupSpecs"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": _STR,
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                        "idleTimeoutSeconds": _INT,
                        "resources": {"type": "object"},
                        "securityContext": {"type": "object"},
                    },
                },
                "headGroupSpec": {
                    "type": "object",
                    "required": ["rayStartParams", "template"],
                    "additionalProperties": False,
                    "properties": {"rayStartParams": _RAY_START_PARAMS,
                                   "template": _POD_TEMPLATE},
                },
                "workerGroupSpecs": {"type": "array", "minItems": 1, "items": _WORKER_GROUP},
            },
        },
    },
}

SERVICEMONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": _STR}},
                },
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": _MAP_STR},
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {"port": _STR, "path": _STR, "interval": _STR},
                    },
                },
            },
        },
    },
}

SCALEDOBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {"apiVersion": _STR, "kind": _STR, "name": _STR},
                },
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "properties": {"type": _STR, "metadata": _MAP_STR},
                    },
                },
            },
        },
    },
}

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("ray.io/v1", "RayCluster"): RAYCLUSTER,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALEDOBJECT,
}
