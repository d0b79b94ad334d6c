"""`python -m serving` on the DeepSeek-style fixture checkpoints (tests/fixtures/dsa,
deepseek_v4): an OpenAI completion generates what the runner does, GLM-5's chat goes through
its template, V4's through DeepSeek's encoder (asked with the official openai client), and
V3.2 (whose release ships a Python chat encoder, not a template) refuses chat clearly."""

import pathlib

import httpx
import numpy as np
import openai
import pytest

from model import ModelRunner
from model.pretrained import load_pretrained
from model.pretrained.chat import chat_prompt_ids
from serving.service import Service
from tests.serving.conftest import API_KEY, AUTH, RunningServer, test_config

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dsa"


@pytest.mark.slow  # compiles an MLA + MoE model's buckets
@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32"])
def test_a_served_completion_equals_the_runners_greedy_tokens(family):
    folder = FIXTURES / family
    service = Service(test_config(model=str(folder), max_context=256, warmup_max_context=128,
                                  cache_block_tokens=64))
    running = RunningServer(service)
    service.start()
    try:
        assert service.wait_ready(300), service.error
        with httpx.Client(base_url=running.url, headers=AUTH, timeout=120) as client:
            r = client.post("/v1/completions", json=dict(prompt="The key is", max_tokens=6,
                                                         temperature=0, ignore_eos=True))
            assert r.status_code == 200, r.text
            pre = load_pretrained(folder)
            ids = pre.tokenizer.encode("The key is")
            want = list(ModelRunner(pre.model).generate(np.asarray(ids), 6))
            assert r.json()["choices"][0]["text"] == pre.tokenizer.decode(want)
            chat = client.post("/v1/chat/completions", json=dict(
                messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0))
            if family == "glm_moe_dsa":
                assert chat.status_code == 200, chat.text
            else:
                assert chat.status_code == 400 and "chat template" in chat.text, chat.text
            metrics = client.get("/metrics").text
            assert "dosa_prefix_cache_queries_total" in metrics
    finally:
        running.stop()


@pytest.mark.slow  # compiles a V4 model's buckets
def test_deepseek_v4_serves_completions_and_chat():
    """A DeepSeek-V4 folder is served with its prefix cache (decode slots batched by vmap
    over its rings) and answers what the runner generates, a completion and a chat (the
    official openai client; the prompt as V4's encoder renders it); prefix blocks that would split
    its cache rows (entries of 4, summaries of 256 positions) are refused at start-up,
    naming cache_block_tokens. (Prefix reuse with its saved state: tests/serving/
    test_engine.py.)"""
    folder = FIXTURES.parent / "deepseek_v4" / "tiny"
    refused = Service(test_config(model=str(folder), max_context=256, warmup_max_context=128,
                                  cache_block_tokens=64, cache_size=16))
    refused.start()
    assert not refused.wait_ready(300) and "cache_block_tokens (64) must be a multiple of 256" \
        in str(refused.error)
    service = Service(test_config(model=str(folder), max_context=256, warmup_max_context=128,
                                  cache_block_tokens=256, cache_size=16))
    running = RunningServer(service)
    service.start()
    try:
        assert service.wait_ready(300), service.error
        with httpx.Client(base_url=running.url, headers=AUTH, timeout=120) as client:
            r = client.post("/v1/completions", json=dict(prompt="The with statement",
                                                         max_tokens=6, temperature=0,
                                                         ignore_eos=True))
            assert r.status_code == 200, r.text
            pre = load_pretrained(folder)
            ids = pre.tokenizer.encode("The with statement")
            runner = ModelRunner(pre.model)
            want = list(runner.generate(np.asarray(ids), 6))
            assert r.json()["choices"][0]["text"] == pre.tokenizer.decode(want)
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0)
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What does a with statement do?"}]
        chat = client.chat.completions.create(model=service.model_id, messages=messages,
                                              max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True})
        prompt = chat_prompt_ids(pre.tokenizer, messages)
        assert chat.usage.prompt_tokens == len(prompt)
        want = list(runner.generate(np.asarray(prompt), 5))
        assert chat.choices[0].message.content == pre.tokenizer.decode(want)
        with pytest.raises(openai.BadRequestError, match="wizard"):
            client.chat.completions.create(model=service.model_id, max_tokens=2,
                                           messages=[{"role": "wizard", "content": "hi"}])
    finally:
        running.stop()
