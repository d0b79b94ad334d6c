"""What several endpoints check before their work: the route class of the endpoints with a
JSON body (`JSONRoute`), and FastAPI dependencies for the service, the arrival time, the
API key, the admin key and readiness. A failed check raises serving.protocol.APIError (the
app's handler answers it, OpenAI-shaped)."""

import hmac
import inspect
import time

import pydantic
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from serving import protocol
from serving.protocol import APIError


class JSONRoute(APIRoute):
    """An endpoint whose body is a pydantic model (its parameter annotated with the model):
    FastAPI validates the body, and this route tells a failure the OpenAI way. Before
    FastAPI reads the body it stamps the arrival (TTFT counts from there) and answers a
    wrong Content-Type, invalid UTF-8 or JSON, or a body that is not an object with a 400
    of its own words; so such a body is refused before the API key is checked (FastAPI
    reads a body before it resolves dependencies)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = next((p.annotation for p in inspect.signature(self.endpoint).parameters.values()
                      if inspect.isclass(p.annotation)
                      and issubclass(p.annotation, pydantic.BaseModel)), None)

        async def handle(request):
            request.state.arrival = time.perf_counter()
            body = None
            if model is not None:
                try:
                    raw = await request.body()
                except ClientDisconnect:  # hung up before its body arrived: nothing started
                    raise APIError(499, "client closed the connection before sending its "
                                        "request body") from None
                body = protocol.parse_json_body(raw, request.headers.get("content-type"))
            try:
                return await handler(request)
            except RequestValidationError as e:
                raise protocol.explain(model, e, body) from None

        return handle


def service(request: Request):
    return request.app.state.service


def arrival(request: Request):
    """The request's arrival time (stamped by JSONRoute before the body is read)."""
    return request.state.arrival


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
