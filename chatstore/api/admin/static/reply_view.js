// One message of the conversation, and the line of numbers under each reply: TTFT, decode
// tokens/s, cached prompt tokens and the tiers that history came from (a bar split by tier).
// A reply that calls tools shows each call as one (the function's name, its arguments as
// name = value rows), and a tool's result is a bubble of its own, never raw JSON text.

import { TIER_COLORS, el } from "./api.js";

const TIERS = ["device", "dram", "ssd", "remote"];

export function messageItem(role, content) {
  return el(
    "li",
    { class: `msg ${role}` },
    el("div", { class: "role", text: role }),
    el("div", { class: "text", text: content }),
  );
}

// A stored message as the session returns it (role, content, tool_calls, tool_call_id).
export function messageView(m) {
  if (m.tool_calls && m.tool_calls.length) return toolCallsItem(m);
  if (m.role === "tool") return toolResultItem(m);
  return messageItem(m.role, m.content);
}

export function toolCallsItem(m) {
  const item = el("li", { class: "msg assistant calls" }, el("div", { class: "role", text: "assistant" }));
  if (m.content) item.append(el("div", { class: "text", text: m.content }));
  for (const call of m.tool_calls) item.append(toolCall(call));
  return item;
}

function toolCall(call) {
  const fn = call.function || {};
  const args = el("dl", { class: "tool-args" });
  let parsed = null;
  try {
    parsed = JSON.parse(fn.arguments || "{}");
  } catch {
    parsed = null; // not JSON (a client sent it so): shown as it is, below
  }
  if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) {
    for (const [name, value] of Object.entries(parsed)) {
      const shown = typeof value === "string" ? value : JSON.stringify(value);
      args.append(el("dt", { text: name }), el("dd", { text: shown }));
    }
  } else {
    args.append(el("dd", { text: fn.arguments || "" }));
  }
  return el(
    "div",
    { class: "tool-call", "data-call-id": call.id || "" },
    el("div", { class: "tool-head" }, el("span", { class: "tool-label", text: "calls" }),
      el("span", { class: "tool-name", text: fn.name || "?" })),
    args,
  );
}

function toolResultItem(m) {
  return el(
    "li",
    { class: "msg tool", "data-call-id": m.tool_call_id || "" },
    el("div", { class: "role", text: "tool result" }),
    el("div", { class: "text", text: m.content }),
  );
}

// The tier most of the cached history came from (null: none reported).
export function dominantTier(byTier) {
  if (!byTier) return null;
  let best = null;
  for (const tier of TIERS) {
    if ((byTier[tier] || 0) > 0 && (!best || byTier[tier] > byTier[best])) best = tier;
  }
  return best;
}

export function statsLine(frame, tier) {
  const usage = frame.usage || {};
  const timings = frame.timings || {};
  const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
  const line = el("div", { class: "stats" });
  const stat = (cls, value, label) =>
    line.append(el("span", { class: `stat ${cls}`, "data-value": value, text: label }));
  stat("stat-ttft", timings.ttft_ms, `TTFT ${fixed(timings.ttft_ms, 0)} ms`);
  const rate = decodeRate(usage.completion_tokens, timings);
  stat("stat-rate", rate, `${fixed(rate, 1)} tok/s`);
  stat("stat-cached", cached, `cached ${cached} / ${usage.prompt_tokens ?? "?"} prompt tokens`);
  const origin = tier ? `history from ${tier}` : cached ? "tier not reported" : "recomputed";
  stat("stat-tier", tier || "", origin);
  if (cached) line.append(tierSplit(usage.cached_tokens_by_tier || {}, cached));
  return line;
}

// Tokens per second after the first one: the decode speed the user watches.
function decodeRate(completionTokens, timings) {
  const decodeMs = (timings.total_ms ?? 0) - (timings.ttft_ms ?? 0);
  if (!completionTokens || completionTokens < 2 || decodeMs <= 0) return null;
  return ((completionTokens - 1) * 1000) / decodeMs;
}

function tierSplit(byTier, cached) {
  const bar = el("span", { class: "split" });
  const parts = [];
  for (const tier of TIERS) {
    const n = byTier[tier] || 0;
    if (!n) continue;
    parts.push(`${tier} ${n}`);
    const segment = el("span", { class: "segment", title: `${tier}: ${n} tokens` });
    segment.style.width = `${(100 * n) / cached}%`;
    segment.style.background = TIER_COLORS[tier];
    bar.append(segment);
  }
  bar.title = parts.length ? parts.join(", ") : "no per-tier split reported";
  return bar;
}

function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}
