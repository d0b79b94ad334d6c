"""The server answers every recorded request as it did when the requests were parsed by
hand (tests/serving/answers.py recorded them before serving/protocol.py became pydantic
models): the same status and body for 93 raw HTTP requests, and the same parsed responses
for the official openai client's completion, chat and streams."""

import json

import pytest

from tests.serving import answers

pytestmark = pytest.mark.xdist_group("serving-server")


@pytest.fixture(scope="module")
def now(server):
    return answers.answers(server)


@pytest.fixture(scope="module")
def recorded():
    return json.loads(answers.RECORDED.read_text())


def test_every_http_answer_is_the_recorded_one(now, recorded):
    assert len(now["http"]) == len(recorded["http"]) == 93
    for new, old in zip(now["http"], recorded["http"]):
        assert new == old, f"{old[0]} {old[1]}"


@pytest.mark.parametrize("name", ["completion", "completion_stream", "chat", "chat_stream",
                                  "bad_request"])
def test_the_openai_client_gets_the_recorded_answer(now, recorded, name):
    assert now["openai"][name] == recorded["openai"][name]
