"""The request bodies and query parameters of the Tinker routes, written into the server's OpenAPI
document (/openapi.json, /docs).

The routes read their bodies by hand (app.py `body` / `need`, so a wrong field is a 400 naming it),
which leaves FastAPI nothing to describe. These schemas say what each route reads, in the shapes
the SDK (tinker 0.38) sends, so a reader of /docs and a fuzzer (tests/test_tinker_schema.py) see the
real inputs. They describe; the handlers still check every field themselves.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

STR: dict[str, Any] = {"type": "string"}
INT: dict[str, Any] = {"type": "integer"}
NUM: dict[str, Any] = {"type": "number"}
BOOL: dict[str, Any] = {"type": "boolean"}
OBJ: dict[str, Any] = {"type": "object"}


def obj(required: tuple[str, ...] = (), **props: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


LORA = obj(("rank",), rank=INT, seed=INT, train_unembed=BOOL, train_mlp=BOOL, train_attn=BOOL)
OPTIMIZER = obj(type=STR)
ADAM = obj(learning_rate=NUM, beta1=NUM, beta2=NUM, eps=NUM, weight_decay=NUM, grad_clip_norm=NUM)
TEXT_CHUNK = obj(("tokens",), type={"enum": ["encoded_text"]}, tokens={"type": "array", "items": INT})
IMAGE_CHUNK = obj(("data", "format"), type={"enum": ["image"]}, data={"type": "string", "format": "byte"},
                  format={"enum": ["png", "jpeg"]}, expected_tokens=INT)
MODEL_INPUT = obj(("chunks",), chunks={"type": "array", "items": {"anyOf": [TEXT_CHUNK, IMAGE_CHUNK]}})
SAMPLING = obj(max_tokens=INT, temperature=NUM, top_p=NUM, top_k=INT, seed=INT,
               stop={"anyOf": [STR, {"type": "array", "items": {"anyOf": [STR, INT]}}]})

# path -> the JSON body its POST reads
BODIES: dict[str, dict[str, Any]] = {
    "/api/v1/create_session": obj(sdk_version=STR, tags={"type": "array", "items": STR}, user_metadata=OBJ),
    "/api/v1/session_heartbeat": obj(("session_id",), session_id=STR),
    "/api/v1/create_model": obj(("session_id", "base_model", "lora_config"), session_id=STR, model_seq_id=INT,
                                base_model=STR, lora_config=LORA, optimizer_config=OPTIMIZER, user_metadata=OBJ),
    "/api/v1/get_info": obj(("model_id",), model_id=STR),
    "/api/v1/unload_model": obj(("model_id",), model_id=STR),
    "/api/v1/optim_step": obj(("model_id",), model_id=STR, adam_params=ADAM),
    "/api/v1/save_weights_for_sampler": obj(("model_id",), model_id=STR, path=STR),
    "/api/v1/create_sampling_session": obj(session_id=STR, sampling_session_seq_id=INT, base_model=STR,
                                           model_path=STR),
    "/api/v1/asample": obj(("prompt",), prompt=MODEL_INPUT, num_samples=INT, sampling_params=SAMPLING,
                           base_model=STR, model_path=STR, sampling_session_id=STR, prompt_logprobs=BOOL,
                           topk_prompt_logprobs=INT, topk_sample_logprobs=INT, prompt_alt_tokens_k=INT),
    "/api/v1/retrieve_future": obj(("request_id",), request_id=STR),
    "/api/v1/save_weights": obj(("model_id", "path"), model_id=STR, path=STR, overwrite=BOOL,
                                user_metadata=OBJ),
    "/api/v1/load_weights": obj(("path",), path=STR, optimizer=BOOL, model_id=STR, session_id=STR,
                                model_seq_id=INT, base_model=STR, optimizer_config=OPTIMIZER, user_metadata=OBJ,
                                weights_access_token=STR),
    "/api/v1/weights_info": obj(("tinker_path",), tinker_path=STR),
}
# forward_backward takes the SDK's protobuf message (mmrl/serve/wire.py reads it)
PROTOBUF_BODIES = {"/api/v1/forward_backward": {"type": "string", "format": "binary"}}
PAGED = ("/api/v1/training_runs", "/api/v1/checkpoints")  # GET ?limit=&offset=


def _body(media_type: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {media_type: {"schema": schema}}}


def describe(app: FastAPI) -> None:
    """Make `app.openapi()` (built once, on the first request for it) carry the bodies above."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            paths = doc["paths"]
            # a renamed route must not leave its body behind silently
            missing = [p for p in [*BODIES, *PROTOBUF_BODIES, *PAGED] if p not in paths]
            if missing:
                raise KeyError(f"openapi.py describes routes the app does not have: {missing}")
            for path, schema in BODIES.items():
                paths[path]["post"]["requestBody"] = _body("application/json", schema)
            for path, schema in PROTOBUF_BODIES.items():
                paths[path]["post"]["requestBody"] = _body("application/x-protobuf", schema)
            for path in PAGED:
                paths[path]["get"]["parameters"] = [
                    {"name": name, "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0}}
                    for name in ("limit", "offset")]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
