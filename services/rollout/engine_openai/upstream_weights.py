"""Weight updates of an external OpenAI-compatible server through vLLM's weight-update HTTP endpoints.

`vllm serve` started with VLLM_SERVER_DEV_MODE=1 serves /pause, /resume, /is_paused, /collective_rpc and
/update_weight_version beside the OpenAI API (meshrl replicas do too with rollout.http_weight_updates). An
update lands as one safetensors file in a folder the server can read (rollout.weights_dir), then the server
reloads its weights from that folder in place (collective_rpc `reload_weights` with `weights_path`), between a
pause and a resume, and takes the trainer's version as its weight version.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import httpx

from services.common.errors import FailedPrecondition, Unavailable

log = logging.getLogger("meshrl.rollout.openai")

# The probe: a route only the weight-update API has (a plain OpenAI server answers 404).
PROBE_ROUTE = "/is_paused"


def server_root(server_url: str) -> str:
    """http://host:port/v1 -> http://host:port (the weight-update routes sit beside /v1, not under it)."""
    root = server_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


async def probe(root: str, headers: dict[str, str], timeout: float = 5.0) -> tuple[str, str]:
    """("vllm_http", "") when the server has the weight-update routes, ("none", why) when it answers without
    them, ("unknown", why) when it cannot be reached."""
    try:
        async with httpx.AsyncClient(headers=headers, timeout=timeout) as http:
            r = await http.get(root + PROBE_ROUTE)
    except httpx.HTTPError as e:
        return "unknown", f"cannot reach {root}: {e}"
    if r.status_code == 200:
        return "vllm_http", ""
    return "none", (f"{root}{PROBE_ROUTE} answered {r.status_code}: the server has no weight-update endpoints "
                    "(start vllm serve with VLLM_SERVER_DEV_MODE=1)")


def checkpoint_tensors(tensors: dict) -> dict:
    """The update as a checkpoint the server reloads: each tensor its own storage (the received ones are views of
    one buffer, which safetensors refuses), and a tied output head spelled out. An update leaves tied
    duplicates out, but vLLM's in-place reload puts the old tensor back on a layer that loads nothing: without
    `lm_head.weight` the tied head would keep the old embedding."""
    out = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def write_safetensors(tensors: dict, folder: Path) -> None:
    """The update as folder/model.safetensors, written under a temporary name and renamed: a reader never sees
    half a file."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(checkpoint_tensors(tensors), str(tmp))
    tmp.rename(folder / "model.safetensors")


class UpstreamWeights:
    """Pushes received weights to one server; `capability` says whether it can take them."""

    def __init__(self, root: str, weights_dir: str | None, headers: dict[str, str], timeout: float):
        self.root, self.headers, self.timeout = root, headers, timeout
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.capability, self.why = ("none", "rollout.weights_dir is not set") if self.weights_dir is None \
            else ("unknown", "not probed yet")

    async def refresh(self) -> tuple[str, str]:
        """The capability, probed (again) while the server has not been reached."""
        if self.capability == "unknown":
            self.capability, self.why = await probe(self.root, self.headers)
        return self.capability, self.why

    async def push(self, version: int, tensors: dict) -> None:
        capability, why = await self.refresh()
        if capability != "vllm_http":
            raise FailedPrecondition(f"UpdateWeights: {self.root} cannot take weights ({why}); set "
                                     "rollout.weights_dir to a folder the server reads and serve vLLM's "
                                     "weight-update endpoints")
        folder = self.weights_dir / f"v{version}"
        await asyncio.to_thread(write_safetensors, tensors, folder)
        async with httpx.AsyncClient(base_url=self.root, headers=self.headers, timeout=self.timeout) as http:
            await self._post(http, "/pause", params={"mode": "wait"})
            try:
                await self._post(http, "/collective_rpc", json={
                    "method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}})
                await self._post(http, "/update_weight_version", json={"new_version": str(version)})
            finally:
                await self._post(http, "/resume")
        for old in self.weights_dir.glob("v*"):       # the server has read them: earlier versions go
            if old != folder and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        log.info("weights v%d reloaded by %s from %s", version, self.root, folder)

    async def _post(self, http: httpx.AsyncClient, route: str, **kwargs) -> None:
        try:
            r = await http.post(route, **kwargs)
        except httpx.HTTPError as e:
            raise Unavailable(f"UpdateWeights: cannot reach {self.root}{route}: {e}") from None
        if r.status_code != 200:
            raise Unavailable(f"UpdateWeights: {self.root}{route} answered {r.status_code}: {r.text[:300]}")
