"""``python -m sglang.launch_server`` with the plugin installed answers the OpenAI API, and refuses what
it cannot serve at admission while it keeps serving."""

from __future__ import annotations

import json

import openai
import pytest
import requests
from sglang_m3.config import M3Config

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Weng earns $12 an hour for babysitting. How much did she earn in 50 minutes?"}]


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url, api_key="none")


def _model(client):
    return client.models.list().data[0].id


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model=_model(client), messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens > 0
    assert r.choices[0].message.content is not None and r.choices[0].finish_reason in ("length", "stop")


def test_chat_streaming_equals_non_streaming(client):
    kwargs = dict(model=_model(client), messages=MESSAGES, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
    ]
    assert len(pieces) > 1
    assert "".join(pieces) == full


def test_repeated_prompt_hits_radix_cache(client):
    messages = [{"role": "user", "content": "Betty is saving money for a new wallet which costs $100. " * 6}]
    kwargs = dict(model=_model(client), messages=messages, max_tokens=16, temperature=0)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert first.usage.prompt_tokens > 64  # past the sparse threshold of the tiny model
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.choices[0].message.content == first.choices[0].message.content


def test_out_of_vocabulary_ids_are_refused_and_the_server_keeps_serving(server_url, tiny_vl):
    root = server_url.removesuffix("/v1")
    vocab = M3Config.from_hf(json.loads((tiny_vl / "config.json").read_text())).vocab_size
    body = {"input_ids": [1, 2, vocab], "sampling_params": {"max_new_tokens": 2}}
    r = requests.post(f"{root}/generate", json=body, timeout=60)
    assert r.status_code == 400 and f"input_ids[2]={vocab}: outside the model's vocabulary [0, {vocab})" in r.text
    r = requests.post(f"{root}/generate", json=dict(body, input_ids=[1, 2, 3]), timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
