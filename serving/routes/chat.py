"""POST /v1/chat/completions (OpenAI): messages under the model's chat template."""

from fastapi import APIRouter, Depends, Request

from serving.protocol import ChatRequest
from serving.routes import deps
from serving.routes.generation import generate

router = APIRouter(route_class=deps.JSONRoute)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, arrival=Depends(deps.arrival),
                           _=Depends(deps.authorized), service=Depends(deps.ready)):
    return await generate(service, request, body, arrival, chat=True)
