"""The admin endpoint of a canary rollout (serving.rollout):

    GET  /admin/rollout   the sides (model_version, selection switches, recent shadow
                          recall), the canary's share, the guard, the number of changes
    POST /admin/rollout   {"action": "promote" | "rollback" | "set_share", "share": x}

Both need `Authorization: Bearer <admin_key>` (admin_key, else api_key; with neither set
the endpoint answers 403). A change applies to new requests only; it is logged (old and
new state) and counted (dosa_rollout_changes_total{action}). The state is not persisted: a
restart starts from the config file.
"""

from typing import Literal

import pydantic
from fastapi import APIRouter, Depends

from serving.protocol import APIError
from serving.rollout import RolloutError
from serving.routes import deps


class RolloutChange(pydantic.BaseModel):
    """The body of POST /admin/rollout."""

    model_config = pydantic.ConfigDict(extra="forbid", title="rollout change")

    action: Literal["promote", "rollback", "set_share"]
    share: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)

    @pydantic.model_validator(mode="after")
    def _share_for_set_share(self):
        if self.action == "set_share" and self.share is None:
            raise ValueError("set_share needs a share in [0, 1]")
        if self.action != "set_share" and self.share is not None:
            raise ValueError(f"share applies to set_share only, not {self.action}")
        return self


router = APIRouter(route_class=deps.JSONRoute)


def _rollout(service):
    service.require_ready()
    return service.rollout


@router.get("/admin/rollout")
async def get_rollout(_=Depends(deps.admin_authorized), service=Depends(deps.service)):
    return _rollout(service).snapshot()


@router.post("/admin/rollout")
async def post_rollout(change: RolloutChange, _=Depends(deps.admin_authorized),
                       service=Depends(deps.service)):
    state = _rollout(service)
    try:
        old, new = state.apply(change.action, change.share)
    except RolloutError as e:
        raise APIError(409, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return {"action": change.action, "old": old, "new": new, "rollout": state.snapshot()}
