"""Chat templates are bounded (issue 37): a render has a time, size and memory limit, runs
in a process of its own (cluster/worker/chat_render.py) where it can be stopped, never
holds the tokenizer's threads, and a worker whose renders are stuck says so. The text is
transformers' own rendering, byte for byte, on every real template Orchard ships."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.errors import InvalidRequest
from cluster.formats.chat import template_text
from cluster.platform import resident_bytes
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.admin import format_workers
from cluster.router.registry import HEALTHY, UNHEALTHY, Registry
from cluster.sdk import build_request
from cluster.worker.chat_render import PLAIN_PROBE, ChatTemplateLimits, RenderPool, check_renderer, render_call
from cluster.worker.prompt import INLINE_TOKENIZE_CHARS
from cluster.worker.service import WorkerService
from scripted_engine import ScriptedEngine
from test_embeddings_api import post

# Renders the chat as ChatML, except that a message "boom" makes it loop without end (the
# nested range() loops of the GGUF: 10^10 turns).
BOMB_ON_BOOM = (
    "{% for m in messages %}{% if m['content'] == 'boom' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The probe's chat ("Hello") loops too: a template stuck for everyone.
BOMB_ON_BOOM_AND_HELLO = BOMB_ON_BOOM.replace("m['content'] == 'boom'", "m['content'] in ('boom', 'Hello')")
# A chat "slow" renders for a while (seconds), well within a long deadline.
SLOW_ON_SLOW = BOMB_ON_BOOM.replace("'boom'", "'slow'").replace("range(100000) %}{% for j in range(100000)",
                                                                "range(100000) %}{% for j in range(40)")
HUGE = "{{ 'x' * 300000000 }}"
LONG_PROMPT = "a long prompt, tokenized on the tokenizer's threads " * 40
# A deadline a legitimate render meets on a loaded 2-core machine; short ones only where every render is a bomb.
LIMITS = dict(chat_template_timeout=5.0, chat_template_processes=2)
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

    others, error, took = serve(tiny_model_dir, BOMB_ON_BOOM, fn, **LIMITS)
    assert others == ["ok", "ok", "ok"]
    assert "chat template" in error and "chat_template_timeout=5 s" in error and "exceeded" in error
    assert took < 60  # its deadline is 5 s: far less than "never"


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
        stuck_pids = set(svc.renders.pids)
        for b in bombs:  # the clients give up (a 504, a disconnect)
            b.cancel()
        await until(lambda: svc.renders.rendering == 0, what="the abandoned renders' end")
        await until(lambda: len(svc.renders.pids) == processes, what="the killed processes' replacement")
        return served, stuck_pids, set(svc.renders.pids)

    served, before, after = serve(tiny_model_dir, BOMB_ON_BOOM, fn, chat_template_timeout=5.0)
    assert served == ["ok", "ok"]
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

    error, served = serve(model, None, fn, **LIMITS)
    assert "chat_template_timeout=5 s" in error and served == "ok"


def test_a_huge_string_is_refused_without_growing_the_worker(tiny_model_dir):
    """'x' * 300000000 is refused in its render process before it is built (its size
    limit): the worker itself does not grow."""
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

    error, growth = serve(tiny_model_dir, HUGE, fn, **LIMITS)
    assert error.endswith("the model's chat template would build a string or list of 300000000 characters from "
                          "these messages, over its limit (max_chat_template_chars=8000000): refused"), error
    assert growth < 100 << 20


# Each builds a value far over the size limit: a product at once, or doubling in a loop.
GROWERS = {
    "repeated string": "{{ 'x' * 10**13 }}",
    "repeated list": "{{ ([0] * 10**13)|length }}",
    "list of long strings": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|join|length }}",
    "doubled with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                      "{% endfor %}{{ ns.s|length }}",
    "doubled with +": "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}{{ ns.s|length }}",
    "squared integer": "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                       "{% endfor %}{{ 1 }}",
    "integer power": "{{ (2 ** (10**13)) > 1 }}",
    "padded string": "{{ 'x'.ljust(10**13) }}",
}


def test_values_over_the_size_limit_are_refused_before_they_are_built_on_every_os():
    """A template that multiplies, adds or concatenates its way past max_chat_template_chars
    is refused by the sandbox before it builds the value: the refusal is the size limit's,
    not the memory cap's (which macOS does not enforce), so no OS's swap takes it."""
    uncapped = ChatTemplateLimits(chat_template_processes=1, chat_template_memory_mb=1024, chat_template_timeout=30)

    async def main():
        pool, errors = RenderPool(uncapped), {}
        pool.start()
        try:
            for name, template in GROWERS.items():
                with pytest.raises(InvalidRequest) as e:
                    await pool.render({"conversations": [[{"role": "user", "content": "hi"}]],
                                       "chat_template": template})
                errors[name] = e.value.message
        finally:
            await pool.close()
        return errors

    for name, error in asyncio.run(main()).items():
        assert "would build a string or list of" in error and "(max_chat_template_chars=8000000)" in error, name


def test_a_rendered_prompt_over_the_size_limit_is_refused(tiny_model_dir):
    """Pieces each under the limit, more than it together: refused before they are joined."""
    async def fn(svc):
        with pytest.raises(InvalidRequest) as e:
            await collect(svc, chat("hi"))
        return str(e.value)

    pieces = "{% for i in range(100000) %}{{ 'y' * 50000 }}{% endfor %}"
    error = serve(tiny_model_dir, pieces, fn, max_chat_template_chars=100_000, **LIMITS)
    assert "rendered more than 100000 characters" in error and "max_chat_template_chars=100000" in error


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

    errors, same_processes, reason = serve(tiny_model_dir, refuses, fn, **LIMITS)
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT and e.message == (
        "the chat template could not be applied to these messages: the first message must be a system message")
        for e in errors)
    assert same_processes and reason == ""


async def bombs(svc: WorkerService, n: int) -> None:
    """`n` time bombs at once, each refused."""
    refused = await asyncio.gather(*(collect(svc, chat("boom")) for _ in range(n)), return_exceptions=True)
    assert all(isinstance(e, InvalidRequest) for e in refused), refused


def test_a_client_s_time_bombs_alone_never_make_the_worker_unhealthy(tiny_model_dir):
    """Renders that time out back to back because of what one client sent (the model's
    template is fine): the probe that runs at once renders in time, and the worker never
    reports itself unhealthy, however often the client does it."""
    async def fn(svc):
        await until(lambda: len(svc.renders.pids) == 2, what="the render processes' start")
        reasons = set()

        async def watch():
            while True:
                reasons.add(svc.unhealthy_reason)
                await asyncio.sleep(0.01)

        watcher = asyncio.ensure_future(watch())
        try:
            for _ in range(2):  # each time past unhealthy_after_template_timeouts
                await bombs(svc, 2)
                reasons.add(svc.unhealthy_reason)  # the probe is due, not rendered yet
                await until(lambda: not svc.renders.probing, what="the probe")
                reasons.add(svc.unhealthy_reason)
        finally:
            watcher.cancel()
        return reasons, svc.load_report(), await collect(svc, chat("hi"))

    reasons, report, served = serve(tiny_model_dir, BOMB_ON_BOOM, fn, unhealthy_after_template_timeouts=2, **LIMITS)
    assert reasons == {""} and report.unhealthy_reason == "" and served == "ok"


def test_a_stuck_render_pool_makes_the_worker_unhealthy_until_a_probe_finishes(tiny_model_dir):
    """Renders that time out back to back, and a probe (the model's template on a one-line
    chat) that times out too: the worker reports itself unhealthy (load report, /health
    through `unhealthy_reason`); a later probe that finishes in time makes it healthy
    again, with no request from outside (the router sends none)."""
    async def fn(svc):
        await until(lambda: len(svc.renders.pids) == 2, what="the render processes' start")
        await bombs(svc, 2)
        await until(lambda: svc.unhealthy_reason != "", what="the probe's timeout")
        reason, report = svc.unhealthy_reason, svc.load_report()
        svc.renders.probe_call = PLAIN_PROBE  # what stuck it passes: the next probe renders
        await until(lambda: svc.unhealthy_reason == "", what="the recovery")
        return reason, report, svc.load_report()

    reason, report, after = serve(tiny_model_dir, BOMB_ON_BOOM_AND_HELLO, fn, unhealthy_after_template_timeouts=2,
                                  **LIMITS)
    assert reason == ("a probe render (the model's chat template on a one-line chat) ran past chat_template_timeout="
                      "5 s, after 2 renders in a row ran past their deadline")
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

    reason, error, served = serve(tiny_model_dir, None, fn, **LIMITS)
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
    srv = ScriptedServer(engine, router=True, templates=ChatTemplateLimits(**LIMITS))
    try:
        c = openai.OpenAI(base_url=srv.router_url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"exceeded its time limit .*chat_template_timeout=5 s"):
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


TEMPLATES = sorted(p.stem for p in
                   (Path(__file__).parents[1] / "cluster" / "formats" / "chat_templates").glob("*.jinja"))


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

    got = serve(tiny_model_dir, None, fn, **LIMITS)
    want = [list(engine_tok.apply_chat_template(m, tools=t, add_generation_prompt=True, **k)) for m, t, k in cases]
    assert got == want


def test_bad_limits_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--chat-template-timeout must be at least"):
        ChatTemplateLimits(chat_template_timeout=0).check()
    with pytest.raises(ValueError, match="--chat-template-processes must be at least 1, not 0"):
        RenderPool(ChatTemplateLimits(chat_template_processes=0))


@pytest.mark.slow  # a worker process, and three renders that each take their 5 s deadline
def test_a_worker_process_refuses_a_time_bomb_template_file_and_says_when_it_is_unhealthy(
        tiny_model_dir, tmp_path, worker_process):
    """End to end, a model directory whose chat_template.jinja is the bomb (on the probe's
    one-line chat too): the chat is an HTTP 400 naming the limit, a prompt is served
    meanwhile, /health and gRPC health say NOT_SERVING after renders and the probe time out."""
    model = tmp_path / "bomb-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(BOMB_ON_BOOM_AND_HELLO)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    w = worker_process(model, "--chat-template-timeout", "5", "--unhealthy-after-template-timeouts", "2",
                       "--chat-template-processes", "2", "--max-model-len", "512")

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
    assert post(w.http, "/v1/chat/completions", messages("hi"))[0] == 200
    code, body = post(w.http, "/v1/chat/completions", messages("boom"))
    assert code == 400 and "chat_template_timeout=5 s" in body["error"]["message"], body
    assert post(w.http, "/v1/completions", {"prompt": "hey", "max_tokens": 2})[0] == 200
    with ThreadPoolExecutor(2) as pool:  # two more at once: the probe follows the second timeout in a row
        bombs = pool.map(post, [w.http] * 2, ["/v1/chat/completions"] * 2, [messages("boom")] * 2)
        assert [code for code, _ in bombs] == [400] * 2
    wait_health((503, health_pb2.HealthCheckResponse.NOT_SERVING))


def test_a_slow_fork_fails_no_render_in_flight(tiny_model_dir, monkeypatch):
    """A fork past its time (a loaded machine; here every fork is) delays that one start:
    the render in flight on another process finishes, and the chat that needed the new
    process gets it when it comes."""
    async def fn(svc):
        await until(lambda: len(svc.renders.idle_pids) == 2, what="the render processes' start")
        slow = asyncio.ensure_future(collect(svc, chat("slow")))
        await until(lambda: svc.renders.rendering == 1, what="the slow render")
        monkeypatch.setattr("cluster.worker.chat_render.FORK_TIMEOUT_SECONDS", 0.001)
        os.kill(svc.renders.idle_pids[0], signal.SIGKILL)  # the idle process ends: the next chat needs a fork
        served = await collect(svc, chat("hi"))
        return served, await slow

    assert serve(tiny_model_dir, SLOW_ON_SLOW, fn, chat_template_timeout=60.0, chat_template_processes=2) == (
        "ok", "ok")


def test_a_render_whose_fork_server_goes_away_is_rendered_again(tiny_model_dir):
    """The fork server ends (its render processes with it) under a render in flight: the
    render is tried once more on a process of a new fork server, and the chat is served."""
    async def fn(svc):
        await until(lambda: len(svc.renders.idle_pids) == 2, what="the render processes' start")
        slow = asyncio.ensure_future(collect(svc, chat("slow")))
        await until(lambda: svc.renders.rendering == 1, what="the slow render")
        os.kill(svc.renders.fork_server_pid, signal.SIGKILL)
        return await slow

    assert serve(tiny_model_dir, SLOW_ON_SLOW, fn, chat_template_timeout=60.0, chat_template_processes=2) == "ok"


@pytest.fixture
def transformers_without_renderer(tmp_path, monkeypatch):
    """Python processes started from here import a transformers without
    render_jinja_template (as before 4.52)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import transformers.tokenization_utils_base  # binds the name itself first\n"
        "import transformers.utils.chat_template_utils as m\ndel m.render_jinja_template\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))


def test_a_fork_server_that_cannot_import_its_renderer_says_why_in_one_line(transformers_without_renderer):
    async def main():
        pool = RenderPool(ChatTemplateLimits(chat_template_processes=1))
        pool.start()
        try:
            await until(lambda: pool.stuck != "", what="the failed start")
            return pool.stuck
        finally:
            await pool.close()

    reason = asyncio.run(main())
    assert reason.startswith("no chat-template render process can be started (the fork server cannot start: "
                             "ImportError: cannot import name 'render_jinja_template'") and "\n" not in reason


def test_a_worker_refuses_to_start_with_a_transformers_without_the_renderer(tiny_model_dir,
                                                                             transformers_without_renderer):
    """A one-line error and a permanent exit at start, not a worker that is unhealthy for ever."""
    from cluster.exit_codes import EXIT_PERMANENT

    run = subprocess.run([sys.executable, "-m", "cluster.cli", "worker", "serve", "--model", str(tiny_model_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_PERMANENT, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("orchard worker serve:")]
    assert len(lines) == 1 and "render_jinja_template" in lines[0] and "transformers>=4.52" in lines[0], run.stderr


def test_check_renderer_names_the_release_to_install(monkeypatch):
    from transformers.utils import chat_template_utils

    monkeypatch.delattr(chat_template_utils, "render_jinja_template")
    with pytest.raises(ValueError, match=r"render_jinja_template.*pip install 'transformers>=4\.52'"):
        check_renderer()
