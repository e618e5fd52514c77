"""LoRA adapters over HTTP, with vLLM's routes and bodies.

- ``GET /v1/models`` lists each loaded adapter after the base model, with ``parent``
  the base model's name (the base's ``parent`` is null), as vLLM does
  (:meth:`llmctl.serve.openai.models.OpenAIModels.cards`).
- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: 200 with a
  line of text; 400 for a bad path, config or tensors, or a name already in use.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: 200; 404 when not loaded.
  Requests already running with the adapter finish with it (they hold its weights);
  new requests naming it get 404 at once (vLLM also unloads lazily).

Both change what the server runs, and loading makes the server read a directory the
client names: they answer 403 unless the server was started with
``--enable-lora-runtime-updates`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). With
keys they need an admin's: ``--api-key``'s, or a tenant marked ``admin: true`` in the
auth file (403 for other tenants). A path that does not load is "not a valid adapter",
whatever the reason (missing, not a directory, no config, bad tensors): the reason is
logged for the operator, never told to the client, who could otherwise map the server's
files. Which adapters a tenant may *use* is its ``models`` list (an adapter by its name).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmctl.serve.api.body import read_body
from llmctl.serve.api.handler import RequestHandler, tenant_of
from llmctl.serve.lora.adapter import LoRAError, LoRANameError, LoRANotFoundError
from llmctl.serve.openai import errors

log = logging.getLogger("llmctl.serve")

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # sent by some vLLM clients; names are what count


def _allowed(request: Request) -> RequestHandler:
    """The app's handler, once this request may change the adapters (403 otherwise)."""
    handler: RequestHandler = request.app.state.handler
    if not handler.config.settings.enable_lora_runtime_updates:
        raise errors.APIError(403, "loading and unloading LoRA adapters at run time is off; "
                              "start the server with --enable-lora-runtime-updates",
                              "permission_error", code="lora_updates_disabled")
    handler.tenancy.check_admin(tenant_of(request))
    return handler


async def _parsed(request: Request, model: type[BaseModel]):
    body = await read_body(request)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise errors.bad_request(f"{where}: {err['msg']}" if where else err["msg"],
                                 where or None) from None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request):
    handler = _allowed(request)
    req = await _parsed(request, LoadLoRARequest)
    if req.lora_name in handler.frontend.models.served_names:
        raise errors.bad_request(f"{req.lora_name!r} is the base model's name; give the "
                                 "adapter another", "lora_name")
    try:  # reads and checks the tensors: off the event loop
        await asyncio.to_thread(handler.engine.add_lora, req.lora_name, req.lora_path)
    except LoRANameError as exc:
        raise errors.bad_request(str(exc), "lora_name") from None
    except LoRAError as exc:
        log.warning("load_lora_adapter %r refused: %s", req.lora_name, exc)
        raise errors.bad_request("lora_path: not a valid adapter (the server's log says "
                                 "why)", "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    handler = _allowed(request)
    req = await _parsed(request, UnloadLoRARequest)
    try:
        handler.engine.remove_lora(req.lora_name)
    except LoRANotFoundError as exc:
        raise errors.APIError(404, str(exc), "invalid_request_error", "lora_name",
                              "model_not_found") from None
    except LoRAError as exc:
        raise errors.bad_request(str(exc), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
