"""Chat templates are bounded (issue 37): a render has a time, size and memory limit, runs
in a process of its own (cluster/worker/chat_render.py) where it can be stopped, never
holds the tokenizer's threads, and a worker whose renders are stuck says so. The text is
transformers' own rendering, byte for byte, on every real template Orchard ships."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.errors import InvalidRequest
from cluster.chat_formats import template_text
from cluster.platform import resident_bytes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.admin import format_workers
from cluster.router.registry import HEALTHY, UNHEALTHY, Registry
from cluster.sdk import build_request
from cluster.worker.chat_render import ChatTemplateLimits, RenderPool, render_call
from cluster.worker.service import INLINE_TOKENIZE_CHARS, WorkerService
from scripted_engine import ScriptedEngine

# Renders the chat as ChatML, except that a message "boom" makes it loop without end (the
# nested range() loops of the GGUF: 10^10 turns).
BOMB_ON_BOOM = (
    "{% for m in messages %}{% if m['content'] == 'boom' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HUGE = "{{ 'x' * 300000000 }}"
LONG_PROMPT = "a long prompt, tokenized on the tokenizer's threads " * 40
QUICK = dict(chat_template_timeout=1.0, chat_template_processes=2)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "reasoning_content": "The user wants the weather.",
      "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}],
]


def chat(content: str, **kwargs) -> pb.GenerateRequest:
    return build_request(messages=[{"role": "user", "content": content}], max_tokens=2, **kwargs)


async def collect(svc: WorkerService, request: pb.GenerateRequest) -> str:
    return "".join([c.text async for c in svc.generate(request)])


def serve(model_dir: Path, template: str | None, fn, **limits):
    """`fn(service)` on a worker service over the model's real tokenizer (with `template`
    as its chat template) and a scripted engine."""
    engine = ScriptedEngine(model_dir, reply="ok")
    if template is not None:
        engine.tokenizer._tokenizer.chat_template = template

    async def main():
        svc = WorkerService("w", lambda: engine, metrics=False, templates=ChatTemplateLimits(**limits))
        await svc.start(timeout=30)
        try:
            return await asyncio.wait_for(fn(svc), 120)
        finally:
            await svc.stop()

    return asyncio.run(main())


async def until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.05)


def test_a_time_bomb_costs_its_request_a_clear_error_within_its_deadline(tiny_model_dir):
    """The bomb's chat is refused (400) naming the template, the limit and that it was
    exceeded, within its deadline; chats and prompts that come meanwhile are served."""
    async def fn(svc):
        await until(lambda: len(svc.renders.pids) == 2, what="the render processes' start")
        t0 = time.monotonic()
        bomb = asyncio.ensure_future(collect(svc, chat("boom")))
        await until(lambda: svc.renders.rendering == 1, what="the bomb's render")
        others = await asyncio.gather(collect(svc, chat("hi")), collect(svc, build_request("hey", max_tokens=2)),
                                      collect(svc, build_request(LONG_PROMPT, max_tokens=2)))
        with pytest.raises(InvalidRequest) as e:
            await bomb
        return others, str(e.value), time.monotonic() - t0

    others, error, took = serve(tiny_model_dir, BOMB_ON_BOOM, fn, **QUICK)
    assert others == ["ok", "ok", "ok"]
    assert "chat template" in error and "chat_template_timeout=1 s" in error and "exceeded" in error
    assert took < 30  # its deadline is 1 s: far less than "never"


def test_two_stuck_renders_block_neither_a_third_chat_nor_a_long_prompt(tiny_model_dir):
    """Two renders that hold their processes for a long deadline leave the other processes
    (by default) to a normal chat and the tokenizer's threads to a long prompt; a request that goes away
    leaves its render to end by its deadline, its process killed and replaced."""
    async def fn(svc):
        processes = svc.templates.chat_template_processes  # the default
        await until(lambda: len(svc.renders.pids) == processes, what="the render processes' start")
        bombs = [asyncio.ensure_future(collect(svc, chat("boom"))) for _ in range(2)]
        await until(lambda: svc.renders.rendering == 2, what="the bombs' renders")
        served = await asyncio.gather(collect(svc, chat("hi")), collect(svc, build_request(LONG_PROMPT, max_tokens=2)))
        still = svc.renders.rendering
        stuck_pids = set(svc.renders.pids)
        for b in bombs:  # the clients give up (a 504, a disconnect)
            b.cancel()
        await until(lambda: svc.renders.rendering == 0, what="the abandoned renders' end")
        await until(lambda: len(svc.renders.pids) == processes, what="the killed processes' replacement")
        return served, still, stuck_pids, set(svc.renders.pids)

    served, still, before, after = serve(tiny_model_dir, BOMB_ON_BOOM, fn, chat_template_timeout=4.0)
    assert served == ["ok", "ok"] and still == 2
    assert len(before - after) == 2  # the two that rendered the bombs were killed


def test_a_time_bomb_in_a_gguf_s_metadata_is_bounded_too(tiny_model_dir, tmp_path):
    """A template from a GGUF's metadata (tokenizer.chat_template, imported into the model's
    tokenizer_config.json) renders in the same processes as any other."""
    from gguf_export import export

    from cluster.gguf import import_gguf

    src = tmp_path / "src"
    shutil.copytree(tiny_model_dir, src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = BOMB_ON_BOOM
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    model = import_gguf(export(src, tmp_path / "bomb.gguf"), tmp_path / "imported")

    async def fn(svc):
        with pytest.raises(InvalidRequest) as e:
            await collect(svc, chat("boom"))
        return str(e.value), await collect(svc, chat("hi"))

    error, served = serve(model, None, fn, **QUICK)
    assert "chat_template_timeout=1 s" in error and served == "ok"


def test_a_huge_string_is_refused_without_growing_the_worker(tiny_model_dir):
    """'x' * 300000000 fails in its render process (its memory cap, or its size limit
    where the OS does not enforce the cap): the worker itself does not grow."""
    clear_refs = Path("/proc/self/clear_refs")

    def peak() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return resident_bytes()

    async def fn(svc):
        await until(lambda: len(svc.renders.pids) == 2, what="the render processes' start")
        if clear_refs.exists():
            clear_refs.write_text("5")  # the peak resident size starts again from now
        before = resident_bytes()
        with pytest.raises(InvalidRequest) as e:
            await collect(svc, chat("hi"))
        return str(e.value), peak() - before

    error, growth = serve(tiny_model_dir, HUGE, fn, **QUICK)
    assert "chat template" in error and ("chat_template_memory_mb=256" in error
                                         or "max_chat_template_chars=8000000" in error), error
    assert growth < 100 << 20


def test_a_rendered_prompt_over_the_size_limit_is_refused(tiny_model_dir):
    async def fn(svc):
        with pytest.raises(InvalidRequest) as e:
            await collect(svc, chat("hi"))
        return str(e.value)

    error = serve(tiny_model_dir, "{{ 'y' * 200000 }}", fn, max_chat_template_chars=100_000, **QUICK)
    assert "rendered 200000 characters" in error and "max_chat_template_chars=100000" in error


def test_a_template_s_own_error_stays_a_clear_400_and_leaves_the_worker_healthy(tiny_model_dir):
    """raise_exception (a TemplateError) in the render process is the request's 400 with
    the template's message; it is no timeout, and the process goes on serving."""
    refuses = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first message must be a system "
               "message') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")

    async def fn(svc):
        await until(lambda: len(svc.renders.pids) == 2, what="the render processes' start")
        pids = svc.renders.pids
        errors = []
        for _ in range(4):  # past unhealthy_after_template_timeouts, were they counted
            with pytest.raises(InvalidRequest) as e:
                await collect(svc, chat("hi"))
            errors.append(e.value)
        return errors, pids == svc.renders.pids, svc.unhealthy_reason

    errors, same_processes, reason = serve(tiny_model_dir, refuses, fn, **QUICK)
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message == (
        "the chat template could not be applied to these messages: the first message must be a system message")
        for e in errors)
    assert same_processes and reason == ""


def test_the_worker_is_unhealthy_while_renders_time_out_and_healthy_again_after(tiny_model_dir):
    """Renders that time out back to back make the worker report itself unhealthy (load
    report, /health through `unhealthy_reason`); a probe render that finishes in time
    makes it healthy again, with no request from outside (the router sends none)."""
    async def fn(svc):
        assert svc.unhealthy_reason == ""
        for _ in range(2):
            with pytest.raises(InvalidRequest):
                await collect(svc, chat("boom"))
        reason, report = svc.unhealthy_reason, svc.load_report()
        await until(lambda: svc.unhealthy_reason == "", what="the recovery")
        return reason, report, svc.load_report()

    reason, report, after = serve(tiny_model_dir, BOMB_ON_BOOM, fn, unhealthy_after_template_timeouts=2, **QUICK)
    assert "2 chat-template renders in a row ran past chat_template_timeout=1 s" in reason
    assert report.unhealthy_reason == reason and not report.stalled
    assert after.unhealthy_reason == ""


def test_a_worker_that_cannot_start_render_processes_is_unhealthy(tiny_model_dir, monkeypatch):
    """No render process can start (here: the interpreter is missing): chats are refused
    as UNAVAILABLE (another worker may serve them), prompts are served, and the worker
    reports itself unhealthy."""
    monkeypatch.setattr("cluster.worker.chat_render.sys.executable", "/nonexistent/python")

    async def fn(svc):
        await until(lambda: svc.unhealthy_reason != "", what="the failed start")
        with pytest.raises(Exception) as e:
            await collect(svc, chat("hi"))
        return svc.unhealthy_reason, e.value, await collect(svc, build_request("hey", max_tokens=2))

    reason, error, served = serve(tiny_model_dir, None, fn, **QUICK)
    assert "no chat-template render process can be started" in reason
    assert error.code == grpc.StatusCode.UNAVAILABLE and "send this request elsewhere" in error.message
    assert served == "ok"


def test_through_the_router_a_time_bomb_is_the_client_s_400_not_retried(tiny_model_dir):
    """The router passes the refusal on as the client's error (not a 5xx it would retry on
    another worker, nor a failure of the worker): the next chat is served there."""
    import openai

    from scripted_engine import ScriptedServer

    engine = ScriptedEngine(tiny_model_dir, reply="ok")
    engine.tokenizer._tokenizer.chat_template = BOMB_ON_BOOM
    srv = ScriptedServer(engine, router=True, templates=ChatTemplateLimits(**QUICK))
    try:
        c = openai.OpenAI(base_url=srv.router_url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"exceeded its time limit .*chat_template_timeout=1 s"):
            c.chat.completions.create(model="", messages=[{"role": "user", "content": "boom"}], max_tokens=2)
        r = c.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].message.content == "ok"
        assert engine.prompts == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    finally:
        srv.stop()


def test_the_router_places_nothing_on_a_worker_reporting_itself_unhealthy_and_keeps_its_streams():
    reg = Registry(connect=False)
    w = reg.register("w1", "a:1", "", pb.LoadReport(worker_id="w1", model="m"))
    abandoned: list[str] = []

    class Stream:  # a proxy attempt on the worker
        def abandon(self, reason: str) -> None:
            abandoned.append(reason)

    w.attempts.add(Stream())
    reg.record_report(w, pb.LoadReport(worker_id="w1", model="m", unhealthy_reason="renders stuck"))
    assert w.state == UNHEALTHY and abandoned == []
    assert "unhealthy: renders stuck" in format_workers([w.info()]).splitlines()[2]
    with pytest.raises(Exception) as e:
        reg.candidates("m")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    reg.record_report(w, pb.LoadReport(worker_id="w1", model="m"))
    assert w.state == HEALTHY and reg.candidates("m") == [w]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir)


TEMPLATES = sorted(p.stem for p in (Path(__file__).parents[1] / "cluster" / "chat_templates").glob("*.jinja"))


def test_renders_are_transformers_own_byte_for_byte(tokenizer):
    """Each real template Orchard ships (and the tiny model's own), on a plain chat, one
    with a system message, and a tool call with its result (with and without tools): the
    render process gives what apply_chat_template(tokenize=False) gives, or the same error."""
    hf = tokenizer._tokenizer
    own = hf.chat_template
    cases = [(m, t) for m in CONVERSATIONS for t in (None, TOOLS)]

    def expected():
        out = []
        for messages, tools in cases:
            try:
                out.append(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                         tokenize=False))
            except Exception as e:
                out.append(f"error: {e}")
        return out

    async def rendered(pool):
        out = []
        for messages, tools in cases:
            try:
                out.append(await pool.render(render_call(tokenizer, messages, tools)))
            except InvalidRequest as e:
                out.append(f"error: {e.message.split('messages: ', 1)[-1]}")
        return out

    async def main():
        pool = RenderPool(ChatTemplateLimits(chat_template_processes=1))
        pool.start()
        differ, errors_only = [], []
        try:
            for name, text in [("own", own)] + [(name, template_text(name)) for name in TEMPLATES]:
                hf.chat_template = text
                want, got = expected(), await rendered(pool)
                if got != want:
                    differ.append((name, got, want))
                if all(g.startswith("error: ") for g in got):
                    errors_only.append(name)
        finally:
            hf.chat_template = own
            await pool.close()
        return differ, errors_only

    differ, errors_only = asyncio.run(main())
    assert not differ
    assert not errors_only


def test_every_parameter_of_render_jinja_template_is_known():
    """A template variable named as one of render_jinja_template's parameters is refused
    before it reaches a render process: a new one in a transformers release must be added."""
    import inspect

    from transformers.utils.chat_template_utils import render_jinja_template

    from cluster.worker.chat_render import RENDER_PARAMETERS

    params = inspect.signature(render_jinja_template).parameters.values()
    assert {p.name for p in params if p.kind is not p.VAR_KEYWORD} == RENDER_PARAMETERS


def test_a_chat_is_tokenized_as_apply_chat_template_tokenizes_it(tiny_model_dir):
    """Through the service, a chat's prompt tokens are apply_chat_template's, with tools and
    template variables, short (inline) and long (on the tokenizer's threads)."""
    engine_tok = ScriptedEngine(tiny_model_dir).tokenizer
    long = "word " * INLINE_TOKENIZE_CHARS
    cases = [(CONVERSATIONS[1], None, {}), (CONVERSATIONS[2], TOOLS, {"enable_thinking": False}),
             ([{"role": "user", "content": long}], None, {})]

    async def fn(svc):
        out = []
        for messages, tools, kwargs in cases:
            request = build_request(messages=messages, tools=tools, chat_template_kwargs=kwargs or None,
                                    max_tokens=1, echo=True)
            out.append([list(c.prompt_token_ids) async for c in svc.generate(request) if c.prompt_token_ids][0])
        return out

    got = serve(tiny_model_dir, None, fn, **QUICK)
    want = [list(engine_tok.apply_chat_template(m, tools=t, add_generation_prompt=True, **k)) for m, t, k in cases]
    assert got == want


def test_bad_limits_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--chat-template-timeout must be at least"):
        ChatTemplateLimits(chat_template_timeout=0).check()
    with pytest.raises(ValueError, match="--chat-template-processes must be at least 1, not 0"):
        RenderPool(ChatTemplateLimits(chat_template_processes=0))


def test_a_worker_process_refuses_a_time_bomb_template_file_and_says_when_it_is_unhealthy(
        tiny_model_dir, tmp_path, worker_process):
    """End to end, a model directory whose chat_template.jinja is the bomb: the chat is an
    HTTP 400 naming the limit, a prompt is served meanwhile, /health and gRPC health say
    NOT_SERVING after renders time out back to back, and SERVING again after."""
    model = tmp_path / "bomb-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(BOMB_ON_BOOM)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    w = worker_process(model, "--chat-template-timeout", "1", "--unhealthy-after-template-timeouts", "2",
                       "--chat-template-processes", "2", "--max-model-len", "512")

    def post(path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://{w.http}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health() -> tuple[int, int]:
        try:
            with urllib.request.urlopen(f"http://{w.metrics}/health", timeout=10) as r:
                http = r.status
        except urllib.error.HTTPError as e:
            http = e.code
        with grpc.insecure_channel(w.grpc) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        return http, status

    def wait_health(want: tuple[int, int]) -> None:
        deadline = time.monotonic() + 60
        while health() != want:
            assert time.monotonic() < deadline, f"health stayed {health()}, not {want}"
            time.sleep(0.1)

    messages = lambda content: {"messages": [{"role": "user", "content": content}], "max_tokens": 2}  # noqa: E731
    assert post("/v1/chat/completions", messages("hi"))[0] == 200
    code, body = post("/v1/chat/completions", messages("boom"))
    assert code == 400 and "chat_template_timeout=1 s" in body["error"]["message"], body
    assert post("/v1/completions", {"prompt": "hey", "max_tokens": 2})[0] == 200
    assert post("/v1/chat/completions", messages("boom"))[0] == 400
    wait_health((503, health_pb2.HealthCheckResponse.NOT_SERVING))
    wait_health((200, health_pb2.HealthCheckResponse.SERVING))  # its probe renders in time
    assert post("/v1/chat/completions", messages("hi"))[0] == 200
