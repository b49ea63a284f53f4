// The chat page: the tenant's sessions, and one conversation streamed over its WebSocket.
//
// It opens on a new chat with the message box focused: the session is created by the first
// message (with the system prompt, if one was set under "System prompt"), so opening the page
// leaves no empty session behind. Sessions are listed under their first user message.
//
// Per reply it shows TTFT, decode tokens/s, cached prompt tokens and the tier they came from,
// and records the page's own overhead: the server's clock on the first delta ("t", epoch ms)
// against the moment that token is in the DOM (window.chatstoreTimings).

import { Api, ApiError, KeyDialog, ago, el } from "./api.js";
import { dominantTier, messageItem, messageView, statsLine, toolCallsItem } from "./reply_view.js";

const TYPING_HINT_MS = 3000; // at most one prefetch hint per session in this time
const TITLE_CHARS = 48; // a session's title: its first user message, cut to this many characters
const $ = (id) => document.getElementById(id);

const api = new Api("chatstore.apiKey", new KeyDialog($("key-dialog")));
const state = { sessionId: null, socket: null, reply: null, lastTyping: -Infinity };
// Session id -> title. A session's first user message never changes, so it is fetched once.
const titles = new Map();
// Sessions read without a user message yet -> their message count then (read again once it grows).
const untitled = new Map();
window.chatstoreTimings = [];
window.chatstoreTypingHints = 0;

// ---- sessions ---------------------------------------------------------------------------

async function loadSessions() {
  const list = await api.request("GET", "/v1/sessions?limit=100");
  await learnTitles(list.data);
  const items = list.data.map(sessionItem);
  $("sessions").replaceChildren(...items);
  $("no-sessions").hidden = items.length > 0;
  showKeyState();
}

// The list carries no messages: a session not seen before is read once for its first one.
async function learnTitles(sessions) {
  const unknown = sessions.filter(
    (s) => !titles.has(s.id) && s.num_messages > (untitled.get(s.id) ?? 0),
  );
  const records = await Promise.all(
    unknown.map((s) =>
      api.request("GET", `/v1/sessions/${encodeURIComponent(s.id)}`).catch(() => null),
    ),
  );
  for (const record of records) {
    if (!record) continue; // deleted meanwhile: it is gone from the next list too
    const first = record.messages.find((m) => m.role === "user");
    if (first) titles.set(record.id, titleOf(first.content));
    else untitled.set(record.id, record.messages.length);
  }
}

function titleOf(text) {
  const line = text.replace(/\s+/g, " ").trim();
  return line.length > TITLE_CHARS ? `${line.slice(0, TITLE_CHARS - 1).trimEnd()}…` : line;
}

function sessionItem(s) {
  const where = s.kv_location ? `KV in ${s.kv_location}` : "no KV";
  const meta = [`${s.num_messages} messages`, `${s.num_tokens} tokens`, where, ago(s.updated_at)];
  const title = titles.get(s.id) || "(no message yet)";
  const open = el("button", { type: "button", class: "open", text: title, title: s.id });
  const remove = el("button", { type: "button", class: "delete", text: "Delete" });
  const info = el("div", { class: "meta", text: meta.join(" · ") });
  const item = el("li", { "data-id": s.id }, open, remove, info);
  item.classList.toggle("active", s.id === state.sessionId);
  open.addEventListener("click", () => run(openSession(s.id)));
  remove.addEventListener("click", () => armDelete(remove, s.id));
  return item;
}

// Deleting takes a second click, so a stray click loses no conversation.
function armDelete(button, sessionId) {
  if (button.classList.contains("armed")) return run(deleteSession(sessionId));
  button.classList.add("armed");
  button.textContent = "Confirm delete";
  setTimeout(() => {
    button.classList.remove("armed");
    button.textContent = "Delete";
  }, 4000);
}

// A new chat: nothing is created until its first message (startSession).
function newChat() {
  closeConversation();
  $("system-prompt").value = "";
  $("draft-options").open = false;
  for (const li of $("sessions").children) li.classList.remove("active");
  $("input").focus();
}

// The draft's first message creates its session, titled by that message.
async function startSession(firstMessage) {
  const prompt = $("system-prompt").value.trim();
  const body = prompt ? { system_prompt: prompt } : {};
  const created = await api.request("POST", "/v1/sessions", body);
  titles.set(created.id, titleOf(firstMessage));
  state.sessionId = created.id;
  $("draft").hidden = true;
  $("messages").replaceChildren(...created.messages.map(messageView));
  run(loadSessions());
  return created.id;
}

async function deleteSession(sessionId) {
  await api.request("DELETE", `/v1/sessions/${encodeURIComponent(sessionId)}`);
  if (sessionId === state.sessionId) newChat();
  await loadSessions();
}

async function openSession(sessionId) {
  closeConversation();
  const record = await api.request("GET", `/v1/sessions/${encodeURIComponent(sessionId)}`);
  state.sessionId = sessionId;
  $("messages").replaceChildren(...record.messages.map(messageView));
  $("draft").hidden = true;
  for (const li of $("sessions").children) {
    li.classList.toggle("active", li.dataset.id === sessionId);
  }
  scrollDown();
  $("input").focus();
  await socketFor(sessionId);
}

function closeConversation() {
  if (state.socket) state.socket.close();
  state.socket = null;
  state.sessionId = null;
  state.reply = null;
  state.lastTyping = -Infinity;
  $("messages").replaceChildren();
  $("draft").hidden = false;
  setBusy(false);
  setStatus("");
}

// ---- the session's WebSocket ------------------------------------------------------------

async function socketFor(sessionId) {
  const open = state.socket && state.socket.readyState === WebSocket.OPEN;
  if (open && state.socket.sessionId === sessionId) return state.socket;
  for (;;) {
    try {
      const socket = await connect(sessionId);
      if (state.sessionId !== sessionId) {
        socket.close(); // the user moved on while it connected
        throw new Error("session changed");
      }
      state.socket = socket;
      setStatus(`session ${sessionId}: connected`);
      return socket;
    } catch (error) {
      if (!(error instanceof ApiError) || error.status !== 401) throw error;
      const given = await api.dialog.ask(error.message);
      api.remember(given.key, given.persist);
    }
  }
}

// Resolves with the socket once the server says "ready"; rejects with the server's error.
function connect(sessionId) {
  return new Promise((resolve, reject) => {
    const socket = new WebSocket(api.socketUrl(`/v1/sessions/${encodeURIComponent(sessionId)}/ws`));
    socket.sessionId = sessionId;
    let ready = false;
    let refusal = null;
    socket.addEventListener("message", (event) => {
      const receivedMs = performance.timeOrigin + performance.now();
      const frame = JSON.parse(event.data);
      if (ready) return onFrame(socket, frame, receivedMs);
      if (frame.type === "ready") {
        ready = true;
        resolve(socket);
      } else if (frame.type === "error") {
        refusal = frame;
      }
    });
    socket.addEventListener("close", (event) => {
      if (!ready) {
        const status = event.code >= 4000 ? event.code - 4000 : 0;
        reject(new ApiError(status, refusal || { error: { message: "connection refused" } }));
      } else if (state.socket === socket) {
        state.socket = null;
        if (state.reply) finishReply("connection lost");
        setStatus(`session ${sessionId}: disconnected (sending reconnects)`);
      }
    });
  });
}

function onFrame(socket, frame, receivedMs) {
  const reply = state.reply;
  if (socket !== state.socket) return;
  if (!reply) {
    if (frame.type === "error") setStatus(`error: ${frame.error ? frame.error.message : "?"}`);
    return;
  }
  if (frame.type === "start") reply.requestId = frame.id;
  else if (frame.type === "delta") onDelta(reply, frame, receivedMs);
  else if (frame.type === "done") onDone(reply, frame);
  else if (frame.type === "cancelled") finishReply("stopped");
  else if (frame.type === "error") finishReply(frame.error ? frame.error.message : "error");
}

function onDelta(reply, frame, receivedMs) {
  reply.text.appendData(frame.text);
  // The token is in the DOM now: this minus the server's send time is the page's overhead.
  const shownMs = performance.timeOrigin + performance.now();
  reply.deltas += 1;
  reply.overheads.push(shownMs - frame.t);
  if (reply.deltas === 1) {
    reply.shownMs = shownMs;
    reply.serverMs = frame.t;
    reply.receivedMs = receivedMs; // splits the overhead: delivery, then parse and render
  }
  scrollDown();
}

function onDone(reply, frame) {
  const usage = frame.usage || {};
  const details = usage.prompt_tokens_details || {};
  const tier = dominantTier(usage.cached_tokens_by_tier);
  const message = frame.message || {};
  if (message.tool_calls && message.tool_calls.length) {
    // The reply calls tools: shown as calls, not as the text that streamed (none does).
    const calls = toolCallsItem(message);
    reply.item.replaceWith(calls);
    reply.item = calls;
  }
  reply.item.append(statsLine(frame, tier));
  window.chatstoreTimings.push({
    session_id: reply.sessionId,
    request_id: reply.requestId,
    deltas: reply.deltas,
    server_first_token_ms: reply.serverMs ?? null,
    first_token_received_ms: reply.receivedMs ?? null,
    first_token_shown_ms: reply.shownMs ?? null,
    overhead_ms: reply.deltas ? reply.shownMs - reply.serverMs : null,
    delta_overheads_ms: reply.overheads, // every delta's, the first one's included
    ttft_ms: frame.timings ? frame.timings.ttft_ms : null,
    prompt_tokens: usage.prompt_tokens ?? null,
    cached_tokens: details.cached_tokens ?? 0,
    cached_tokens_by_tier: usage.cached_tokens_by_tier || null,
    tier,
  });
  finishReply(null);
  run(loadSessions()); // its KV location and size changed
}

function finishReply(problem) {
  const reply = state.reply;
  if (!reply) return;
  if (problem) reply.item.append(el("div", { class: "problem", text: problem }));
  reply.item.classList.remove("streaming");
  state.reply = null;
  setBusy(false);
}

// ---- sending, and the typing hint --------------------------------------------------------

async function send(event) {
  event.preventDefault();
  const content = $("input").value.trim();
  if (!content || state.reply || $("send").disabled) return;
  setBusy(true);
  let socket;
  let sessionId = state.sessionId;
  try {
    if (!sessionId) sessionId = await startSession(content);
    socket = await socketFor(sessionId);
  } catch (error) {
    setBusy(false);
    throw error;
  }
  $("input").value = "";
  $("messages").append(messageItem("user", content));
  const item = messageItem("assistant", "");
  item.classList.add("streaming");
  $("messages").append(item);
  const text = item.querySelector(".text").appendChild(document.createTextNode(""));
  state.reply = { sessionId, item, text, deltas: 0, overheads: [], requestId: null };
  scrollDown();
  socket.send(JSON.stringify({ type: "message", content, ...sampling() }));
}

function sampling() {
  const out = {};
  const maxTokens = parseInt($("max-tokens").value, 10);
  const temperature = parseFloat($("temperature").value);
  if (Number.isFinite(maxTokens) && maxTokens > 0) out.max_tokens = maxTokens;
  if (Number.isFinite(temperature) && temperature >= 0) out.temperature = temperature;
  return out;
}

// The user is writing: the server may start moving this session's KV up now (prefetch).
function typingHint() {
  const socket = state.socket;
  const now = performance.now();
  if (!socket || socket.readyState !== WebSocket.OPEN || now - state.lastTyping < TYPING_HINT_MS) {
    return;
  }
  state.lastTyping = now;
  socket.send(JSON.stringify({ type: "typing" }));
  window.chatstoreTypingHints += 1;
}

function stop() {
  if (state.socket && state.reply) state.socket.send(JSON.stringify({ type: "cancel" }));
}

// ---- page state ------------------------------------------------------------------------

let scrollPending = false;
function scrollDown() {
  if (scrollPending) return;
  scrollPending = true;
  requestAnimationFrame(() => {
    scrollPending = false;
    const box = $("messages");
    box.scrollTop = box.scrollHeight;
  });
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
}

function setStatus(text) {
  $("status").textContent = text || (api.key ? "signed in with a key" : "");
}

function showKeyState() {
  $("forget-key").hidden = !api.key;
  if (!state.sessionId) setStatus("");
}

// Every user action goes through here: failures are shown, never lost in the console only.
function run(promise) {
  promise.catch((error) => {
    if (error && error.message === "session changed") return;
    setStatus(`error: ${error && error.message ? error.message : error}`);
    console.error(error);
  });
}

// ---- wiring --------------------------------------------------------------------------------

$("new-chat").addEventListener("click", newChat);
$("composer").addEventListener("submit", (event) => run(send(event)));
$("input").addEventListener("input", typingHint);
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("forget-key").addEventListener("click", () => {
  api.forget();
  titles.clear();
  untitled.clear();
  newChat();
  $("sessions").replaceChildren();
  run(loadSessions());
});
$("input").focus();
run(loadSessions());
