"""POST /v1/completions (OpenAI): a prompt (text, or token ids), whole or streamed."""

from fastapi import APIRouter, Depends, Request

from serving.protocol import CompletionRequest
from serving.routes import deps
from serving.routes.generation import generate

router = APIRouter(route_class=deps.JSONRoute)


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, arrival=Depends(deps.arrival),
                      _=Depends(deps.authorized), service=Depends(deps.ready)):
    return await generate(service, request, body, arrival, chat=False)
