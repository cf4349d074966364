"""Level 6 with LoRA adapters (features/lora): the request's `model` picks an adapter, and the openai
client's greedy answers are the offline engine's on that adapter; /v1/models lists the adapters;
adapters load and unload at run time; a bad one is a 400 and the server keeps serving.
"""

from __future__ import annotations

import httpx
import pytest
from level6_helpers import ENGINE, NAME, serve
from test_lora import SPECS, save_adapter

from level0_naive import SamplingParams
from level3_prefix import LoRARequest

pytestmark = pytest.mark.level6

LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPTS = ["ROMEO: what light", "JULIET: O Romeo"]


@pytest.fixture(scope="module")
def adapters(ckpt, tmp_path_factory):
    return {f"a{i}": str(save_adapter(ckpt, tmp_path_factory.mktemp(f"lora{i}"), *spec)) for i, spec in enumerate(SPECS)}


@pytest.fixture(scope="module")
def lora_server(ckpt, adapters):
    with serve(ckpt, {**ENGINE, **LORA}, lora_modules={"a0": adapters["a0"], "a1": adapters["a1"]}) as s:
        yield s


@pytest.fixture(scope="module")
def offline(ckpt):
    from level6_serving import LLM

    return LLM(str(ckpt), **ENGINE, **LORA)


def test_the_model_field_picks_the_adapter(lora_server, offline, adapters):
    client, params = lora_server.client, SamplingParams(max_tokens=8, temperature=0)
    texts = {}
    for model in (NAME, "a0", "a1"):
        lora = None if model == NAME else LoRARequest(model, int(model[1:]) + 1, adapters[model])
        want = [o.outputs[0].text for o in offline.generate(PROMPTS, params, lora_request=lora, progress=False)]
        got = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in PROMPTS]  # fmt: skip
        assert got == want, model
        messages = [{"role": "user", "content": PROMPTS[0]}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert chat.choices[0].message.content == offline.chat(messages, SamplingParams(max_tokens=6, temperature=0),
                                                               lora_request=lora)[0].outputs[0].text  # fmt: skip
        texts[model] = got
    assert texts["a0"] != texts[NAME] and texts["a1"] != texts[NAME]  # the adapters change the answers
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {NAME, "a0", "a1"} and cards["a1"].parent == NAME and cards["a1"].root == adapters["a1"]
    info = [line for line in httpx.get(lora_server.url + "/metrics").text.splitlines()
            if line.startswith("vllm:lora_requests_info{")]  # fmt: skip
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info


def test_adapters_load_and_unload_at_run_time_and_a_bad_one_is_a_400(lora_server, adapters, tmp_path):
    url, body = lora_server.url, {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "no adapter_config.json there" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/completions", json={**body, "model": "a0"}, timeout=60).status_code == 200
    ok = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["a2"]})
    assert ok.status_code == 200, ok.text
    late = httpx.post(url + "/v1/completions", json={**body, "model": "late"}, timeout=60)
    assert late.status_code == 200 and late.json()["model"] == "late"
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapters["a2"]})
    assert again.status_code == 400
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    gone = httpx.post(url + "/v1/completions", json={**body, "model": "late"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404


def test_the_lora_routes_are_in_the_openapi_document_where_the_server_has_lora(lora_server, ckpt):
    """vLLM documents /v1/load_lora_adapter and /v1/unload_lora_adapter; here they are in /openapi.json with their
    bodies where LoRA is on, and absent where it is not (they could only answer 400 there)."""
    doc = httpx.get(lora_server.url + "/openapi.json").json()
    for path, body in (("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
                       ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest")):  # fmt: skip
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{body}"}
        assert "text/plain" in op["responses"]["200"]["content"]
    assert doc["components"]["schemas"]["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]
    with serve(ckpt, ENGINE) as plain:
        assert not {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} & httpx.get(plain.url + "/openapi.json").json()["paths"].keys()
