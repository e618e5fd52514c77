"""The OpenAI routes, Anthropic's /v1/messages, health and metrics: thin wrappers that
read the app's :class:`~llmctl.serve.api.handler.RequestHandler` (``app.state.handler``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmctl.serve.api.handler import RequestHandler, owner_of, tenant_of
from llmctl.serve.openai.messages_api.protocol import CountTokensRequest, MessagesRequest
from llmctl.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    tokenize_request_class,
)
from llmctl.serve.openai.responses_api.protocol import ResponsesRequest

router = APIRouter()


def handler_of(request: Request) -> RequestHandler:
    return request.app.state.handler


@router.get("/health")
async def health(request: Request):
    if handler_of(request).engine.alive:
        return {"status": "ok"}
    return JSONResponse({"status": "unhealthy"}, status_code=503)


@router.get("/v1/models")
async def models(request: Request):
    handler = handler_of(request)
    tenant, tenancy = tenant_of(request), handler.tenancy
    data = handler.frontend.models.cards(
        tenancy.allowed_models(tenant), lambda name: tenancy.may_use_model(tenant, name))
    return {"object": "list", "data": data}


@router.get("/metrics")
async def metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(handler_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def completions(request: Request):
    handler = handler_of(request)
    serving = handler.frontend.completions
    req = await handler.parse(request, CompletionRequest)
    prompts = await handler.off_loop(serving.encode, req)
    cap = handler.tenancy.max_tokens_cap(tenant_of(request), req.max_tokens, "max_tokens")
    jobs, params = await handler.off_loop(serving.jobs, req, prompts, cap)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await handler.run(serving.kind, req, jobs, params, request, include_usage)


@router.post("/v1/embeddings")
async def embeddings(request: Request):
    handler = handler_of(request)
    serving = handler.frontend.embeddings
    req = await handler.parse(request, EmbeddingRequest)
    prompts = await handler.off_loop(serving.encode, req)
    jobs, params = serving.jobs(req, prompts)
    return await handler.embed(req, jobs, params, request)


@router.post("/tokenize")
async def tokenize(request: Request):
    handler = handler_of(request)
    return await handler.off_loop(handler.frontend.tokenization.tokenize,
                                  await handler.parse(request, tokenize_request_class))


@router.post("/detokenize")
async def detokenize(request: Request):
    handler = handler_of(request)
    return handler.frontend.tokenization.detokenize(
        await handler.parse(request, DetokenizeRequest))


@router.post("/v1/chat/completions")
async def chat(request: Request):
    handler = handler_of(request)
    serving = handler.frontend.chat
    req = await handler.parse(request, ChatCompletionRequest)
    tools = await handler.off_loop(serving.tool_plan, req)
    ids = await handler.off_loop(serving.encode, req)
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    cap = handler.tenancy.max_tokens_cap(tenant_of(request), req.token_limit, param)
    jobs, params = await handler.off_loop(serving.jobs, req, ids, cap, tools)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await handler.run(serving.kind, req, jobs, params, request, include_usage)


@router.post("/v1/responses")
async def responses(request: Request):
    handler = handler_of(request)
    serving = handler.frontend.responses_api
    req = await handler.parse(request, ResponsesRequest)
    history = serving.history(req, owner_of(request))
    chat_req = serving.chat_request(req, history)
    tools = await handler.off_loop(serving.tool_plan, chat_req)
    ids = await handler.off_loop(serving.encode, chat_req)
    cap = handler.tenancy.max_tokens_cap(tenant_of(request), chat_req.token_limit,
                                         "max_output_tokens")
    jobs, params = await handler.off_loop(serving.jobs, chat_req, ids, cap, tools)
    return await handler.respond(req, chat_req, history, jobs, params, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    return handler_of(request).frontend.responses_api.retrieve(response_id,
                                                               owner_of(request))


@router.post("/v1/messages")
async def messages(request: Request):
    handler = handler_of(request)
    serving = handler.messages_api
    req = await handler.parse(request, MessagesRequest)
    chat_req = serving.chat_request(req)
    tools = await handler.off_loop(serving.tool_plan, chat_req)
    ids = await handler.off_loop(serving.encode, chat_req)
    cap = handler.tenancy.max_tokens_cap(tenant_of(request), chat_req.token_limit,
                                         "max_tokens")
    jobs, params = await handler.off_loop(serving.jobs, chat_req, ids, cap, tools)
    return await handler.messages(chat_req, jobs, params, request)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(request: Request):
    handler = handler_of(request)
    serving = handler.messages_api
    chat_req = serving.chat_request(await handler.parse(request, CountTokensRequest))
    return {"input_tokens": len(await handler.off_loop(serving.encode, chat_req))}
