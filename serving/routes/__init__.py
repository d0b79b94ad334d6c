"""The HTTP endpoints, one module per group, each an APIRouter; `create_app`
(serving.api) includes every router of ROUTERS. Adding an endpoint: its module here and
one line below. Shared checks (API key, admin key, readiness) are the FastAPI
dependencies of serving.routes.deps; an endpoint with a body takes its pydantic model
(serving.protocol) and uses deps.JSONRoute."""

from serving.routes import admin, chat, completions, health, models, predict

ROUTERS = (health.router, models.router, completions.router, chat.router, predict.router,
           admin.router)
