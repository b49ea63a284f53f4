// One message of the conversation, and the line of numbers under each reply: TTFT, decode
// tokens/s, cached prompt tokens and the tiers that history came from (a bar split by tier).

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
