"""The topic frame of every published batch: llm-d's `kv@<pod>@<model>` unless configured.

llm-d's KV-cache indexer reads the pod and the model from the topic (its vLLM adapter splits
`<pod>@<model>` after the `kv@` prefix its subscriber filters on), and its guides start vLLM
with `"topic": "kv@$(POD_IP):$(POD_PORT)@<served model>"`: the pod is the address the
scheduler knows the endpoint by. So the pod is, first found:

    kv_events_pod          set in the config: taken as it is
    $POD_IP:<port>         Kubernetes' downward API, as in llm-d's guides
    $POD_NAME              the downward API's pod name
    the host name          a pod's host name is its pod name
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

TOPIC_PREFIX = "kv"


def pod_name(
    configured: str = "", port: int | None = None, env: Mapping[str, str] | None = None
) -> str:
    """Who publishes, as a router should attribute its blocks (module doc)."""
    env = os.environ if env is None else env
    if configured:
        return configured
    if env.get("POD_IP"):
        return f"{env['POD_IP']}:{port}" if port else env["POD_IP"]
    return env.get("POD_NAME") or socket.gethostname()


def default_topic(pod: str, model: str) -> str:
    return f"{TOPIC_PREFIX}@{pod}@{model}"


def resolve_topic(configured: str, pod: str, model: str) -> str:
    """The configured topic, or llm-d's form when none is ("" is not a usable attribution)."""
    return configured or default_topic(pod, model)
