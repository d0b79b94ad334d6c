"""What several endpoints check before their work, as FastAPI dependencies: the service, the
arrival time, the API key, the admin key, readiness and the JSON body. A failed check
raises serving.protocol.APIError (the app's handler answers it, OpenAI-shaped)."""

import hmac
import time

from fastapi import Depends, Request
from starlette.requests import ClientDisconnect

from serving import protocol
from serving.protocol import APIError


def service(request: Request):
    return request.app.state.service


def arrival():
    """The request's arrival time (TTFT counts from here): resolved before any check."""
    return time.perf_counter()


def _bearer_matches(request, key):
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def authorized(request: Request, svc=Depends(service)):
    """401 unless the request carries the config's api_key (none set: open)."""
    key = svc.config.api_key
    if key is None or _bearer_matches(request, key):
        return
    if request.headers.get("authorization"):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
    raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")


def admin_authorized(request: Request, svc=Depends(service)):
    """403 when no admin_key (nor api_key) is set; 401 unless the request carries it."""
    key = svc.config.admin_key or svc.config.api_key
    if key is None:
        raise APIError(403, "the admin endpoint is off: set admin_key (or api_key) in the "
                            "serving config", error_type="permission_error")
    if not _bearer_matches(request, key):
        raise APIError(401, "missing or invalid admin key: send 'Authorization: Bearer "
                            "<admin_key>'")


def ready(svc=Depends(service)):
    """503 until the model is loaded and warmed up, and while draining."""
    svc.require_ready()
    return svc


async def json_body(request: Request):
    """The request body as a JSON object (400 on a wrong content type or bad JSON; 499 when
    the client hung up before sending it)."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # hung up before its body arrived: nothing was started
        raise APIError(499, "client closed the connection before sending its request "
                            "body") from None
    return protocol.parse_json_body(raw, request.headers.get("content-type"))
