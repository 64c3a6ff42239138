// The console's entry: tabs, keys, the live state (pushed by the server) and the actions.

import { events, forgetKeys, HttpError, keysSet, loadKeys, post, setKeys } from "./api.js";
import { setModels, setUpChat } from "./chat.js";
import { $ } from "./dom.js";
import { renderFleet, renderRequests } from "./fleet.js";

let connection = null; // the AbortController of the live stream

function notice(text, kind = "error") {
  const box = $("#notice");
  box.hidden = !text;
  box.className = `notice notice-${kind}`;
  box.textContent = text || "";
}

function show(view) {
  for (const tab of document.querySelectorAll(".tab")) tab.setAttribute("aria-pressed", tab.dataset.view === view);
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.id !== `view-${view}`;
}

const act = {
  async drain(worker, drain) {
    try {
      await post(`/console/workers/${encodeURIComponent(worker)}/drain`, { drain });
      notice(`${worker}: ${drain ? "draining" : "taking requests again"}`, "ok");
    } catch (e) { notice(`${drain ? "drain" : "undrain"} ${worker}: ${e.message}`); }
  },
  async model(action, name) {
    notice(`${action} ${name}: under way`, "ok");
    try {
      await post(`/console/models/${action}`, { model: name });
      notice(`${action} ${name}: done`, "ok");
    } catch (e) { notice(`${action} ${name}: ${e.message}`); }
  },
};

function render(state) {
  $("#about").textContent = [state.role, state.router.id, state.router.policy].filter(Boolean).join(" · ");
  renderFleet(state, state.role === "router" ? act : null);
  renderRequests(state.requests);
  const served = state.workers.filter((w) => w.state === "healthy" && w.model).map((w) => w.model);
  setModels(served.concat((state.catalog || []).map((m) => m.name)));
}

function live(text, ok) {
  const badge = $("#live");
  badge.textContent = text;
  badge.className = ok ? "live live-on" : "live";
}

async function follow() {
  connection?.abort();
  const mine = new AbortController();
  connection = mine;
  let wait = 1000;
  let refused = false; // a notice of ours is up: cleared once the state comes again
  while (!mine.signal.aborted) {
    try {
      for await (const data of events("/console/events", { signal: mine.signal })) {
        live("live", true);
        wait = 1000;
        if (refused) { notice(""); refused = false; }
        render(JSON.parse(data));
      }
    } catch (e) {
      if (mine.signal.aborted) return;
      if (e instanceof HttpError && (e.status === 401 || e.status === 403)) {
        live("no access", false);
        notice(e.message);
        show("keys");
        return;
      }
      if (e instanceof HttpError) { // such as 503: too many consoles open
        notice(e.message);
        refused = true;
        wait = Math.max(wait, (e.retryAfter || 0) * 1000);
      }
    }
    live("reconnecting", false);
    await new Promise((resolve) => setTimeout(resolve, wait));
    wait = Math.min(wait * 2, 5000);
  }
}

function keysStatus() {
  const set = keysSet();
  $("#keys-status").textContent = `API key ${set.api ? "set" : "not set"}, admin key ${set.admin ? "set" : "not set"}`;
}

function setUpKeys() {
  loadKeys();
  $("#keys-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const api = $("#key-api").value;
    const admin = $("#key-admin").value;
    setKeys(api || null, admin || null, $("#key-remember").checked);
    $("#key-api").value = "";
    $("#key-admin").value = "";
    keysStatus();
    notice("");
    follow();
  });
  $("#keys-forget").addEventListener("click", () => {
    forgetKeys();
    keysStatus();
    follow();
  });
  keysStatus();
}

for (const tab of document.querySelectorAll(".tab")) tab.addEventListener("click", () => show(tab.dataset.view));
setUpKeys();
setUpChat();
follow();
