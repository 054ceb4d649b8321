"""LoRA adapters over HTTP, as vLLM's OpenAI server serves them, on a real server on 127.0.0.1: the
adapters of --lora-modules in /v1/models, a request's ``model`` running its adapter (greedy tokens equal
transformers + PEFT's merged model, streamed or not, completions and chat), adapters loaded and
unloaded while serving (ids never reused, 404 once gone, 400 while in use), the API key on both
endpoints, and bad bodies or adapters refused with a 400 that names the field."""
from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import build_tiny_checkpoint
from engine_helpers import make_llm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")

from jaxrunner import LoRARequest, SamplingParams  # noqa: E402
from jaxrunner import cli  # noqa: E402
from jaxrunner.entrypoints.openai.api_server import LoRAModulePath, ServerConfig, ServerState  # noqa: E402
from server_helpers import serving  # noqa: E402

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "base"
PROMPT = [5, 17, 33, 9, 100, 200, 7]
NEW_TOKENS = 8
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)  # as test_lora's
# name -> (seed, targets, rank); "wide" has a rank over max_lora_rank
ADAPTERS = {"sql": (1, ["q_proj", "v_proj", "down_proj"], 8), "chat": (2, ["k_proj", "o_proj", "up_proj"], 4),
            "late": (3, ["v_proj", "up_proj", "down_proj"], 8), "wide": (4, ["q_proj"], 16)}


def save_adapter(base: str, path: str, seed: int, targets: list[str], rank: int) -> list[int]:
    """A PEFT adapter with random A and B at ``path``; the merged model's greedy tokens for PROMPT."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                         lora_dropout=0.0))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    adapted.save_pretrained(path)
    return greedy(adapted.merge_and_unload())


def greedy(model) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """(base directory, {name: (adapter directory, merged greedy tokens)}, base greedy tokens)."""
    root = tmp_path_factory.mktemp("server-lora")
    base = build_tiny_checkpoint(root / "base", "llama")
    refs = {name: (str(root / name), save_adapter(base, str(root / name), *spec)) for name, spec in ADAPTERS.items()}
    base_tokens = greedy(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32))
    assert all(refs[name][1] != base_tokens for name in ("sql", "chat", "late"))  # each changes the output
    return base, refs, base_tokens


@pytest.fixture(scope="module")
def server(adapters):
    """(base URL, llm): "sql" and "chat" served from the start (ids 1 and 2), an API key set."""
    base, refs, _ = adapters
    llm = make_llm(base, **LORA_ENGINE)
    modules = (LoRAModulePath("sql", refs["sql"][0]), LoRAModulePath("chat", refs["chat"][0], BASE))
    with serving(llm, model=BASE, api_key=KEY, generation_config="vllm", lora_modules=modules) as (url, _):
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            yield http, llm


@pytest.fixture(autouse=True)
def only_the_start_adapters(server):
    """Each test starts with "sql" and "chat" only, whatever the one before left loaded."""
    yield
    http, _ = server
    for name in model_ids(http)[3:]:
        http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def complete(http, model: str, **extra) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                              "temperature": 0, "ignore_eos": True, **extra})


def token_strings(llm, tokens: list[int]) -> list[str]:
    return [llm.get_tokenizer().decode([t]) for t in tokens]


def model_ids(http) -> list[str]:
    return [card["id"] for card in http.get("/v1/models").json()["data"]]


def test_models_lists_the_base_and_each_adapter_as_vllm_does(server, adapters):
    http, _ = server
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [BASE, "sql", "chat"]
    assert cards[0]["parent"] is None
    sql = cards[1]
    assert sql["object"] == "model" and sql["owned_by"] == "jaxrunner" and sql["parent"] == BASE
    assert sql["root"] == adapters[1]["sql"][0]
    assert [r.lora_int_id for r in server[1].list_loras()] == [1, 2]


def test_a_request_naming_an_adapter_gives_the_peft_merged_tokens(server, adapters):
    http, llm = server
    _, refs, base_tokens = adapters
    for name in ("sql", "chat"):
        got = complete(http, name, logprobs=1).json()
        assert got["model"] == name
        assert got["choices"][0]["logprobs"]["tokens"] == token_strings(llm, refs[name][1]), name
    base = complete(http, BASE, logprobs=1).json()
    assert base["choices"][0]["logprobs"]["tokens"] == token_strings(llm, base_tokens)
    chunks = []
    with http.stream("POST", "/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                       "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    assert {c["model"] for c in chunks} == {"sql"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == complete(http, "sql").json()["choices"][0]["text"]


def test_chat_with_an_adapter_equals_llm_generate_with_its_lora_request(server, adapters):
    http, llm = server
    chat = [{"role": "user", "content": "Hello world"}]
    want = llm.generate([llm.chat_prompt(chat)], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False, lora_request=LoRARequest("chat", 2, adapters[1]["chat"][0]))[0].outputs[0]
    body = {"model": "chat", "messages": chat, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    got = http.post("/v1/chat/completions", json=body).json()
    assert got["model"] == "chat" and got["choices"][0]["message"]["content"] == want.text
    text = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line.removeprefix("data: "))["choices"][0]["delta"].get("content", ""))
    assert "".join(text) == want.text


def test_an_unknown_model_is_still_404(server):
    http, _ = server
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                                 {"messages": [{"role": "user", "content": "hi"}]})):
        response = http.post(path, json={**body, "model": "no-such-adapter"})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
        assert "`sql`" in response.json()["error"]["message"]
    assert http.post("/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200


def test_load_use_unload_and_load_again(server, adapters):
    http, llm = server
    path, tokens = adapters[1]["late"]
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert loaded.status_code == 200 and "late" in loaded.text
    assert model_ids(http)[-1] == "late"
    got = complete(http, "late", logprobs=1).json()
    assert got["choices"][0]["logprobs"]["tokens"] == token_strings(llm, tokens)
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    first_id = next(r.lora_int_id for r in llm.list_loras() if r.lora_name == "late")
    assert first_id == 3

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
    assert "late" not in model_ids(http) and "late" not in [r.lora_name for r in llm.list_loras()]
    assert complete(http, "late").status_code == 404
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"

    assert http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": path}).status_code == 200
    assert next(r.lora_int_id for r in llm.list_loras() if r.lora_name == "late") > first_id  # never reused
    assert complete(http, "late").json()["choices"][0]["text"] == got["choices"][0]["text"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200


def test_an_adapter_in_use_is_not_unloaded(server, monkeypatch):
    """The engine's steps wait on a gate, so the request is unfinished when the unload arrives."""
    http, llm = server
    gate, real_step = threading.Event(), llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: gate.wait(30) and real_step())
    answers = {}
    running = threading.Thread(target=lambda: answers.setdefault("run", complete(http, "sql")))
    running.start()
    deadline = time.monotonic() + 30
    while llm.engine_loop.num_requests() == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    unload = threading.Thread(target=lambda: answers.setdefault(
        "unload", http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})))
    unload.start()
    time.sleep(0.3)  # the unload's engine call is queued behind the gated step
    gate.set()
    unload.join(60)
    running.join(60)
    assert answers["unload"].status_code == 400 and "in use" in answers["unload"].json()["error"]["message"]
    assert answers["run"].status_code == 200
    assert model_ids(http) == [BASE, "sql", "chat"]  # still served, in its place
    assert complete(http, "sql").status_code == 200


def test_load_and_unload_need_the_api_key(server, adapters):
    http, _ = server
    body = {"lora_name": "late", "lora_path": adapters[1]["late"][0]}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = httpx.post(f"{http.base_url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert "late" not in model_ids(http)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/load_lora_adapter", {}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "/x"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ""}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "/x"}, "lora_name"),
    ("/v1/unload_lora_adapter", {}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": ["sql"]}, "lora_name"),
    ("/v1/unload_lora_adapter", [], None),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "load_inplace": True}, "load_inplace"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "base_model": "m"}, "base_model"),
    ("/v1/unload_lora_adapter", {"lora_name": "sql", "lora_int_id": 1}, "lora_int_id"),
])
def test_bad_bodies_get_400_naming_the_field(server, path, body, field):
    http, _ = server
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert http.post(path, content=b"{not json").status_code == 400


def test_an_adapter_the_model_cannot_take_is_400_with_the_engines_reason(server, adapters):
    http, _ = server
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": adapters[1]["wide"][0]})
    assert response.status_code == 400 and "max_lora_rank" in response.json()["error"]["message"]
    assert "wide" not in model_ids(http)


def test_without_lora_the_endpoints_say_enable_lora(server, monkeypatch):
    http, llm = server
    monkeypatch.setattr(llm.engine, "adapters", None)  # as an engine started without enable_lora
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "sql"})):
        response = http.post(path, json=body)
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
    with pytest.raises(ValueError, match="enable_lora"):  # --lora-modules on such an engine stops the start
        ServerState(ServerConfig(model=BASE, lora_modules=(LoRAModulePath("x", "/x"),)), llm)


def test_serve_maps_the_lora_flags(adapters, monkeypatch, capsys):
    from jaxrunner.entrypoints.openai import server_process

    seen = {}
    monkeypatch.setattr(server_process, "run_server", lambda config, options: seen.update(config=config,
                                                                                         options=options) or 0)
    base = adapters[0]
    assert cli.main(["serve", base, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--lora-modules",
                     "a=/adapters/a", '{"name": "b", "path": "/adapters/b", "base_model_name": "m"}']) == 0
    assert seen["config"].lora_modules == (LoRAModulePath("a", "/adapters/a"), LoRAModulePath("b", "/adapters/b", "m"))
    assert {k: seen["options"][k] for k in ("enable_lora", "max_loras", "max_lora_rank")} == \
        {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8}
    assert cli.main(["serve", base, "--lora-modules", "a=/adapters/a"]) == 2
    assert "--lora-modules" in capsys.readouterr().err
    assert cli.main(["serve", base, "--max-loras", "3"]) == 2
    assert "--max-loras: LoRA adapters need --enable-lora" in capsys.readouterr().err
    assert cli.main(["serve", base, "--enable-lora", "--lora-modules", "a=/x", "a=/y"]) == 2
    assert "'a' is given twice" in capsys.readouterr().err
    assert cli.main(["serve", base, "--enable-lora", "--lora-modules", f"{base}=/x"]) == 2
    assert "the served model's name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--lora-modules", '{"name": "a"}'])
