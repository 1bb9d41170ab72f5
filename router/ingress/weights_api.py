"""The HTTP side of a trainer's weight updates, pause and resume (RL; the model's manager does them
across its replicas: cluster/weights.py). SGLang's and vLLM's endpoint names, per model (`model`
names one of several, in the query or the JSON body):

- `POST /pause?mode=keep|abort|wait`, `POST /resume`, `GET /get_weight_version`;
- `POST /update_weights_from_disk` {"model_path", "weight_version"?};
- `GET /weight_update_group_size`, then `POST /init_weights_update_group` {"master_address",
  "master_port", "backend"?} (it returns once the trainer, rank 0, has formed its side);
- `POST /check_weights` {"names", "dtypes", "shapes"}: would this update be taken (a 400 naming the
  first tensor it would be refused for)?
- `POST /update_weights_from_distributed` {"names", "dtypes", "shapes", "weight_version"?} (the
  trainer broadcasts each tensor in order once the call is under way, after /check_weights passed:
  a refused update receives nothing).

The three that take tensors also take `"lora_name"`: the update is then of that LoRA adapter's
tensors (PEFT names; `model_path` a PEFT adapter directory), an RL policy trained as an adapter.

Each answers {"model", "weight_version", "paused", ...}; a refusal (a name or shape the checkpoint
does not have, a bad field) is a 400 naming it, and nothing changed. They change what every client
is served, so they answer 404 unless the spec turns them on (`serving.enable_weight_updates`,
`pdserve serve --enable-weight-updates`); the server's API key guards them as every route.
"""
from __future__ import annotations

from typing import Any

from engine.weight_updates import PAUSE_MODES
from records.errors import InvalidRequestError, NotFoundError
from records.lora import LoRARequest

DTYPES = ("float32", "float16", "bfloat16")


def check_enabled(serving: Any, path: str) -> None:
    """NotFoundError naming the switch unless the spec turned the trainer's endpoints on."""
    if not serving.enable_weight_updates:
        raise NotFoundError(f"{path} is a trainer's endpoint, off on this server: serve with "
                            f"serving.enable_weight_updates (pdserve serve --enable-weight-updates) to use it")


async def weights_call(manager: Any, op: str, *args: Any) -> dict[str, Any]:
    """The manager's ModelWeights `op`; its refusals as InvalidRequestError."""
    try:
        out = await manager.weights.remote(op, *args)
    except Exception as e:
        cause = getattr(e, "cause", None) or e
        if isinstance(cause, ValueError):
            raise InvalidRequestError(str(cause)) from None
        raise
    return out if isinstance(out, dict) else {"world_size": out}


ADAPTER_OPS = ("check", "update_from_disk", "update_from_group")


def adapter_arg(op: str, body: dict[str, Any], adapters: dict[str, LoRARequest]) -> tuple[LoRARequest, ...]:
    """The adapter an update op names (`lora_name`, one this model serves), as the op's last argument."""
    name = body.get("lora_name")
    if op not in ADAPTER_OPS or name is None:
        return ()
    if name not in adapters:
        raise InvalidRequestError(f"lora_name must be one of the adapters served ({sorted(adapters)}); got {name!r}",
                                  param="lora_name")
    return (adapters[name],)


def pause_mode(query: Any) -> str:
    mode = query.get("mode", "keep")
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"mode must be one of {list(PAUSE_MODES)}; got {mode!r}", param="mode")
    return mode


def _version(body: dict[str, Any]) -> str | None:
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, (str, int)) or isinstance(version, bool) or version == ""):
        raise InvalidRequestError(f"weight_version must be a non-empty string; got {version!r}", param="weight_version")
    return None if version is None else str(version)


def disk_args(body: dict[str, Any]) -> tuple[str, str | None]:
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"model_path must name a checkpoint directory; got {path!r}", param="model_path")
    return path, _version(body)


def group_args(body: dict[str, Any]) -> tuple[str, int, str]:
    address, port, backend = body.get("master_address"), body.get("master_port"), body.get("backend", "gloo")
    if not isinstance(address, str) or not address:
        raise InvalidRequestError(f"master_address must be the trainer's host; got {address!r}", param="master_address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise InvalidRequestError(f"master_port must be a port number; got {port!r}", param="master_port")
    if backend not in ("gloo", "nccl"):
        raise InvalidRequestError(f"backend must be 'gloo' or 'nccl'; got {backend!r}", param="backend")
    return address, port, backend


def check_args(body: dict[str, Any]) -> tuple[dict[str, list[int]]]:
    """/check_weights' body ({"names", "dtypes", "shapes"}) as {name: shape}."""
    names, _, shapes, _ = distributed_args(body)
    return (dict(zip(names, shapes, strict=True)),)


def distributed_args(body: dict[str, Any]) -> tuple[list[str], list[str], list[list[int]], str | None]:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidRequestError("names must be a non-empty list of the tensors' checkpoint names", param="names")
    if not isinstance(dtypes, list) or len(dtypes) != len(names) or any(d not in DTYPES for d in dtypes):
        raise InvalidRequestError(f"dtypes must list one of {list(DTYPES)} per name ({len(names)})", param="dtypes")
    if (not isinstance(shapes, list) or len(shapes) != len(names)
            or not all(isinstance(s, list) and all(isinstance(d, int) and d > 0 for d in s) for s in shapes)):
        raise InvalidRequestError(f"shapes must list one shape (a list of sizes) per name ({len(names)})",
                                  param="shapes")
    return names, dtypes, shapes, _version(body)
