"""The web console, server side (cluster/console): the page and its files as shipped (a
strict Content-Security-Policy, no inline code, every value inserted as text, under the
first-load budget), the state's JSON and its pushes, keys, the operator's drain, and
`--console off`. In process, against fake workers; the page in a real browser is
test_console_browser.py."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
from html.parser import HTMLParser

import aiohttp
import grpc
import pytest

from cluster.config import add_flags, from_args
from cluster.console.hub import Hub
from cluster.console.routes import STATIC
from cluster.proto.orchard.v1 import orchard_pb2 as pb
from cluster.router.config import RouterConfig
from cluster.router.registry import DRAINING, HEALTHY
from cluster.security import SecurityConfig
from conftest import run
from test_router_fake import Cluster

API_KEY, ADMIN_KEY = "console-api-key", "console-admin-key"
FIRST_LOAD_BUDGET = 300 * 1024
WORKER_FIELDS = {"id", "address", "state", "model", "running", "waiting", "kv_used", "kv_total", "tokens_per_s",
                 "ttft", "inflight", "resident_bytes", "group", "circuit", "reason"}
REQUEST_FIELDS = {"id", "model", "worker", "ttft", "tokens", "retries", "resumes", "outcome", "cause", "seconds"}


def keyed(**kw) -> Cluster:
    return Cluster(http=True, security=SecurityConfig(api_keys=(API_KEY,), admin_key=ADMIN_KEY), **kw)


def bearer(key: str | None) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def get(c: Cluster, path: str, key: str | None = None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as s, s.get(f"http://{c.router.http_address}{path}", headers=bearer(key)) as r:
        return r.status, dict(r.headers), await r.read()


async def post(c: Cluster, path: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(f"http://{c.router.http_address}{path}", json=body,
                                                    headers=bearer(key)) as r:
        return r.status, await r.json()


class _Page(HTMLParser):
    """The shipped page's scripts, style sheets, inline code and attributes."""

    def __init__(self):
        super().__init__()
        self.scripts, self.links, self.inline, self.attributes = [], [], [], []
        self._in = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.attributes += [(tag, name) for name in attrs]
        if tag == "script":
            self.scripts.append(attrs.get("src"))
        if tag == "link":
            self.links.append(attrs.get("href"))
        if tag in ("script", "style"):
            self._in = tag

    def handle_endtag(self, tag):
        self._in = None

    def handle_data(self, data):
        if self._in and data.strip():
            self.inline.append((self._in, data.strip()[:60]))


def test_page_has_a_strict_csp_no_inline_code_and_inserts_values_as_text():
    page = _Page()
    page.feed((STATIC / "index.html").read_text())
    assert page.scripts and all(src and src.startswith("/console/") for src in page.scripts)
    assert page.inline == []  # no inline <script> or <style>
    assert not [(tag, a) for tag, a in page.attributes if a == "style" or a.startswith("on")]
    assert all(href.startswith("/console/") for href in page.links)  # nothing from another origin
    for script in STATIC.glob("*.js"):
        code = script.read_text()
        # markup from data would run: values go in with textContent / text nodes only
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function",
                             code), script.name
        assert not re.search(r"https?://", code), script.name  # nothing fetched from elsewhere

    async def main():
        async with Cluster(http=True) as c:
            status, headers, body = await get(c, "/")
            assert status == 200 and headers["Content-Type"].startswith("text/html")
            csp = dict(part.strip().split(" ", 1) for part in headers["Content-Security-Policy"].split(";"))
            assert csp["default-src"] == "'self'" and csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
            assert "unsafe" not in headers["Content-Security-Policy"]
            assert headers["X-Content-Type-Options"] == "nosniff"
            assert body == (STATIC / "index.html").read_bytes()
            status, headers, _ = await get(c, "/console/app.js")
            assert status == 200 and headers["Content-Type"].startswith("text/javascript")
            assert (await get(c, "/console/..%2Fstate.py"))[0] == 404
            assert (await get(c, "/console/nothing.js"))[0] == 404

    run(main())


def test_first_load_is_under_300_kb():
    """The page and everything it loads (its module graph, style sheet and icon)."""
    async def main():
        async with Cluster(http=True) as c:
            _, _, html = await get(c, "/")
            page = _Page()
            page.feed(html.decode())
            todo = [*page.scripts, *page.links]
            seen, total = set(), len(html)
            while todo:
                path = todo.pop()
                if path in seen:
                    continue
                seen.add(path)
                status, _, body = await get(c, path)
                assert status == 200, path
                total += len(body)
                todo += ["/console/" + m for m in re.findall(r'from "\./([\w.]+)"', body.decode())]
            assert {"/console/app.js", "/console/fleet.js", "/console/chat.js", "/console/console.css"} <= seen
            assert total < FIRST_LOAD_BUDGET, total
            _, _, state = await get(c, "/console/state")
            assert total + len(state) < FIRST_LOAD_BUDGET

    run(main())


def test_state_shows_the_workers_their_load_and_the_recent_requests():
    async def main():
        async with Cluster(http=True) as c:
            await c.generate("hello", max_tokens=6)
            with pytest.raises(grpc.aio.AioRpcError):
                await c.generate("invalid", max_tokens=4)  # refused by the worker: failed, with its cause
            status, headers, body = await get(c, "/console/state")
            assert status == 200 and headers["Content-Type"] == "application/json"
            state = json.loads(body)
            assert state["role"] == "router" and state["router"]["policy"] == "prefix_aware"
            assert state["router"]["grpc"] == c.router.grpc_address
            assert [w["id"] for w in state["workers"]] == ["w0", "w1"]
            for w in state["workers"]:
                assert WORKER_FIELDS <= set(w), WORKER_FIELDS - set(w)
                assert w["state"] == "healthy" and w["model"] == "fake" and w["kv_total"] == 100
            assert state["catalog"] is None and state["nodes"] == [] and state["failures"] == []
            done, failed = state["requests"][1], state["requests"][0]  # newest first
            assert REQUEST_FIELDS <= set(done)
            assert done["outcome"] == "ok" and done["tokens"] == 6 and done["worker"] in ("w0", "w1")
            assert done["ttft"] > 0 and done["seconds"] >= done["ttft"]
            assert failed["outcome"] == "failed" and "bad prompt" in failed["cause"]
            served = next(w for w in state["workers"] if w["id"] == done["worker"])
            assert served["ttft"] == done["ttft"]  # its TTFT now: the median of its recent requests

    run(main())


def test_a_resumed_request_is_recorded_with_its_cause():
    async def main():
        async with Cluster(http=True) as c:
            for w in c.workers:  # whichever takes it dies after 3 tokens; the other finishes it with 2
                w.die_after_tokens = 3
            chunks = await c.generate("resume me", max_tokens=5)
            assert sum(len(ch.token_ids) for ch in chunks) == 5
            dead = next(w for w in c.workers if w.dead)
            _, _, body = await get(c, "/console/state")
            record = json.loads(body)["requests"][0]
            assert record["outcome"] == "resumed" and record["resumes"] == 1 and record["worker"] != dead.worker_id
            assert record["tokens"] == 5 and "UNAVAILABLE" in record["cause"]

    run(main())


def test_state_and_pushes_take_an_api_key_when_keys_are_set():
    async def main():
        async with keyed() as c:
            assert (await get(c, "/"))[0] == 200  # the page holds no data
            assert (await get(c, "/console/console.css"))[0] == 200
            for path in ("/console/state", "/console/events"):
                status, headers, _ = await get(c, path)
                assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
                assert (await get(c, path, "wrong"))[0] == 401
            status, _, body = await get(c, "/console/state", API_KEY)
            assert status == 200 and len(json.loads(body)["workers"]) == 2

    run(main())


def test_drain_is_refused_without_the_admin_key_and_works_with_it():
    async def main():
        async with keyed() as c:
            path = "/console/workers/w0/drain"
            status, body = await post(c, path, {"drain": True})
            assert status == 401 and "admin" in body["error"]["message"]
            status, body = await post(c, path, {"drain": True}, API_KEY)
            assert status == 403 and "admin key" in body["error"]["message"]
            assert c.router.registry.workers["w0"].state == HEALTHY
            status, body = await post(c, path, {"drain": True}, ADMIN_KEY)
            assert status == 200 and body == {"worker": "w0", "draining": True}
            assert c.router.registry.workers["w0"].state == DRAINING and c.workers[0].draining  # told the worker too
            _, _, state = await get(c, "/console/state", API_KEY)
            assert {w["id"]: w["state"] for w in json.loads(state)["workers"]} == {"w0": "draining", "w1": "healthy"}
            status, _ = await post(c, path, {"drain": False}, ADMIN_KEY)
            assert status == 200 and c.router.registry.workers["w0"].state == HEALTHY
            status, body = await post(c, path, {"drain": "yes"}, ADMIN_KEY)
            assert status == 400 and body["error"]["param"] == "drain"
            status, body = await post(c, "/console/workers/nobody/drain", {"drain": True}, ADMIN_KEY)
            assert status == 404 and "nobody" in body["error"]["message"]
            status, body = await post(c, "/console/models/load", {"model": "fake"}, ADMIN_KEY)
            assert status == 400 and "--catalog" in body["error"]["message"]  # no fleet here
            status, body = await post(c, "/console/models/explode", {"model": "fake"}, ADMIN_KEY)
            assert status == 404

    run(main())


def test_events_push_the_state_and_then_each_change():
    async def main():
        async with Cluster(http=True) as c:
            async with aiohttp.ClientSession() as s, s.get(f"http://{c.router.http_address}/console/events") as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                assert "Content-Security-Policy" in r.headers

                async def next_state() -> dict:
                    while True:
                        line = (await asyncio.wait_for(r.content.readline(), 30)).decode()
                        if line.startswith("data: "):
                            return json.loads(line[6:])

                first = await next_state()
                assert {w["id"]: w["state"] for w in first["workers"]} == {"w0": "healthy", "w1": "healthy"}
                c.router.registry.set_drained(c.router.registry.workers["w1"], True)
                while (state := await next_state())["workers"][1]["state"] != "draining":
                    pass
                assert state["workers"][0]["state"] == "healthy"
                await c.kill(c.workers[0])
                while (state := await next_state())["workers"][0]["state"] != "unhealthy":
                    pass
                c.router.registry.set_drained(c.router.registry.workers["w1"], False)
                c.workers[1].stalled = True  # its engine wedged: its reports say so
                while (state := await next_state())["workers"][1]["state"] != "unhealthy":
                    pass
            assert c.router.http_address  # the router stops with a page open (tested by leaving the block)

    run(main())


def test_the_hub_pushes_only_changes_at_most_once_an_interval():
    async def main():
        state = {"n": 0}
        calls = []

        def snapshot():
            calls.append(1)
            return dict(state)

        hub = Hub(snapshot, interval=0.01)
        queue = hub.subscribe()
        assert await asyncio.wait_for(queue.get(), 10) == b'{"n":0}'
        while len(calls) < 20:  # many snapshots of the same state: nothing more pushed
            await asyncio.sleep(0.01)
        assert queue.empty()
        state["n"] = 1
        assert await asyncio.wait_for(queue.get(), 10) == b'{"n":1}'
        late = hub.subscribe()  # a page that opens later gets the latest state at once
        assert late.get_nowait() == b'{"n":1}'
        hub.unsubscribe(queue)
        await hub.close()
        assert await asyncio.wait_for(late.get(), 10) is None  # its stream ends with the server
        hub.unsubscribe(late)
        await asyncio.sleep(0.05)
        assert hub._task.done()

    run(main())


def test_console_off_serves_none_of_it():
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, RouterConfig)
    assert from_args(RouterConfig, parser.parse_args(["--console", "off"])).console == "off"
    assert from_args(RouterConfig, parser.parse_args([])).console == "on"

    async def main():
        async with Cluster(http=True, console="off") as c:
            for path in ("/", "/console/state", "/console/events", "/console/app.js"):
                assert (await get(c, path))[0] == 404, path
            assert (await post(c, "/console/workers/w0/drain", {"drain": True}))[0] == 404
            assert (await get(c, "/v1/models"))[0] == 200  # the API is still there

    run(main())


def test_a_request_record_keeps_a_bounded_cause():
    from cluster.router.recent import MAX_CAUSE_CHARS, RecentRequests

    recent = RecentRequests(size=3)
    records = [recent.begin(f"r{i}", "m") for i in range(5)]
    recent.finish(records[-1], "failed", "x" * 10_000)
    rows = recent.rows()
    assert [r["id"] for r in rows] == ["r4", "r3", "r2"]
    assert rows[0]["outcome"] == "failed" and len(rows[0]["cause"]) == MAX_CAUSE_CHARS
    assert pb.LoadReport  # the module imports what the state reads


def test_a_worker_serves_its_own_console(tiny_worker):
    with urllib.request.urlopen(f"http://{tiny_worker.http}/", timeout=10) as r:
        assert r.status == 200 and "script-src 'self'" in r.headers["Content-Security-Policy"]
    with urllib.request.urlopen(f"http://{tiny_worker.http}/console/state", timeout=10) as r:
        state = json.load(r)
    assert state["role"] == "worker" and state["router"]["grpc"] == tiny_worker.grpc
    (me,) = state["workers"]
    assert WORKER_FIELDS <= set(me) and me["state"] == "healthy" and me["kv_total"] == 512
    with pytest.raises(urllib.error.HTTPError) as refused:  # no actions on a worker's console
        urllib.request.urlopen(urllib.request.Request(f"http://{tiny_worker.http}/console/workers/x/drain",
                                                      data=b"{}", method="POST"), timeout=10)
    assert refused.value.code in (404, 405)


def test_with_a_fleet_the_state_has_the_catalog_and_the_admin_key_loads_pins_and_unloads(tmp_path):
    from aiohttp import ClientSession

    from cluster.fleet.config import FleetConfig
    from cluster.router.server import RouterServer
    from tests.fake_nodes import ServingNodes, disk_model

    async def main():
        config = RouterConfig(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0", metrics_address=None,
                              security=SecurityConfig(admin_key=ADMIN_KEY),
                              fleet=FleetConfig(catalog=str(tmp_path / "catalog.db")))
        router = RouterServer(config)
        nodes = router.controller.nodes = ServingNodes([router.registry])
        nodes.add_node("mac-1", 5.0, [disk_model("small", 3.0)])
        router.controller.catalog.add(pb.CatalogModel(name="chat", source="small"))
        await router.start()
        base = f"http://{router.http_address}"
        try:
            async with ClientSession() as s:
                async def act(action: str, key: str | None = ADMIN_KEY) -> tuple[int, dict]:
                    async with s.post(f"{base}/console/models/{action}", json={"model": "chat"},
                                      headers=bearer(key)) as r:
                        return r.status, await r.json()

                async def state() -> dict:
                    async with s.get(f"{base}/console/state") as r:
                        return await r.json()

                (entry,) = (await state())["catalog"]
                assert entry["name"] == "chat" and entry["state"] == "on disk" and not entry["pin"]
                assert (await act("load", None))[0] == 401
                assert not nodes.started
                status, loaded = await act("load")
                assert status == 200 and loaded["state"] == "serving", loaded
                now = await state()
                assert now["catalog"][0]["state"] == "serving" and now["catalog"][0]["placements"][0]["node"] == "mac-1"
                (worker,) = now["workers"]
                assert worker["catalog_model"] == "chat" and worker["node"] == "mac-1"
                status, pinned = await act("pin")
                assert status == 200 and pinned["pin"] is True and (await state())["catalog"][0]["pin"]
                assert (await act("unpin"))[1].get("pin", False) is False
                status, unloaded = await act("unload")
                assert status == 200 and unloaded["state"] != "serving"
                async with s.post(f"{base}/console/models/load", json={"model": "nope"},
                                  headers=bearer(ADMIN_KEY)) as r:
                    assert r.status == 404 and "chat" in (await r.json())["error"]["message"]
        finally:
            await router.stop(grace=0)
            await nodes.close()

    run(main())


def test_tokens_per_second_now_is_over_the_last_seconds_sampled_at_most_once_a_second():
    from cluster.console.state import RATE_WINDOW_SECONDS, TokenRates

    now = [0.0]
    rates = TokenRates(clock=lambda: now[0])
    assert rates.rates({"w": 0}) == {"w": 0.0}
    now[0] = 0.5
    assert rates.rates({"w": 1000}) == {"w": 0.0}  # within the second: not sampled
    for t in range(1, 4):
        now[0] = float(t)
        assert rates.rates({"w": 100 * t}) == {"w": 100.0}
    now[0] = 3.0 + RATE_WINDOW_SECONDS + 1  # idle since: the old samples leave the window
    rates.rates({"w": 300})
    now[0] += 1
    assert rates.rates({"w": 300}) == {"w": 0.0}


def test_an_action_needs_a_json_body_so_that_a_cross_site_form_cannot_send_one():
    """A page on another site can POST a form or a no-cors fetch (text/plain, form types)
    without asking the router first; it cannot send Content-Type: application/json."""
    async def main():
        async with keyed() as c:
            url = f"http://{c.router.http_address}/console/workers/w0/drain"
            async with aiohttp.ClientSession() as s:
                for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
                    headers = {**bearer(ADMIN_KEY), **({"Content-Type": content_type} if content_type else {})}
                    async with s.post(url, data=b'{"drain": true}', headers=headers) as r:
                        assert r.status == 415, content_type
                        assert "application/json" in (await r.json())["error"]["message"]
            assert c.router.registry.workers["w0"].state == HEALTHY

    run(main())


def test_a_server_with_no_admin_key_takes_no_action_from_a_page():
    """With no keys at all the API is open, but a console action still needs an admin key:
    a router on this machine would otherwise be drained by whoever can reach its port."""
    async def main():
        async with Cluster(http=True) as c:
            status, body = await post(c, "/console/workers/w0/drain", {"drain": True})
            assert status == 403 and "--admin-key" in body["error"]["message"]
            status, body = await post(c, "/console/models/load", {"model": "fake"}, "anything")
            assert status == 403 and "--admin-key" in body["error"]["message"]
            assert c.router.registry.workers["w0"].state == HEALTHY
            assert (await get(c, "/console/state"))[0] == 200  # the state stays open, as the API

    run(main())


def test_open_consoles_are_bounded_and_one_more_is_told_when_to_retry(monkeypatch):
    from cluster.console import routes

    monkeypatch.setattr(routes, "MAX_OPEN_CONSOLES", 2)

    async def main():
        async with Cluster(http=True) as c, aiohttp.ClientSession() as s:
            url = f"http://{c.router.http_address}/console/events"
            first, second = await s.get(url), await s.get(url)
            assert first.status == second.status == 200
            async with s.get(url) as third:
                assert third.status == 503 and int(third.headers["Retry-After"]) > 0
                assert "2" in (await third.json())["error"]["message"]
            first.close()  # a page closed: its place is free again
            for _ in range(300):
                async with s.get(url) as again:
                    if again.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert again.status == 200
            second.close()

    run(main())


def test_a_snapshot_walks_the_recent_requests_once_however_many_workers():
    from collections import deque

    from cluster.console.state import RouterState
    from cluster.router.recent import RecentRequests
    from cluster.router.registry import Registry

    class Counted(deque):
        walks = 0

        def __iter__(self):
            Counted.walks += 1
            return super().__iter__()

    registry = Registry(connect=False)
    for i in range(50):
        registry.add_static(f"127.0.0.1:{20000 + i}", pb.LoadReport(worker_id=f"w{i}", model="m"))
    recent = RecentRequests()
    recent._ring = Counted(maxlen=200)
    for i in range(200):
        record = recent.begin(f"r{i}", "m")
        record.worker, record.ttft = f"w{i % 50}", 0.1
    state = RouterState(registry, recent, lambda: {})
    Counted.walks = 0
    snapshot = state.snapshot()
    assert len(snapshot["workers"]) == 50 and len(snapshot["requests"]) == 100
    assert Counted.walks <= 2, Counted.walks  # the TTFTs in one walk, the rows in another


def test_every_console_answer_carries_the_security_headers_errors_too():
    async def main():
        async with keyed() as c:
            answers = [await get(c, "/console/nothing.js"), await get(c, "/console/state"),
                       await get(c, "/console/workers/w0/drain")]  # 404, 401, 405 (a GET)
            async with aiohttp.ClientSession() as s, s.post(
                    f"http://{c.router.http_address}/console/workers/w0/drain", json={"drain": "yes"},
                    headers=bearer(ADMIN_KEY)) as r:
                answers.append((r.status, dict(r.headers), b""))  # 400
            assert [status for status, _, _ in answers] == [404, 401, 405, 400]
            for _, headers, _ in answers:
                assert "script-src 'self'" in headers["Content-Security-Policy"]
                assert headers["X-Content-Type-Options"] == "nosniff"
            assert "Content-Security-Policy" not in (await get(c, "/v1/models", API_KEY))[1]  # the API's own

    run(main())


def test_a_refused_request_with_a_huge_id_and_model_is_recorded_within_bounds():
    """The record is begun before the request is checked: what it keeps of a client's id and
    model name is cut to their bounds, or the state every console is pushed grows with them."""
    from cluster.api.limits import MAX_ID_CHARS, MAX_NAME_CHARS

    async def main():
        async with Cluster(http=True) as c:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await c.generate("hi", model="m" * 1_000_000, request_id="r" * 1_000_000)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            _, _, body = await get(c, "/console/state")
            assert len(body) < 10_000
            (record,) = json.loads(body)["requests"]
            assert record["outcome"] == "failed" and len(record["model"]) <= MAX_NAME_CHARS
            assert len(record["id"]) <= MAX_ID_CHARS

    run(main())
