// The playground: a chat over /v1/chat/completions, streamed; thinking folded apart from
// the answer, tool calls shown, the request's TTFT and tokens/s.

import { events } from "./api.js";
import { $, el, ms, replace } from "./dom.js";

const history = [];
let running = null; // the AbortController of the request under way

export function setModels(models) {
  const select = $("#chat-model");
  const chosen = select.value;
  const names = [...new Set(models)].sort();
  if (names.join("\n") === [...select.options].map((o) => o.value).join("\n")) return;
  replace(select, names.map((name) => el("option", { value: name }, name)));
  if (names.includes(chosen)) select.value = chosen;
}

function number(input) {
  return input.value === "" ? undefined : Number(input.value);
}

function bubble(role, text) {
  return el("div", { class: `msg msg-${role}` }, el("div", { class: "who" }, role), el("div", { class: "text" }, text));
}

function answerBubble() {
  const thinking = el("pre", { class: "thinking-text" });
  const fold = el("details", { class: "thinking", hidden: true }, el("summary", {}, "thinking"), thinking);
  const text = el("div", { class: "text answer" });
  const calls = el("div", { class: "calls" });
  const error = el("div", { class: "error", hidden: true });
  const node = el("div", { class: "msg msg-assistant" }, el("div", { class: "who" }, "assistant"), fold, text, calls,
    error);
  return { node, fold, thinking, text, calls, error };
}

function showCalls(target, calls) {
  replace(target, [...calls.values()].map((c) => el("div", { class: "call" },
    el("b", {}, `tool call: ${c.name || "?"}`), el("pre", {}, c.arguments))));
}

async function send(event) {
  event.preventDefault();
  const input = $("#chat-input");
  const prompt = input.value.trim();
  if (!prompt || running) return;
  input.value = "";
  history.push({ role: "user", content: prompt });
  const log = $("#chat-log");
  log.append(bubble("user", prompt));
  const out = answerBubble();
  log.append(out.node);
  const body = { model: $("#chat-model").value, messages: history.slice(), stream: true,
    stream_options: { include_usage: true }, temperature: number($("#chat-temperature")),
    max_tokens: number($("#chat-max-tokens")) };
  const budget = number($("#chat-thinking"));
  if (budget !== undefined) body.thinking_token_budget = budget;
  running = new AbortController();
  $("#chat-send").disabled = true;
  $("#chat-stop").disabled = false;
  const stats = $("#chat-stats");
  stats.textContent = "waiting for the first token";
  const t0 = performance.now();
  let first = null;
  let chunks = 0;
  let tokens = null;
  let answer = "";
  const calls = new Map();
  const shown = () => {
    const ttft = first === null ? null : (first - t0) / 1000;
    const seconds = (performance.now() - (first ?? t0)) / 1000;
    const n = tokens ?? chunks;
    const rate = first !== null && seconds > 0 && n > 1 ? `${(n / seconds).toFixed(1)} tokens/s` : "";
    stats.textContent = [`TTFT ${ms(ttft)}`, rate, tokens !== null ? `${tokens} tokens` : ""].filter(Boolean)
      .join(" · ");
  };
  let ended = false;
  try {
    for await (const data of events("/v1/chat/completions", { method: "POST", body, signal: running.signal })) {
      if (data === "[DONE]") { ended = true; break; }
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server failed the request");
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta;
      if (!delta) continue;
      const reasoning = delta.reasoning_content || "";
      if (!delta.content && !reasoning && !delta.tool_calls) continue;
      if (first === null) first = performance.now();
      chunks += 1;
      if (reasoning) { out.fold.hidden = false; out.thinking.textContent += reasoning; }
      if (delta.content) { answer += delta.content; out.text.textContent = answer; }
      for (const call of delta.tool_calls || []) {
        const c = calls.get(call.index) || { name: "", arguments: "" };
        c.name = call.function?.name || c.name;
        c.arguments += call.function?.arguments || "";
        calls.set(call.index, c);
        showCalls(out.calls, calls);
      }
      shown();
      log.scrollTop = log.scrollHeight;
    }
    shown();
    if (!ended) throw new Error("the stream was cut before its end: the answer above is partial");
    history.push({ role: "assistant", content: answer });
  } catch (e) {
    history.pop();
    if (e.name !== "AbortError") {
      out.error.hidden = false;
      // fetch's own failures (no server, a connection reset mid-stream) are TypeErrors
      out.error.textContent = e instanceof TypeError ? `the connection to the server failed (${e.message})` : e.message;
    }
    stats.textContent = e.name === "AbortError" ? "stopped" : "failed";
  } finally {
    running = null;
    $("#chat-send").disabled = false;
    $("#chat-stop").disabled = true;
  }
}

export function setUpChat() {
  $("#chat-form").addEventListener("submit", send);
  $("#chat-stop").addEventListener("click", () => running?.abort());
  $("#chat-clear").addEventListener("click", () => {
    running?.abort();
    history.length = 0;
    replace($("#chat-log"));
    $("#chat-stats").textContent = "";
  });
  $("#chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
  });
}
