// The API as the pages use it: JSON over fetch with the user's key, asked for on a 401.
//
// In local mode (no keys on the server) no key is ever asked for. With keys, the first 401 (or
// a 403 "forbidden": a key of the wrong kind) opens the key dialog; the key is kept in
// sessionStorage, or in localStorage when the user ticks "remember".

export class ApiError extends Error {
  constructor(status, body) {
    const err = (body && body.error) || {};
    super(err.message || `HTTP ${status}`);
    this.status = status;
    this.code = err.code || null;
  }
}

export class Api {
  // storageName: where this page keeps its key; dialog: a KeyDialog.
  constructor(storageName, dialog) {
    this.storageName = storageName;
    this.dialog = dialog;
  }

  get key() {
    return sessionStorage.getItem(this.storageName) || localStorage.getItem(this.storageName);
  }

  remember(key, persist) {
    this.forget();
    (persist ? localStorage : sessionStorage).setItem(this.storageName, key);
  }

  forget() {
    sessionStorage.removeItem(this.storageName);
    localStorage.removeItem(this.storageName);
  }

  async request(method, path, body) {
    for (;;) {
      const response = await fetch(path, this.init(method, body));
      if (response.ok) return response.status === 204 ? null : response.json();
      const error = new ApiError(response.status, await response.json().catch(() => null));
      if (!needsKey(error)) throw error;
      const given = await this.dialog.ask(error.message);
      this.remember(given.key, given.persist);
    }
  }

  init(method, body) {
    const headers = {};
    const key = this.key;
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const payload = body === undefined ? undefined : JSON.stringify(body);
    return { method, headers, body: payload, cache: "no-store" };
  }

  // A browser cannot set headers on a WebSocket: the key goes in the query string.
  socketUrl(path) {
    const url = new URL(path, location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    if (this.key) url.searchParams.set("api_key", this.key);
    return url.href;
  }
}

function needsKey(error) {
  return error.status === 401 || (error.status === 403 && error.code === "forbidden");
}

// The <dialog> that asks for a key; ask() resolves once the user submits one.
export class KeyDialog {
  constructor(dialog) {
    this.dialog = dialog;
    this.form = dialog.querySelector("form");
    this.input = dialog.querySelector("input[name=key]");
    this.persist = dialog.querySelector("input[name=persist]");
    this.reason = dialog.querySelector(".reason");
    this.waiting = [];
    this.form.addEventListener("submit", (event) => this.submit(event));
    // Escape would leave the waiting requests hanging: the page needs a key to go on.
    dialog.addEventListener("cancel", (event) => event.preventDefault());
  }

  ask(reason) {
    this.reason.textContent = reason;
    if (!this.dialog.open) this.dialog.showModal();
    this.input.focus();
    return new Promise((resolve) => this.waiting.push(resolve));
  }

  submit(event) {
    event.preventDefault();
    const key = this.input.value.trim();
    if (!key) return;
    this.input.value = "";
    this.dialog.close();
    const given = { key, persist: this.persist.checked };
    for (const resolve of this.waiting.splice(0)) resolve(given);
  }
}

// Small formatting helpers shared by both pages.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit && value < 10 ? 1 : 0)} ${units[unit]}`;
}

export function count(n) {
  return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
}

export function percent(fraction) {
  return fraction === null || fraction === undefined ? "–" : `${(fraction * 100).toFixed(1)}%`;
}

export function ago(epochSeconds) {
  if (!epochSeconds) return "–";
  const s = Math.max(0, Date.now() / 1000 - epochSeconds);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export const TIER_COLORS = {
  device: "#2d5bd7",
  dram: "#1a9e6f",
  ssd: "#d98b18",
  remote: "#b0399e",
};
