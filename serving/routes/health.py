"""GET /health (503 while loading or draining, 200 when ready) and GET /metrics
(Prometheus exposition); both open, no API key."""

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from serving.routes import deps

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


@router.get("/health")
async def health(service=Depends(deps.service)):
    status, body = service.health()
    return JSONResponse(body, status_code=status)


@router.get("/metrics")
async def metrics(service=Depends(deps.service)):
    data = service.metrics.exposition() if service.metrics is not None else b""
    return Response(data, media_type=PROMETHEUS_CONTENT_TYPE)
