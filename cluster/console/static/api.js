// Talking to this server: keys, JSON calls and Server-Sent Events over fetch (fetch, not
// EventSource, so that a key goes in a header and never in a URL).

const STORE = "orchard.console.keys";
const keys = { api: "", admin: "" };

export function loadKeys() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(STORE) || "{}");
    keys.api = typeof saved.api === "string" ? saved.api : "";
    keys.admin = typeof saved.admin === "string" ? saved.admin : "";
  } catch { /* nothing kept */ }
}

export function setKeys(api, admin, remember) {
  if (api !== null) keys.api = api;
  if (admin !== null) keys.admin = admin;
  if (remember) sessionStorage.setItem(STORE, JSON.stringify(keys));
  else sessionStorage.removeItem(STORE);
}

export function forgetKeys() {
  keys.api = ""; keys.admin = "";
  sessionStorage.removeItem(STORE);
}

export const keysSet = () => ({ api: Boolean(keys.api), admin: Boolean(keys.admin) });

function headers(role, json) {
  const h = {};
  const key = role === "admin" ? keys.admin : (keys.api || keys.admin);
  if (key) h.Authorization = `Bearer ${key}`;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

export class HttpError extends Error {
  constructor(status, message, retryAfter) { super(message); this.status = status; this.retryAfter = retryAfter; }
}

// The server's message, and what to do about it: a key to enter (401), when to try again.
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = body.error?.message || message;
  } catch { /* not JSON */ }
  const retryAfter = Number(response.headers.get("Retry-After")) || null;
  if (response.status === 401) message += ": enter a key under Keys";
  else if (retryAfter) message += `: try again in ${retryAfter} s`;
  return new HttpError(response.status, message, retryAfter);
}

export async function post(path, body, role = "admin") {
  const response = await fetch(path, { method: "POST", headers: headers(role, true), body: JSON.stringify(body) });
  if (!response.ok) throw await failure(response);
  return response.json();
}

// Each SSE event's data, as text; ends when the stream does. `signal` aborts it.
export async function* events(path, { method = "GET", body, signal, role = "api" } = {}) {
  const response = await fetch(path, { method, signal, headers: headers(role, body !== undefined),
    body: body === undefined ? undefined : JSON.stringify(body) });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}
