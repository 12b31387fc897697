"""The HTTP routes: the Tinker API under /api/v1/ as the official SDK (tinker 0.38) calls it.

Errors are JSON `{"error", "field", "detail"}`: 400 for a request the client got wrong (the field
named), 401 for a missing or unknown API key, 404 for an id or path this key does not own. Any
other path under /api/v1/ answers 404 naming the route as not supported, and side traffic the SDK
sends (telemetry) is accepted and dropped.
"""
from __future__ import annotations

import io
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mmrl.serve import openapi, wire
from mmrl.serve.auth import AuthError, Keys
from mmrl.serve.futures import JobError
from mmrl.serve.inputs import build_prompt, vocab_size
from mmrl.serve.losses import LossInputError, check_loss_name
from mmrl.serve.quota import KeyQuotas, QuotaExceeded
from mmrl.serve.sampler import SampleParams
from mmrl.serve.service import NotFound, Service
from mmrl.serve.state_routes import state_router
from mmrl.serve.trainer import UserInputError

PROTO = "application/x-protobuf"
MAX_BODY_BYTES = 1 << 30  # a decompressed forward_backward body
log = logging.getLogger("mmrl.serve")

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "parallel_fwdbwd_chunks": False,  # one model's calls run in order anyway
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,  # plain httpx
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def _err(status: int, message: str, field: str | None = None,
         headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "field": field, "detail": message}, status_code=status, headers=headers)


def make_app(service: Service, keys: Keys) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="mmrl serve (Tinker API)", lifespan=lifespan)
    openapi.describe(app)  # the hand-read bodies, in /openapi.json
    quotas = app.state.quotas = KeyQuotas.from_config(service.cfg.serve)
    vocab = vocab_size(service.model_path, service.cfg.model.trust_remote_code)

    @app.middleware("http")
    async def errors_and_auth(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if path.startswith("/api/v1/") and path != "/api/v1/healthz":
            try:
                request.state.owner = keys.check(request.headers.get("x-api-key") or request.headers.get("authorization"))
            except AuthError as e:
                return _err(401, str(e), "X-API-Key")
        return await call_next(request)

    @app.exception_handler(UserInputError)
    @app.exception_handler(wire.WireError)
    async def bad_request(_request: Request, e: Any) -> JSONResponse:
        return _err(400, str(e), e.field)

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, e: NotFound) -> JSONResponse:
        return _err(404, str(e), e.field)

    @app.exception_handler(QuotaExceeded)
    async def over_quota(_request: Request, e: QuotaExceeded) -> JSONResponse:
        return _err(429, str(e), e.field, e.headers)

    @app.exception_handler(JobError)
    async def job_error(_request: Request, e: JobError) -> JSONResponse:
        return _err(400, str(e))

    async def body(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserInputError(f"body is not valid JSON: {e}", "body") from None
        except RecursionError:  # the parser recurses once per level of [ / {
            raise UserInputError("body is nested too deeply", "body") from None
        if not isinstance(data, dict):
            raise UserInputError("body must be a JSON object", "body")
        return data

    def need(data: dict[str, Any], key: str, kind: type | tuple = str, required: bool = True) -> Any:
        """data[key] checked to be a `kind` (a 400 naming `key` otherwise); None when absent and not
        `required`. Checked here, before the value reaches the store or a queued job."""
        if key not in data or data[key] is None:
            if not required:
                return None
            raise UserInputError(f"{key} is required", key)
        if not isinstance(data[key], kind) or isinstance(data[key], bool) and kind is not bool:
            raise UserInputError(f"{key} has the wrong type ({type(data[key]).__name__}; expected "
                                 f"{getattr(kind, '__name__', kind)})", key)
        return data[key]

    def future(request: Request, model_id: str | None, kind: str, job: Any, lane: str | None = None) -> dict:
        fid = service.queue.submit(request.state.owner, model_id, kind, job, lane)
        return {"request_id": fid, "model_id": model_id}

    # ---- service --------------------------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return {"refresh_interval_sec": 300}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict:
        return {"supported_models": [{"model_name": service.model_name, "trainable": True, "sampleable": True,
                                      "max_context_length": int(service.cfg.rollout.engine_args.get("max_model_len", 2048))}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        data = await body(request)
        sid = service.store.add_session(request.state.owner, need(data, "sdk_version", required=False))
        return {"type": "create_session", "session_id": sid}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict:
        """`ServiceClient.close()`: the session ends (the SDK stops its heartbeats); its models then
        count as silent, so the model quota can make room from them."""
        if not service.store.finish_session(request.state.owner, session_id):
            raise NotFound(f"session_id {session_id!r} not found", "session_id")
        return {}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        data = await body(request)
        if not service.store.heartbeat(request.state.owner, str(need(data, "session_id"))):
            raise NotFound(f"session_id {data['session_id']!r} not found", "session_id")
        return {"type": "session_heartbeat"}

    # ---- models ---------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        data = await body(request)
        owner = request.state.owner
        service.check_base_model(need(data, "base_model"))
        lora = need(data, "lora_config", dict, required=False) or {}
        rank, top = lora.get("rank"), service.cfg.serve.max_lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= top:
            raise UserInputError(f"lora_config.rank must be an integer in [1, {top}], got {rank!r}", "lora_config.rank")
        opt = (need(data, "optimizer_config", dict, required=False) or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserInputError(f"optimizer_config.type {opt!r} is not supported (adamw only)", "optimizer_config.type")
        session_id = str(need(data, "session_id"))
        metadata = need(data, "user_metadata", dict, required=False)
        if service.store.session(owner, session_id) is None:
            raise NotFound(f"session_id {session_id!r} not found", "session_id")
        quotas.check_models(owner, service)
        mid = service.store.add_model(owner, session_id, data["base_model"], rank,
                                      service.model_config_json(lora, metadata))
        job = quotas.model_job(owner, mid, lambda: service.create_model(mid, lora))
        return future(request, mid, "create_model", job, lane=mid)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        data = await body(request)
        return service.info(request.state.owner, str(need(data, "model_id")))

    @app.post("/api/v1/unload_model")
    async def unload_model(request: Request) -> dict:
        data = await body(request)
        mid = str(need(data, "model_id"))
        service.trainer(request.state.owner, mid)

        async def job() -> dict:
            service.unload(mid)
            return {"type": "unload_model", "model_id": mid}

        return future(request, mid, "unload_model", job, lane=mid)

    # ---- training -------------------------------------------------------------------------------
    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        raw = await request.body()
        if PROTO not in request.headers.get("content-type", ""):
            raise UserInputError("forward_backward takes the SDK's protobuf body (application/x-protobuf)", "body")
        if request.headers.get("content-encoding") == "zstd":
            import zstandard

            try:  # streamed and capped: a small body (or a forged frame header) must not expand without limit
                raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read(MAX_BODY_BYTES + 1)
            except zstandard.ZstdError as e:
                raise UserInputError(f"body is not valid zstd ({e})", "body") from None
            if len(raw) > MAX_BODY_BYTES:
                raise UserInputError(f"body decompresses to more than {MAX_BODY_BYTES} bytes", "body")
        req = wire.read_forward_backward_request(raw)
        trainer = service.trainer(request.state.owner, req.model_id)
        # checked now, so a wrong loss or input is a 400 on the call itself
        try:
            check_loss_name(req.loss_fn)
        except LossInputError as e:
            raise UserInputError(str(e), e.field) from None
        if not req.data:
            raise UserInputError("data is empty", "data")
        prompts = [build_prompt(d.chunks, service.processor, f"data[{i}].model_input", vocab)
                   for i, d in enumerate(req.data)]
        inputs = [d.loss_fn_inputs for d in req.data]

        async def job() -> tuple[bytes, str]:
            try:
                outputs, metrics = await service.queue.in_thread(
                    trainer.forward_backward, prompts, inputs, req.loss_fn, req.loss_fn_config, not req.forward_only)
            except UserInputError as e:
                raise JobError(str(e)) from None
            return wire.forward_backward_output(outputs, metrics), PROTO

        kind = "forward" if req.forward_only else "forward_backward"
        return future(request, req.model_id, kind, job, lane=req.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        data = await body(request)
        mid = str(need(data, "model_id"))
        trainer = service.trainer(request.state.owner, mid)
        adam = (need(data, "adam_params", dict, required=False) or need(data, "optim_params", dict, required=False)
                or {})
        if "optimizer_params" in data:
            raise UserInputError("optimizer_params: only AdamParams is supported", "optimizer_params")

        async def job() -> dict:
            try:
                metrics = await service.queue.in_thread(trainer.optim_step, adam)
            except UserInputError as e:
                raise JobError(str(e)) from None
            return {"type": "optim_step", "metrics": metrics}

        return future(request, mid, "optim_step", job, lane=mid)

    # ---- weights --------------------------------------------------------------------------------
    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        data = await body(request)
        owner, mid = request.state.owner, str(need(data, "model_id"))
        service.trainer(owner, mid)
        path = need(data, "path", required=False)
        return future(request, mid, "save_weights_for_sampler",
                      lambda: service.save_for_sampler(owner, mid, path), lane=mid)

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        data = await body(request)
        owner = request.state.owner
        key, _ = service.sampling_target(owner, None, need(data, "model_path", required=False),
                                         need(data, "base_model", required=False))
        sid = service.store.add_sampling_session(owner, None if key == "base" else data["model_path"], service.model_name)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        row = service.store.sampling_session(request.state.owner, sampler_id)
        if row is None:
            raise NotFound(f"sampler {sampler_id!r} not found", "sampler_id")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["checkpoint"]}

    # ---- sampling -------------------------------------------------------------------------------
    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        data = await body(request)
        owner = request.state.owner
        key, file = service.sampling_target(owner, *(need(data, k, required=False) for k in
                                                     ("sampling_session_id", "model_path", "base_model")))
        chunks = need(data, "prompt", dict).get("chunks")
        if not isinstance(chunks, list):
            raise UserInputError("prompt.chunks must be a list", "prompt.chunks")
        prompt = build_prompt(chunks, service.processor, "prompt", vocab)
        n = data.get("num_samples", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 128:
            raise UserInputError(f"num_samples must be an integer in [1, 128], got {n!r}", "num_samples")
        params = _sampling_params(need(data, "sampling_params", dict, required=False) or {})
        params.forbidden = service.forbidden_tokens
        want_prompt = bool(data.get("prompt_logprobs"))
        for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k",
                            "target_prompt_logprobs"):
            if data.get(unsupported):
                raise UserInputError(f"{unsupported} is not supported by this server yet", unsupported)
        charge = quotas.admit_sample(owner, n, params.max_tokens)  # 429 / 400 over the key's quota

        async def job() -> tuple[dict, tuple[bytes, str]]:
            out = await service.sample(key, file, prompt, n, params, want_prompt)
            return out, (wire.sample_response(out["sequences"], out.get("prompt_logprobs")), PROTO)

        out = future(request, None, "sample", quotas.sampling_job(charge, job))
        out["sample_sequence_ids"] = [f"{out['request_id']}-{i}" for i in range(n)]
        return out

    # ---- futures --------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        data = await body(request)
        fid = str(need(data, "request_id"))
        row = await service.queue.wait(request.state.owner, fid)
        if row is None:
            raise NotFound(f"request_id {fid!r} not found", "request_id")
        if row["status"] == "pending":
            return JSONResponse({"type": "try_again", "request_id": fid, "queue_state": "active"})
        if row["status"] == "failed":
            return JSONResponse({"error": row["error"], "category": row["category"] or "unknown"})
        return Response(content=row["result"], media_type=row["content_type"])

    # save_state / load_state, weights_info, training runs and checkpoint listings (state_routes.py)
    app.include_router(state_router(service, body, need, future, quotas))

    # not in /openapi.json: it is no operation (and one route with five methods repeats its operationId)
    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"], include_in_schema=False)
    async def unsupported(rest: str) -> JSONResponse:
        return _err(404, f"/api/v1/{rest} is not supported by mmrl serve yet (docs/service.md)", "path")

    return app


def _sampling_params(p: dict[str, Any]) -> SampleParams:
    def num(key: str, default: Any, kind: type = float) -> Any:
        v = p.get(key, default)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or kind is int and not isinstance(v, int):
            raise UserInputError(f"sampling_params.{key} must be a number, got {v!r}", f"sampling_params.{key}")
        return kind(v)

    max_tokens = num("max_tokens", 16, int)
    temperature, top_p, top_k = num("temperature", 1.0), num("top_p", 1.0), num("top_k", -1, int)
    seed = p.get("seed")
    if max_tokens < 1:
        raise UserInputError("sampling_params.max_tokens must be >= 1", "sampling_params.max_tokens")
    if temperature < 0 or not 0 < top_p <= 1:
        raise UserInputError("sampling_params: need temperature >= 0 and 0 < top_p <= 1", "sampling_params.temperature")
    if seed is not None and not isinstance(seed, int):
        raise UserInputError("sampling_params.seed must be an integer", "sampling_params.seed")
    stop = p.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise UserInputError("sampling_params.stop must be a string or a list", "sampling_params.stop")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    stop_strs = [s for s in stop if isinstance(s, str)]
    stop_tokens = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
    if len(stop_strs) + len(stop_tokens) != len(stop):
        raise UserInputError("sampling_params.stop must be strings or token ids", "sampling_params.stop")
    return SampleParams(max_tokens, temperature, top_p, top_k, seed, stop_strs, stop_tokens)
