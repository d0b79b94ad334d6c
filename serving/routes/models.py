"""GET /v1/models (OpenAI): the one model this server serves."""

from fastapi import APIRouter, Depends

from serving.routes import deps

router = APIRouter()


@router.get("/v1/models")
async def models(_=Depends(deps.authorized), service=Depends(deps.ready)):
    return {"object": "list", "data": [{
        "id": service.model_id, "object": "model", "created": int(service.started),
        "owned_by": "dosa", "max_model_len": service.max_context,
        "description": service.loaded.description}]}
