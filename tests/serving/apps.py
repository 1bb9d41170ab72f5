"""What the serving tests share besides the apps themselves (tests/serving/conftest.py): their names
and keys, and small readers of what they answer."""
from __future__ import annotations

import httpx

API_KEY = "test-key"            # the main app's (HTTP and gRPC)
TENANT, TENANT_KEY = "team-a", "team-a-key"     # a tenant of the main app, 3 requests per minute
MAIN, LIMITED = "pdserve-test", "pdserve-limited"
PAGE_ORIGIN = "http://chat.example:3000"      # the one origin the limited app's CORS allows


def auth() -> dict[str, str]:
    """The main app's Authorization header."""
    return {"Authorization": f"Bearer {API_KEY}"}


def grpc_metadata(app: str = MAIN, key: str | None = API_KEY) -> list[tuple[str, str]]:
    """gRPC metadata for `app` (Serve's proxy routes by app when several are deployed), with a key."""
    md = [("application", app)]
    if key is not None:
        md.append(("authorization", f"Bearer {key}"))
    return md


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`, in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def gauge(base: str, name: str) -> float:
    """The sum of a gauge's samples on an app's /metrics."""
    text = httpx.get(f"{base}/metrics", headers=auth(), timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))
