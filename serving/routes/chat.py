"""POST /v1/chat/completions (OpenAI): messages under the model's chat template."""

from fastapi import APIRouter, Depends, Request

from serving.routes import deps
from serving.routes.generation import generate

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, arrival=Depends(deps.arrival),
                           _=Depends(deps.authorized), service=Depends(deps.ready),
                           body=Depends(deps.json_body)):
    return await generate(service, request, body, arrival, chat=True)
