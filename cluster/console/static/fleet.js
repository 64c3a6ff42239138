// The fleet view (workers, groups and their ranks, nodes, the catalog) and the requests view.

import { $, bar, bytes, clock, el, ms, replace } from "./dom.js";

function stateBadge(state) {
  return el("span", { class: `state state-${state}` }, state);
}

function actionButton(label, run) {
  const button = el("button", { type: "button", class: "small" }, label);
  button.addEventListener("click", async () => {
    button.disabled = true;
    try { await run(); } finally { button.disabled = false; }
  });
  return button;
}

function groupPart(group) {
  if (!group) return null;
  return el("div", { class: "group" },
    el("div", { class: "muted" }, `group of ${group.size}, ${group.parallel} parallel`),
    el("ul", { class: "plain ranks" }, group.ranks.map((r) => el("li", {},
      el("b", {}, `rank ${r.rank}`), ` ${r.host || "?"} · layers ${r.first_layer}-${r.last_layer - 1} · `,
      `weights ${bytes(r.weight_bytes)} of ${bytes(r.memory_bytes)}`, r.step_ms ? ` · ${r.step_ms} ms a step` : ""))));
}

function workerCard(w, budgets, act) {
  const kvText = w.kv_total ? `${w.kv_used} / ${w.kv_total} blocks` : "-";
  const budget = budgets.get(w.node) || 0;
  const memory = budget ? bar("memory", w.resident_bytes, budget, `${bytes(w.resident_bytes)} of ${bytes(budget)}`)
    : el("div", { class: "bar" }, el("span", { class: "bar-label" }, "memory"),
      el("span", { class: "bar-text bar-alone" }, w.resident_bytes ? `${bytes(w.resident_bytes)} resident` : "-"));
  const draining = w.state === "draining";
  return el("article", { class: "card worker", dataset: { worker: w.id } },
    el("div", { class: "card-head" }, el("b", { class: "worker-id" }, w.id), stateBadge(w.state),
      w.circuit && w.circuit !== "closed" ? el("span", { class: "state state-unhealthy" }, `circuit ${w.circuit}`) : null),
    el("div", { class: "model" }, w.model || "(no model)"),
    el("div", { class: "muted" }, w.address, w.static ? " · static" : "",
      w.node ? ` · node ${w.node}` : "", w.catalog_model ? ` · catalog ${w.catalog_model}` : ""),
    memory,
    bar("KV", w.kv_used, w.kv_total, kvText),
    bar("seqs", w.running, w.max_num_seqs || w.running || 1, `${w.running} running, ${w.waiting} waiting`),
    el("div", { class: "figures" },
      el("span", {}, "tokens/s ", el("b", {}, w.tokens_per_s === null ? "-" : String(w.tokens_per_s))),
      el("span", {}, "TTFT ", el("b", {}, ms(w.ttft))),
      el("span", {}, "in flight ", el("b", {}, String(w.inflight)))),
    w.reason ? el("div", { class: "reason" }, w.reason) : null,
    groupPart(w.group),
    act ? el("div", { class: "actions" }, actionButton(draining ? "Undrain" : "Drain",
      () => act.drain(w.id, !draining))) : null);
}

function nodeCard(n) {
  return el("article", { class: "card node", dataset: { node: n.id } },
    el("div", { class: "card-head" }, el("b", {}, n.id), stateBadge(n.state)),
    el("div", { class: "muted" }, `${n.address} · ${n.platform}`),
    bar("memory", n.memory_reserved, n.memory_budget,
      `${bytes(n.memory_reserved)} reserved of ${bytes(n.memory_budget)} (${bytes(n.memory_available)} free)`),
    n.disk_budget ? bar("disk", n.disk_used, n.disk_budget, `${bytes(n.disk_used)} of ${bytes(n.disk_budget)}`)
      : el("div", { class: "muted" }, `disk ${bytes(n.disk_free)} free`),
    el("div", {}, "on disk: ", n.models.length ? n.models.map((m) => m.name).join(", ") : "none"),
    el("ul", { class: "plain" }, n.workers.map((w) => el("li", {},
      `${w.model} ${w.size > 1 ? `rank ${w.rank}/${w.size} ` : ""}${w.state}`,
      w.progress ? ` ${Math.round(w.progress * 100)}%` : "", ` · ${bytes(w.reserved_bytes)}`,
      w.reason ? ` · ${w.reason}` : ""))),
    n.transfers.map((t) => bar("fetch", t.done, t.total || t.done, `${t.source} from ${t.from}: ${bytes(t.done)}${t.total ? ` of ${bytes(t.total)}` : ""}`)));
}

function catalogRow(m, act) {
  const where = m.placements.map((p) => `${p.node}${p.size > 1 ? ` rank ${p.rank}` : ""} (${p.state})`).join(", ");
  const actions = act ? [
    m.state === "serving" || m.state === "loading" ? actionButton("Unload", () => act.model("unload", m.name))
      : actionButton("Load", () => act.model("load", m.name)),
    actionButton(m.pin ? "Unpin" : "Pin", () => act.model(m.pin ? "unpin" : "pin", m.name)),
  ] : [];
  return el("tr", { dataset: { model: m.name } },
    el("td", {}, el("b", {}, m.name), m.pin ? " (pinned)" : "", el("div", { class: "muted" }, m.source)),
    el("td", {}, stateBadge(m.state)), el("td", {}, where || m.status),
    el("td", {}, m.measured_bytes ? `${bytes(m.measured_bytes)} (est. ${bytes(m.footprint_bytes)})`
      : bytes(m.footprint_bytes)),
    el("td", {}, m.idle_since ? clock(m.idle_since) : "-"), el("td", {}, el("div", { class: "actions" }, actions)));
}

export function renderFleet(state, act) {
  const budgets = new Map(state.nodes.map((n) => [n.id, n.memory_budget]));
  const workers = state.workers;
  $("#workers-count").textContent = `${workers.filter((w) => w.state === "healthy").length} of ${workers.length} healthy`;
  replace($("#workers"), workers.length ? workers.map((w) => workerCard(w, budgets, act))
    : el("p", { class: "muted" }, "no workers registered"));
  $("#failures-part").hidden = !state.failures.length;
  replace($("#failures"), state.failures.map((f) => el("li", {}, el("b", {}, f.id), ` (${f.model}) exit ${f.exit_code}`,
    f.permanent ? ", not started again" : ", being started again", `: ${f.reason}`)));
  $("#nodes-part").hidden = !state.nodes.length;
  replace($("#nodes"), state.nodes.map(nodeCard));
  $("#catalog-part").hidden = state.catalog === null;
  replace($("#catalog tbody"), (state.catalog || []).map((m) => catalogRow(m, act)));
}

export function renderRequests(requests) {
  const outcome = (r) => {
    const moves = r.outcome === "resumed" ? ` (${r.resumes}×)` : r.outcome === "retried" ? ` (${r.retries}×)` : "";
    return el("td", { class: `outcome outcome-${r.outcome}` }, r.outcome + moves,
      r.cause ? el("div", { class: "muted" }, r.cause) : null);
  };
  replace($("#requests tbody"), requests.length ? requests.map((r) => el("tr", { title: r.id },
    el("td", {}, clock(r.started)), el("td", {}, r.model || "-"), el("td", {}, r.worker || "-"),
    el("td", {}, ms(r.ttft)), el("td", {}, String(r.tokens)), el("td", {}, ms(r.seconds)), outcome(r)))
    : el("tr", {}, el("td", { colSpan: 7, class: "muted" }, "no requests yet")));
}
