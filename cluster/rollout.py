"""RolloutClient: what an RL loop drives a pdserve deployment with, from any process (a trainer Ray
actor, a driver): rollouts with token ids and logprobs out, pause and resume, and weight updates
from disk or broadcast from the trainer's tensors over a gloo (CPU) or NCCL (GPU) group.

    client = RolloutClient("http://127.0.0.1:8000", api_key=...)
    for step in range(steps):
        samples = client.generate(prompt_ids, max_tokens=256, temperature=1.0, seed=step, logprobs=1)
        loss = trainer.train_step(samples)            # each sample says its weight_version
        client.pause("keep")                           # or "abort" / "wait"
        client.update_weights(trainer.named_parameters(), version=str(step + 1))
        client.resume()

`update_weights` joins the deployment's weight-update group on its first call (this process is its
rank 0; every rank of every replica of the model joins: cluster/weights.py) and keeps it for the
next ones. Names and shapes are the HF checkpoint's; the deployment checks them all before any
tensor moves, and refuses (ValueError naming the tensor) with nothing changed. HTTP endpoints:
router/ingress/weights_api.py.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

import torch

from engine.worker.weight_sync import WeightUpdateGroup


class RolloutClient:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0) -> None:
        """`model`: which of the deployment's models (None: its only one)."""
        self.base_url = base_url.rstrip("/")
        self.api_key, self.model, self.timeout_s = api_key, model, timeout_s
        self.group: WeightUpdateGroup | None = None

    # --- rollouts -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_tokens: int = 128, temperature: float = 1.0,
                 seed: int | None = None, logprobs: int | None = None, **sampling: Any) -> list[dict[str, Any]]:
        """One sample per prompt (token ids in and out, with `seed` + its index as its seed): each a
        dict of token_ids, text, logprobs (the sampled tokens', with `logprobs`), finish_reason and
        weight_versions ([first token, version] per range: more than one where an update came mid-way)."""
        out = []
        for i, ids in enumerate(prompts):
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": temperature, "return_token_ids": True,
                    **({"seed": seed + i} if seed is not None else {}),
                    **({"logprobs": logprobs} if logprobs is not None else {}), **sampling}
            choice = self._post("/v1/completions", body)["choices"][0]
            lps = choice.get("logprobs")
            out.append({"token_ids": choice["token_ids"], "text": choice["text"],
                        "logprobs": lps["token_logprobs"] if lps else None,
                        "finish_reason": choice["finish_reason"], "weight_versions": choice["weight_versions"]})
        return out

    # --- pause, resume, versions --------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> dict[str, Any]:
        return self._post(f"/pause?mode={mode}", {})

    def resume(self) -> dict[str, Any]:
        return self._post("/resume", {})

    def weight_version(self) -> str:
        return self._get("/get_weight_version")["weight_version"]

    # --- updates ------------------------------------------------------------------------------------
    def update_weights_from_disk(self, path: str, version: str | None = None, lora_name: str | None = None) -> str:
        """From a checkpoint directory (with `lora_name`: a PEFT directory of that adapter's tensors)."""
        body = {"model_path": path, **_optional(weight_version=version, lora_name=lora_name)}
        return self._post("/update_weights_from_disk", body)["weight_version"]

    def join(self, master_address: str = "127.0.0.1", master_port: int = 29555, backend: str = "gloo") -> int:
        """Form the weight-update group (this process: rank 0) with every rank of the deployment's
        replicas; its size."""
        world_size = self._get("/weight_update_group_size")["world_size"]
        joined = self._in_thread(self._post, "/init_weights_update_group",
                                 {"master_address": master_address, "master_port": master_port, "backend": backend})
        self.group = WeightUpdateGroup(master_address, master_port, 0, world_size, backend)
        joined()
        return world_size

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str | None = None,
                       lora_name: str | None = None, **group: Any) -> str:
        """Broadcast these HF-named tensors to every rank (joining the group first, with `group`'s
        `join` arguments, if not yet); the new version. With `lora_name`: that adapter's tensors
        (PEFT names, as in its adapter_model.safetensors)."""
        if self.group is None:
            self.join(**group)
        assert self.group is not None
        tensors = [(name, t.detach().contiguous()) for name, t in named_tensors]
        body = {"names": [n for n, _ in tensors], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], **_optional(weight_version=version, lora_name=lora_name)}
        # Checked on every replica first: a refusal (ValueError naming the tensor) sends nothing.
        self._post("/check_weights", body)
        done = self._in_thread(self._post, "/update_weights_from_distributed", body)
        for _, tensor in tensors:
            self.group.broadcast(tensor)
        return done()["weight_version"]

    # --- HTTP ---------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call(path, {**body, **({"model": self.model} if self.model else {})})

    def _get(self, path: str) -> dict[str, Any]:
        return self._call(path + (f"?model={self.model}" if self.model else ""), None)

    def _call(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers,
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            message = json.loads(e.read() or b"{}").get("error", {}).get("message", str(e))
            raise (ValueError if e.code == 400 else RuntimeError)(f"{path}: {message}") from None

    @staticmethod
    def _in_thread(fn: Any, *args: Any) -> _Pending:
        pending = _Pending()
        pending.thread = threading.Thread(target=pending.run, args=(fn, *args), daemon=True)
        pending.thread.start()
        return pending


class _Pending:
    """A call running on a thread of its own; calling it waits and returns (or raises) its result."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self, fn: Any, *args: Any) -> None:
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised where the caller waits
            self.error = e

    def __call__(self) -> Any:
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def _optional(**fields: Any) -> dict[str, Any]:
    """The fields given (not None), for a request body."""
    return {k: v for k, v in fields.items() if v is not None}
