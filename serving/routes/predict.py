"""POST /predict (the reference deployment's): {"context", "query", "max_tokens"?} ->
the greedy answer with its TTFT."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from serving import protocol
from serving.routes import deps
from serving.routes.generation import admit, collect, side_headers

router = APIRouter()


@router.post("/predict")
async def predict(request: Request, arrival=Depends(deps.arrival), _=Depends(deps.authorized),
                  service=Depends(deps.ready), body=Depends(deps.json_body)):
    prompt, max_tokens = protocol.parse_predict(body)
    params = protocol.GenerationParams(temperature=0.0, top_p=1.0)
    prompt_ids = service.loaded.tokenizer.encode(prompt, bos=None)
    gen = admit(service, prompt_ids, max_tokens, params, arrival, "predict", request, body)
    answer = await collect(service, gen, request)
    return JSONResponse({
        "answer": answer, "ttft_ms": round(gen.ttft * 1000, 3) if gen.ttft else None,
        "prompt_tokens": len(prompt_ids), "cache_hit_tokens": gen.request.cache_hit_tokens,
        "completion_tokens": len(gen.request.generated),
        "finish_reason": gen.finish_reason, "model": service.model_id,
        "system_fingerprint": gen.fingerprint}, headers=side_headers(gen))
