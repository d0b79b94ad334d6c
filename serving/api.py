"""The HTTP API (FastAPI): `create_app` builds the app of a Service from the routers of
serving.routes, with one error handler that answers every failure OpenAI-shaped.

Handlers never run JAX: a request is tokenized, admitted and handed to the scheduler's
worker thread, whose events come back through an asyncio queue (serving.routes.generation).
"""

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.protocol import APIError
from serving.routes import ROUTERS
from serving.routes.generation import log_request


def create_app(service):
    """The FastAPI app of `service`: every router of serving.routes.ROUTERS, and one error
    handler that answers every failure OpenAI-shaped ({"error": {message, type, param,
    code}}), counts it and logs it."""
    app = FastAPI(title="dosa serving", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    def error_response(request, error):
        if getattr(error, "recorded", False):
            return JSONResponse(error.body(), status_code=error.status)
        if service.metrics is not None:
            service.metrics.finished(error.status)
        if request.url.path not in ("/health", "/metrics"):
            log_request("-", "-", "-", None, 0, error.status, f"{request.url.path}: "
                        f"{error.message}")
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(APIError)
    async def on_api_error(request, error):
        return error_response(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, error):
        return error_response(request, APIError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, error):
        return error_response(request, APIError(400, str(error)))

    for router in ROUTERS:
        app.include_router(router)
    return app
