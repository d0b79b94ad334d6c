"""POST /predict (the reference deployment's): {"context", "query", "max_tokens"?} ->
the greedy answer with its TTFT."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from serving.protocol import GREEDY, PredictRequest
from serving.routes import deps
from serving.routes.generation import admit, collect, side_headers

router = APIRouter(route_class=deps.JSONRoute)


@router.post("/predict")
async def predict(request: Request, body: PredictRequest, arrival=Depends(deps.arrival),
                  _=Depends(deps.authorized), service=Depends(deps.ready)):
    prompt_ids = service.loaded.tokenizer.encode(body.prompt, bos=None)
    gen = admit(service, prompt_ids, body.max_tokens, GREEDY, arrival, "predict", request, body)
    answer = await collect(service, gen, request)
    return JSONResponse({
        "answer": answer, "ttft_ms": round(gen.ttft * 1000, 3) if gen.ttft else None,
        "prompt_tokens": len(prompt_ids), "cache_hit_tokens": gen.request.cache_hit_tokens,
        "completion_tokens": len(gen.request.generated),
        "finish_reason": gen.finish_reason, "model": service.model_id,
        "system_fingerprint": gen.fingerprint}, headers=side_headers(gen))
