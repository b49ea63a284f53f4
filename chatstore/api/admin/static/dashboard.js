// The cache dashboard: /admin/cache, /admin/sessions and /admin/history, polled live.
//
// Every number is rendered with its raw value beside it (data-raw), so what the page shows can
// be checked against the JSON it came from. Pause stops the polling; "Refresh now" polls once.

import { Api, KeyDialog, TIER_COLORS, ago, bytes, count, el, percent } from "./api.js";
import { drawChart } from "./plot.js";

const REFRESH_MS = 1500;
const WINDOW_S = 600; // the plots keep the last ten minutes
const MIN_WINDOW_S = 60; // and span at least this much (a young server's minute fills the width)
const $ = (id) => document.getElementById(id);

const api = new Api("chatstore.adminKey", new KeyDialog($("key-dialog")));
const state = { paused: false, timer: null, inFlight: null, samples: [] };
window.chatstoreDashboard = { refreshes: 0 }; // completed refreshes, for tests and the curious

// ---- polling -------------------------------------------------------------------------------

function refreshNow() {
  if (!state.inFlight) state.inFlight = refresh().finally(() => (state.inFlight = null));
  return state.inFlight;
}

async function refresh() {
  const last = state.samples.length ? state.samples[state.samples.length - 1].t : null;
  const [cache, sessions, history] = await Promise.all([
    api.request("GET", "/admin/cache"),
    api.request("GET", "/admin/sessions?limit=100"),
    api.request("GET", last === null ? "/admin/history" : `/admin/history?since=${last}`),
  ]);
  renderTiers(cache);
  renderEngine(cache.engine || {}, cache.remote_breaker);
  renderSessions(sessions, cache);
  addSamples(history.data || []);
  renderPlots();
  window.chatstoreDashboard.refreshes += 1;
  $("forget-key").hidden = !api.key;
  setStatus(`updated ${new Date().toLocaleTimeString()}${state.paused ? " · paused" : ""}`);
}

async function tick() {
  clearTimeout(state.timer);
  try {
    await refreshNow();
  } catch (error) {
    setStatus(`error: ${error.message}`);
  }
  if (!state.paused) state.timer = setTimeout(tick, REFRESH_MS);
}

function togglePause() {
  state.paused = !state.paused;
  $("pause").textContent = state.paused ? "Resume" : "Pause";
  document.body.classList.toggle("paused", state.paused);
  if (state.paused) {
    clearTimeout(state.timer);
    setStatus(`${$("status").textContent.replace(/ · paused$/, "")} · paused`);
  } else {
    tick();
  }
}

// ---- tiers and engine ------------------------------------------------------------------------

// The device tier (the engine's block pool and prefix cache) is listed with kv_store = off
// too; its hits and misses are prompt blocks, the store tiers' are chunk reads, so the rate in
// the heading (/admin/cache's hit_rate) is the store tiers' alone.
function renderTiers(cache) {
  $("hit-rate").textContent = `· store hit rate ${percent(cache.hit_rate)}`;
  const tiers = cache.tiers || [];
  const cards = tiers.map(tierCard);
  if (!tiers.some((t) => t.name !== "device")) {
    cards.push(el("p", { class: "muted", text: "KV store off" }));
  }
  $("tiers").replaceChildren(...cards);
}

function tierCard(t) {
  const used = t.capacity_bytes ? t.used_bytes / t.capacity_bytes : 0;
  const meter = el("span");
  meter.style.width = `${Math.min(100, used * 100)}%`;
  meter.style.background = TIER_COLORS[t.name] || "#888";
  const unit = t.name === "device" ? " (blocks)" : "";
  const rows = [
    ["used", "used_bytes", bytes],
    ["capacity", "capacity_bytes", bytes],
    ["sessions", "sessions", count],
    [`hits${unit}`, "hits", count],
    [`misses${unit}`, "misses", count],
    ["moved up", "bytes_up", bytes],
    ["moved down", "bytes_down", bytes],
    ["evictions", "evictions", count],
    ["prefetches", "prefetches", count],
  ];
  return el(
    "div",
    { class: "card tier", "data-tier": t.name },
    el(
      "h3",
      {},
      el("span", { text: t.name }),
      el("span", { class: "muted", text: `hit rate ${percent(t.hit_rate)}` }),
    ),
    el("div", { class: "meter", title: percent(used) }, meter),
    definitions(rows, t, { "data-tier": t.name }),
  );
}

function renderEngine(engine, breaker) {
  const inUse = engine.num_blocks - engine.free_blocks;
  const cards = [
    engineCard("Queue and batch", engine, [
      ["waiting", "waiting", count],
      ["running", "running", count],
      ["swapped", "swapped", count],
      ["mean batch size", "mean_batch_size", (v) => (v ?? 0).toFixed(2)],
      ["steps", "steps", count],
      ["preemptions", "preemptions", count],
      ["requests finished", "requests_finished", count],
    ]),
    engineCard("Block pool", { ...engine, blocks_in_use: inUse }, [
      ["blocks", "num_blocks", count],
      ["in use", "blocks_in_use", count],
      ["free", "free_blocks", count],
      ["usage", "block_usage", percent],
      ["block size", "block_size", count],
      ["prefix-cached blocks", "cached_blocks", count],
      ["prefix hits", "prefix_hits", count],
      ["prefix misses", "prefix_misses", count],
    ]),
    engineCard("History loads", engine, [
      ["loads", "kv_loads", count],
      ["layer-wise", "kv_layerwise_loads", count],
      ["read buffer hits", "read_buffer_hits", count],
      ["read buffer held", "read_buffer_bytes", bytes],
      ["compute dtype", "dtype", (v) => v ?? "–"],
    ]),
  ];
  if (breaker) {
    cards.push(engineCard("Remote tier (Redis)", breaker, [
      ["breaker", "state", (v) => v ?? "–"],
      ["opens", "opens", count],
      ["short-circuited", "short_circuited", count],
    ]));
  }
  $("engine").replaceChildren(...cards);
}

function engineCard(title, source, rows) {
  const list = definitions(rows, source, { "data-engine": "" });
  return el("div", { class: "card" }, el("h3", { text: title }), list);
}

// <dl> of label -> formatted value; each value carries its key and raw number.
function definitions(rows, source, attrs) {
  const dl = el("dl");
  for (const [label, key, format] of rows) {
    const raw = source[key];
    dl.append(
      el("dt", { text: label }),
      el("dd", { ...attrs, "data-key": key, "data-raw": raw ?? "", text: format(raw) }),
    );
  }
  return dl;
}

// ---- sessions --------------------------------------------------------------------------------

function renderSessions(list, cache) {
  const kv = kvBySession(cache);
  const rows = (list.data || []).map((s) => {
    const placement = kv.get(`${s.tenant}/${s.id}`) || {};
    return sessionRow({ ...placement, ...s });
  });
  $("sessions").replaceChildren(...rows);
  const total = list.total ?? rows.length;
  $("session-count").textContent = `· ${rows.length} of ${total}`;
}

// The per-session KV table in /admin/cache (sizes per tier, retention), when the server has
// one, fills what the session list lacks; a server without it shows dashes.
function kvBySession(cache) {
  const found = cache.sessions;
  const table = Array.isArray(found) ? found : (found && found.data) || [];
  return new Map(table.map((row) => [`${row.tenant}/${row.id ?? row.session_id}`, row]));
}

function sessionRow(s) {
  const location = s.kv_location || null;
  const badge = el("span", {
    class: location ? "tier-badge" : "tier-badge none",
    text: location || "none",
  });
  if (location) badge.style.background = TIER_COLORS[location] || "#888";
  const size = s.kv_bytes ?? null;
  const cell = (col, text, cls, raw) =>
    el("td", { class: cls, "data-col": col, "data-raw": raw ?? "", text });
  const sizeCell = cell("kv_bytes", size === null ? "–" : bytes(size), "num", size);
  const split = Object.entries(s.kv_bytes_by_tier || {}).filter(([, n]) => n);
  if (split.length) sizeCell.title = split.map(([tier, n]) => `${tier}: ${bytes(n)}`).join(", ");
  return el(
    "tr",
    { "data-session": s.id, "data-tenant": s.tenant },
    cell("tenant", s.tenant ?? "–"),
    cell("id", s.id, "id"),
    cell("num_messages", count(s.num_messages), "num", s.num_messages),
    cell("num_tokens", count(s.num_tokens), "num", s.num_tokens),
    el("td", { "data-col": "kv_location", "data-raw": location ?? "" }, badge),
    sizeCell,
    cell("priority", s.priority ?? "–", "num", s.priority),
    cell("ttl_s", ttl(s.ttl_s), "num", s.ttl_s),
    cell("expires_at", s.expires_at ? inTime(s.expires_at) : "–", "", s.expires_at),
    cell("updated_at", ago(s.updated_at), "", s.updated_at),
  );
}

// 0 is the server's own session TTL.
function ttl(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds === 0) return "default";
  return duration(seconds);
}

function inTime(epochSeconds) {
  const s = epochSeconds - Date.now() / 1000;
  return s > 0 ? `in ${duration(s)}` : "due";
}

function duration(seconds) {
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  if (seconds < 172800) return `${(seconds / 3600).toFixed(1)} h`;
  return `${Math.round(seconds / 86400)} d`;
}

// ---- plots -------------------------------------------------------------------------------------

function addSamples(samples) {
  state.samples.push(...samples);
  const newest = state.samples.length ? state.samples[state.samples.length - 1].t : 0;
  while (state.samples.length && state.samples[0].t < newest - WINDOW_S) state.samples.shift();
}

function renderPlots() {
  const samples = state.samples;
  // The server's clock, not ours: the newest sample is "now", whatever the skew.
  const now = samples.length ? samples[samples.length - 1].t : Date.now() / 1000;
  const span = samples.length ? now - samples[0].t : 0;
  const windowS = Math.min(WINDOW_S, Math.max(MIN_WINDOW_S, Math.ceil((span * 1.1) / 60) * 60));
  const opts = { windowS, now };
  const points = (f) => samples.map((s) => [s.t, f(s)]);
  const asPercent = (v) => `${Math.round(v * 100)}%`;
  const hitRate = { label: "hit rate", color: "#2d5bd7", points: points((s) => s.hit_rate) };
  drawChart($("plot-hit-rate"), [hitRate], { ...opts, yMax: 1, format: asPercent });
  drawChart(
    $("plot-ttft"),
    [
      { label: "p50", color: "#1a9e6f", points: points((s) => s.ttft_p50_ms) },
      { label: "p90", color: "#d98b18", points: points((s) => s.ttft_p90_ms) },
    ],
    { ...opts, yMax: null, format: (v) => (v >= 100 ? v.toFixed(0) : v.toFixed(1)) },
  );
  drawChart($("plot-occupancy"), occupancySeries(samples), { ...opts, yMax: 1, format: asPercent });
}

function occupancySeries(samples) {
  const names = [];
  for (const s of samples) for (const t of s.tiers) if (!names.includes(t.name)) names.push(t.name);
  return names.map((name) => ({
    label: name,
    color: TIER_COLORS[name] || "#888",
    points: samples.map((s) => {
      const t = s.tiers.find((x) => x.name === name);
      return [s.t, t && t.capacity_bytes ? t.used_bytes / t.capacity_bytes : null];
    }),
  }));
}

// ---- wiring ------------------------------------------------------------------------------

function setStatus(text) {
  $("status").textContent = text;
}

$("pause").addEventListener("click", togglePause);
const showError = (error) => setStatus(`error: ${error.message}`);
$("refresh").addEventListener("click", () => refreshNow().catch(showError));
$("forget-key").addEventListener("click", () => {
  api.forget();
  refreshNow().catch(showError);
});
window.addEventListener("resize", renderPlots);
tick();
