"""The Tinker routes for training state and listings (tinker 0.38): `save_weights` (save_state),
`load_weights` (load_state[_with_optimizer] on a training client, and
create_training_client_from_state[_with_optimizer], which creates the model by loading),
`weights_info`, training runs, a run's checkpoints, the caller's checkpoints, and deleting one.

Every read is scoped to the caller's key: another key's run or checkpoint is a 404 naming it, the
same answer as one that does not exist.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mmrl.serve import state
from mmrl.serve.quota import KeyQuotas
from mmrl.serve.service import NotFound, Service
from mmrl.serve.trainer import UserInputError


def _time(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, timezone.utc).isoformat()


def checkpoint_json(row: dict[str, Any]) -> dict[str, Any]:
    """A store row as the SDK's `types.Checkpoint`."""
    return {"checkpoint_id": state.parse_path(row["path"]).checkpoint_id,
            "checkpoint_type": state.SDK_TYPE[row["kind"]], "time": _time(row["created"]),
            "tinker_path": row["path"], "size_bytes": row.get("size_bytes"), "public": False,
            "user_metadata": json.loads(row["user_metadata"]) if row.get("user_metadata") else None,
            "expires_at": None}


def _page(request: Request, default_limit: int) -> tuple[int, int]:
    """(limit, offset) from the query string; a 400 naming the parameter when not a count."""
    out = []
    for key, default in (("limit", default_limit), ("offset", 0)):
        raw = request.query_params.get(key, str(default))
        if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone takes "²", which int() refuses
            raise UserInputError(f"{key} must be an integer >= 0, got {raw!r}", key)
        out.append(int(raw))
    return out[0], out[1]


def _cursor(limit: int, offset: int, total: int) -> dict[str, int]:
    return {"limit": limit, "offset": offset, "total_count": total}


def state_router(service: Service, body: Callable, need: Callable, future: Callable,
                 quotas: KeyQuotas | None = None) -> APIRouter:
    """The routes, sharing app.py's body parsing (`body`, `need`), future submission (`future`) and
    the key quotas (a model created from a state counts against `serve.quota_max_models`)."""
    quotas = quotas or KeyQuotas()
    router = APIRouter()
    store = service.store

    def owned_run(owner: str, run_id: str) -> dict[str, Any]:
        row = store.model(owner, run_id)
        if row is None:
            raise NotFound(f"training_run_id {run_id!r} not found", "training_run_id")
        return row

    def run_json(row: dict[str, Any]) -> dict[str, Any]:
        cks = store.list_checkpoints(row["owner"], row["id"], newest_first=True)
        newest = {kind: next((checkpoint_json(c) for c in cks if c["kind"] == kind), None)
                  for kind in ("state", "sampler")}
        config = json.loads(row["config_json"])
        return {"training_run_id": row["id"], "base_model": row["base_model"], "model_owner": row["owner"],
                "is_lora": True, "corrupted": row["status"] == "failed", "lora_rank": row["lora_rank"],
                "last_request_time": _time(store.last_request(row["id"]) or row["created"]),
                "last_checkpoint": newest["state"], "last_sampler_checkpoint": newest["sampler"],
                "user_metadata": config.get("user_metadata")}

    # ---- save / load ----------------------------------------------------------------------------
    @router.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        data = await body(request)
        owner, mid = request.state.owner, str(need(data, "model_id"))
        service.trainer(owner, mid)
        name = state.check_name(data.get("path"))
        overwrite = bool(data.get("overwrite", False))
        metadata = need(data, "user_metadata", dict, required=False)
        path = f"{state.TINKER}{mid}/weights/{name}"
        if not overwrite and store.checkpoint(owner, path) is not None:
            raise UserInputError(f"checkpoint {path!r} already exists (save_state(..., overwrite=True) replaces it)",
                                 "path")
        return future(request, mid, "save_weights",
                      lambda: service.save_state(owner, mid, name, overwrite, metadata), lane=mid)

    @router.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        data = await body(request)
        owner, path = request.state.owner, need(data, "path")
        with_optimizer = bool(data.get("optimizer", False))
        if data.get("weights_access_token"):
            raise UserInputError("weights_access_token is not supported: checkpoints are private to their API key",
                                 "weights_access_token")
        row = service.state_checkpoint(owner, path)  # 400/404 naming the path, before anything is queued
        if data.get("model_id") is not None:  # TrainingClient.load_state[_with_optimizer]
            mid = str(data["model_id"])
            service.trainer(owner, mid)
            return future(request, mid, "load_weights",
                          lambda: service.load_state(owner, mid, path, with_optimizer), lane=mid)
        return create_from_state(request, data, row, with_optimizer)

    def create_from_state(request: Request, data: dict[str, Any], row: dict[str, Any], with_optimizer: bool) -> dict:
        """ServiceClient.create_training_client_from_state[_with_optimizer]: the model is created by
        this load, under the id the SDK derives itself (`<session_id>:train:<model_seq_id>`)."""
        owner = request.state.owner
        session_id, seq = str(need(data, "session_id")), need(data, "model_seq_id", int)
        if store.session(owner, session_id) is None:
            raise NotFound(f"session_id {session_id!r} not found", "session_id")
        lora, _ = service.state_lora(row)
        base_model = need(data, "base_model", required=False) or state.read_meta(row["file"])["base_model"]
        service.check_base_model(base_model)
        opt = (need(data, "optimizer_config", dict, required=False) or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserInputError(f"optimizer_config.type {opt!r} is not supported (adamw only)",
                                 "optimizer_config.type")
        mid = f"{session_id}:train:{seq}"
        if store.model(owner, mid) is not None:
            raise UserInputError(f"model_seq_id {seq} is already used in session {session_id!r}", "model_seq_id")
        metadata = need(data, "user_metadata", dict, required=False)
        quotas.check_models(owner, service)
        store.add_model(owner, session_id, base_model, int(lora["rank"]), service.model_config_json(lora, metadata),
                        model_id=mid)
        path = row["path"]
        job = quotas.model_job(owner, mid, lambda: service.create_from_state(owner, mid, path, with_optimizer))
        return future(request, mid, "load_weights", job, lane=mid)

    @router.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict:
        data = await body(request)
        path = state.parse_path(need(data, "tinker_path"), "tinker_path").path
        row = store.checkpoint(request.state.owner, path)
        if row is None:
            raise NotFound(f"checkpoint {path!r} not found", "tinker_path")
        run = owned_run(request.state.owner, row["model_id"])
        lora = json.loads(run["config_json"]).get("lora", {})
        return {"base_model": run["base_model"], "is_lora": True, "lora_rank": run["lora_rank"],
                **{k: bool(lora.get(k, True)) for k in ("train_unembed", "train_mlp", "train_attn")}}

    # ---- listings -------------------------------------------------------------------------------
    @router.get("/api/v1/training_runs")
    async def list_training_runs(request: Request) -> dict:
        limit, offset = _page(request, 20)
        runs = store.list_models(request.state.owner)[::-1]  # newest first
        return {"training_runs": [run_json(r) for r in runs[offset:offset + limit]],
                "cursor": _cursor(limit, offset, len(runs))}

    @router.get("/api/v1/training_runs/{run_id}")
    async def get_training_run(run_id: str, request: Request) -> dict:
        return run_json(owned_run(request.state.owner, run_id))

    @router.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request) -> dict:
        owned_run(request.state.owner, run_id)
        return {"checkpoints": [checkpoint_json(c) for c in store.list_checkpoints(request.state.owner, run_id)]}

    @router.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request) -> dict:
        limit, offset = _page(request, 100)
        cks = store.list_checkpoints(request.state.owner, newest_first=True)
        return {"checkpoints": [checkpoint_json(c) for c in cks[offset:offset + limit]],
                "cursor": _cursor(limit, offset, len(cks))}

    @router.delete("/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> Response:
        if checkpoint_id.count("/") != 1:  # e.g. .../publish (unpublish): not a checkpoint
            message = f"{request.url.path} is not supported by mmrl serve yet (docs/service.md)"
            return JSONResponse({"error": message, "field": "path", "detail": message}, status_code=404)
        owned_run(request.state.owner, run_id)
        service.delete_checkpoint(request.state.owner, run_id, checkpoint_id)
        return Response(status_code=204)

    return router
