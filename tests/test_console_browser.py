"""The web console in a real browser: Debian's headless Chromium driven by Playwright (the
system browser: nothing downloaded), against a real router and real workers as processes.

One cluster for the module: worker-0 (the random-weight tiny model, started by
`LocalCluster`) and worker-1 (SmolLM2-135M-Instruct when it is already in the models cache,
for a chat with a real answer; the tiny model otherwise), the router with an admin key
(inference open) and 0.5 s heartbeats. Tests run in file order; the one that kills a
worker comes last. `ORCHARD_CONSOLE_SCREENSHOTS=DIR` also saves the README's pictures
(the fleet view and the playground) into DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.models_cache import home
from cluster.modelgen import REAL_MODELS
from cluster.security import ClientSecurity
from cluster.up import LocalCluster, free_port
from conftest import WorkerProcess

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/setup --test installs it)")

ADMIN_KEY = "browser-admin-key"
HEARTBEAT = 0.5
REAL = "smollm2-135m-instruct"
SCRIPT_NAME = '<script>document.title="pwned"</script><img src=x>'
WAIT_MS = 60_000  # for what a loaded machine may take long to show (a model's first answer)
expect = playwright_api.expect


def real_model_cached() -> Path | None:
    """SmolLM2's directory when its GGUF is in the models cache already (never downloaded here)."""
    if not (home() / "downloads" / REAL / Path(REAL_MODELS[REAL][1]).name).exists():
        return None
    from cluster.models_cache import real_model

    return real_model(REAL)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    http = f"127.0.0.1:{free_port()}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ORCHARD_ADMIN_KEY", ADMIN_KEY)  # the router's (and its workers'): drain needs it
        c = LocalCluster(tiny_model_dir, workers=1, grpc_address=f"127.0.0.1:{free_port()}", http_address=http,
                         metrics_address="127.0.0.1:0", worker_port_base=0, worker_metrics_port_base=0,
                         log_dir=tmp_path_factory.mktemp("console-logs"),
                         router_args=["--heartbeat-interval", str(HEARTBEAT)],
                         worker_args=["--num-kv-blocks", "256", "--max-model-len", "512"])
        c.client_security = lambda admin=False: ClientSecurity(api_key=ADMIN_KEY)  # its readiness check lists workers
        env.setenv("ORCHARD_JOIN_TOKEN", c.join_token)
        with c:
            real = real_model_cached()
            extra: list[WorkerProcess] = []

            def worker(model: Path, worker_id: str, *flags: str) -> WorkerProcess:
                w = WorkerProcess(model, "--router", c.router_address, "--worker-id", worker_id,
                                  "--num-kv-blocks", "256", "--max-model-len", "1024", *flags, http=False)
                extra.append(w)
                return w

            c.extra_worker_model = real or tiny_model_dir
            worker(c.extra_worker_model, "worker-1")
            c.real, c.start_extra = real is not None, worker
            c.page_url = f"http://{http}/"
            try:
                yield c
            finally:
                for w in extra:
                    w.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


class Console:
    """A page on the console, with what its browser logged and every URL it asked for."""

    def __init__(self, browser, cluster, width: int = 1280, height: int = 640):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.messages: list[tuple[str, str]] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.messages.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.messages.append(("pageerror", str(e))))
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(cluster.page_url)

    def worker(self, worker_id: str):
        return self.page.locator(f'[data-worker="{worker_id}"]')

    def tab(self, name: str) -> None:
        self.page.get_by_role("button", name=name, exact=True).click()

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def console(browser, cluster):
    c = Console(browser, cluster)
    yield c
    c.close()


def served_model(cluster) -> str:
    """worker-1's model name (a worker serves its directory's name)."""
    return Path(cluster.extra_worker_model).name


def state(cluster) -> dict:
    with urllib.request.urlopen(cluster.page_url + "console/state", timeout=10) as r:
        return json.load(r)


def shot(page, name: str) -> None:
    where = os.environ.get("ORCHARD_CONSOLE_SCREENSHOTS")
    if where:
        page.screenshot(path=str(Path(where) / name))


def test_the_page_loads_clean_and_shows_both_workers_healthy_with_their_model(console, cluster):
    expect(console.worker("worker-0").locator(".state")).to_have_text("healthy", timeout=WAIT_MS)
    expect(console.worker("worker-1").locator(".state")).to_have_text("healthy", timeout=WAIT_MS)
    expect(console.worker("worker-0").locator(".model")).to_have_text(Path(cluster.model).name)
    expect(console.worker("worker-1").locator(".model")).to_have_text(served_model(cluster))
    expect(console.page.locator("#live")).to_have_text("live")
    origin = cluster.page_url.rstrip("/")
    assert [u for u in console.requests if not u.startswith(origin + "/")] == []  # nothing from elsewhere
    assert [m for m in console.messages if m[0] in ("error", "warning", "pageerror")] == []


def test_a_chat_streams_and_shows_its_ttft(console, cluster):
    console.tab("Playground")
    page = console.page
    model = served_model(cluster)
    expect(page.locator("#chat-model option", has_text=model).first).to_be_attached(timeout=WAIT_MS)
    page.select_option("#chat-model", model)
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "24")
    page.fill("#chat-input", "What is the capital of France?")
    page.click("#chat-send")
    answer = page.locator(".msg-assistant .answer").last
    expect(page.locator("#chat-stats")).to_contain_text("TTFT", timeout=WAIT_MS)
    expect(page.locator("#chat-send")).to_be_enabled(timeout=WAIT_MS)  # the stream ended
    assert "TTFT -" not in page.text_content("#chat-stats") and "tokens/s" in page.text_content("#chat-stats")
    if cluster.real:
        expect(answer).to_contain_text("Paris")
    else:
        assert answer.text_content().strip()
    shot(page, "console-playground.png")
    console.tab("Fleet")
    expect(console.worker("worker-1").locator(".figures")).not_to_contain_text("TTFT -", timeout=WAIT_MS)
    shot(page, "console-fleet.png")
    console.tab("Requests")
    row = page.locator("#requests tbody tr").first
    expect(row.locator(".outcome")).to_have_text("ok", timeout=WAIT_MS)
    assert model in row.text_content()
    assert [m for m in console.messages if m[0] in ("error", "pageerror")] == []


def test_drain_is_refused_without_the_admin_key_and_works_with_it(console, cluster):
    page = console.page
    card = console.worker("worker-0")
    expect(card.locator(".state")).to_have_text("healthy", timeout=WAIT_MS)
    card.get_by_role("button", name="Drain").click()
    expect(page.locator("#notice")).to_contain_text("admin", timeout=WAIT_MS)
    assert {w["id"]: w["state"] for w in state(cluster)["workers"]}["worker-0"] == "healthy"
    console.tab("Keys")
    page.fill("#key-admin", ADMIN_KEY)
    page.get_by_role("button", name="Use").click()
    assert page.input_value("#key-admin") == ""  # the page never shows a key back
    expect(page.locator("#keys-status")).to_have_text("API key not set, admin key set")
    assert ADMIN_KEY not in page.content()
    assert page.evaluate("sessionStorage.length") == 0  # kept in the tab only when asked
    console.tab("Fleet")
    card.get_by_role("button", name="Drain").click()
    expect(card.locator(".state")).to_have_text("draining", timeout=WAIT_MS)
    card.get_by_role("button", name="Undrain").click()
    expect(card.locator(".state")).to_have_text("healthy", timeout=WAIT_MS)


def test_a_model_name_with_script_in_it_shows_as_text(console, cluster, tiny_model_dir):
    w = cluster.start_extra(tiny_model_dir, "worker-xss", "--served-model-name", SCRIPT_NAME)
    try:
        card = console.worker("worker-xss")
        expect(card.locator(".model")).to_have_text(SCRIPT_NAME, timeout=WAIT_MS)
        assert card.locator("script, img").count() == 0  # no element made of it
        console.tab("Playground")
        expect(console.page.locator("#chat-model option", has_text=SCRIPT_NAME)).to_have_count(1)
        assert console.page.title() == "Orchard console"
        assert [m for m in console.messages if m[0] in ("error", "pageerror")] == []
    finally:
        w.stop()


def test_the_page_works_at_a_phones_width(browser, cluster, tmp_path):
    from PIL import Image

    phone = Console(browser, cluster, width=390, height=844)
    try:
        expect(phone.worker("worker-0").locator(".state")).to_have_text("healthy", timeout=WAIT_MS)
        box, deadline = None, time.monotonic() + 30
        while box is None and time.monotonic() < deadline:  # a push may redraw the card as it is measured
            box = phone.worker("worker-0").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390  # the cards fit the screen
        path = tmp_path / "phone.png"
        phone.page.screenshot(path=str(path), full_page=True)
        image = Image.open(path).convert("RGB")
        assert image.width == 390
        colours = image.getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 20  # drawn, not a blank page
    finally:
        phone.close()


def test_thinking_folds_apart_tool_calls_show_and_a_completion_with_script_is_text(console):
    """The page's rendering of a stream, from a canned answer: a thinking model's chunks."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "Let me think."}}]},
              {"choices": [{"index": 0, "delta": {"content": 'It is <script>document.title="pwned"</script>'}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                  "function": {"name": "get_weather",
                                                                               "arguments": '{"city": '}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                            "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    console.page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    console.tab("Playground")
    page = console.page
    expect(page.locator("#chat-model option").first).to_be_attached(timeout=WAIT_MS)
    page.fill("#chat-input", "What is the weather in Paris?")
    page.click("#chat-send")
    reply = page.locator(".msg-assistant").last
    expect(reply.locator(".answer")).to_have_text('It is <script>document.title="pwned"</script>', timeout=WAIT_MS)
    fold = reply.locator("details.thinking")
    assert fold.get_attribute("open") is None  # folded until opened
    expect(fold.locator("pre")).to_have_text("Let me think.")
    expect(reply.locator(".call")).to_contain_text("tool call: get_weather")
    expect(reply.locator(".call pre")).to_have_text('{"city": "Paris"}')
    expect(page.locator("#chat-stats")).to_contain_text("12 tokens")
    assert reply.locator("script").count() == 0 and page.title() == "Orchard console"


def test_a_fleets_nodes_catalog_and_a_groups_ranks_are_drawn(console, cluster):
    """The fleet's parts of the state, drawn: the real state with a node, a catalog and a
    worker group added by the functions the router builds them with (a canned push)."""
    from cluster.console.state import catalog_fields, load_fields, node_fields
    from cluster.proto.orchard.v1 import orchard_pb2 as pb

    now = state(cluster)
    group = pb.GroupInfo(size=2, parallel="pipeline", members=[
        pb.GroupMember(rank=0, host="mac-1", memory_bytes=8 << 30, weight_bytes=3 << 30, first_layer=0,
                       last_layer=14, step_seconds=0.012),
        pb.GroupMember(rank=1, host="mac-2", memory_bytes=8 << 30, weight_bytes=3 << 30, first_layer=14,
                       last_layer=28)])
    now["workers"][0].update(load_fields(pb.LoadReport(model="big", kv_blocks_total=64, group=group)),
                             node="mac-1", catalog_model="big")
    now["nodes"] = [node_fields(pb.NodeInfo(state="healthy", report=pb.NodeReport(
        node_id="mac-1", address="10.0.0.1:50070", platform="metal", memory_budget_bytes=16 << 30,
        memory_reserved_bytes=6 << 30, memory_available_bytes=9 << 30, disk_free_bytes=100 << 30,
        models=[pb.DiskModel(name="big", weight_bytes=6 << 30)],
        workers=[pb.ManagedWorker(worker_id="big-1", model="big", state="running", reserved_bytes=6 << 30,
                                  group_size=2, group_rank=0)],
        transfers=[pb.Transfer(source="hf:org/coder", bytes_done=1 << 30, bytes_total=4 << 30,
                               **{"from": "hub"})])))]
    now["catalog"] = [catalog_fields(pb.CatalogModel(
        name="big", source="big", state="serving", pin=True, footprint_bytes=6 << 30, placements=[
            pb.ModelPlacement(node_id="mac-1", worker_id="big-1", state="running", group_rank=0, group_size=2)]),
        time.time()), catalog_fields(pb.CatalogModel(name="coder", source="hf:org/coder", state="pulling",
                                                     status="pulling on mac-1 25%", idle_seconds=0), time.time())]
    console.page.route("**/console/events", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=f"data: {json.dumps(now)}\n\n"))
    console.page.reload()
    card = console.worker(now["workers"][0]["id"])
    expect(card.locator(".group")).to_contain_text("rank 1 mac-2 · layers 14-27", timeout=WAIT_MS)
    expect(card).to_contain_text("node mac-1 · catalog big")
    node = console.page.locator('[data-node="mac-1"]')
    expect(node).to_contain_text("6.0 GB reserved of 16.0 GB")
    expect(node).to_contain_text("hf:org/coder from hub: 1.0 GB of 4.0 GB")
    big = console.page.locator('#catalog tr[data-model="big"]')
    expect(big).to_contain_text("(pinned)")
    expect(big.get_by_role("button", name="Unload")).to_be_visible()
    expect(big.get_by_role("button", name="Unpin")).to_be_visible()
    coder = console.page.locator('#catalog tr[data-model="coder"]')
    expect(coder).to_contain_text("pulling on mac-1 25%")
    expect(coder.get_by_role("button", name="Load")).to_be_visible()
    assert [m for m in console.messages if m[0] in ("error", "pageerror")] == []


def test_the_playground_says_why_a_chat_failed(console):
    """From canned answers: a 401 says where a key goes, a 503 when to try again (its
    Retry-After), and a stream cut before its [DONE] is an error, its partial answer kept."""
    error = {"Content-Type": "application/json"}
    answers = [(401, error, {"error": {"message": "invalid API key"}}, "invalid API key: enter a key under Keys"),
               (503, {**error, "Retry-After": "7"}, {"error": {"message": "no worker can take it"}},
                "no worker can take it: try again in 7 s"),
               (200, {"Content-Type": "text/event-stream"}, {"choices": [{"index": 0, "delta": {"content": "Par"}}]},
                "the stream was cut")]
    page = console.page
    console.tab("Playground")
    expect(page.locator("#chat-model option").first).to_be_attached(timeout=WAIT_MS)

    def canned(status: int, headers: dict, text: str):
        return lambda route: route.fulfill(status=status, headers=headers, body=text)

    for status, headers, body, said in answers:
        text = f"data: {json.dumps(body)}\n\n" if status == 200 else json.dumps(body)
        page.unroute("**/v1/chat/completions")
        page.route("**/v1/chat/completions", canned(status, headers, text))
        page.fill("#chat-input", "hello")
        page.click("#chat-send")
        expect(page.locator(".msg-assistant .error").last).to_contain_text(said, timeout=WAIT_MS)
        expect(page.locator("#chat-send")).to_be_enabled()
    expect(page.locator(".msg-assistant .answer").last).to_have_text("Par")
    expect(page.locator("#chat-stats")).to_have_text("failed")


def test_a_killed_worker_turns_unhealthy_on_the_page(console, cluster):
    """Killed by its PID: the router marks it after 3 missed heartbeats (1.5 s here) and the
    next push (at most a second later) shows it; a loaded machine is given more time."""
    card = console.worker("worker-0")
    expect(card.locator(".state")).to_have_text("healthy", timeout=WAIT_MS)
    t0 = time.monotonic()
    os.kill(cluster.workers[0].proc.pid, signal.SIGKILL)
    expect(card.locator(".state")).to_have_text("unhealthy", timeout=15_000)
    print(f"worker-0 shown unhealthy {time.monotonic() - t0:.1f} s after its kill")
    expect(console.worker("worker-1").locator(".state")).to_have_text("healthy")
