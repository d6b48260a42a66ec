// The gateway's page: polls /experts (?since=seq: 304 while nothing changed), /profile and
// /health, and draws the expert heat maps, tier counts, recent turns, the last request of the
// chat box and the atlas. The API key, when the gateway wants one, is asked for once a tab.

import { auth, get } from "./api.js";
import { drawAtlas, readAtlas } from "./atlas.js";
import { Chat } from "./chat.js";
import { HeatMaps, tierCounts } from "./heatmaps.js";
import { History } from "./history.js";
import { TIER_COLORS, TIER_NAMES, TIER_ORDER } from "./palette.js";
import { RequestView } from "./request.js";
import { fmt, h } from "./svg.js";
import { Tooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000, PROFILE_MS = 2000, HEALTH_MS = 5000;

const state = {
  authorized: false, started: false, seq: null, experts: null, health: null, last: null,
  atlas: null, lastProfile: 0, lastHealth: 0,
};
const tooltip = new Tooltip($("tooltip"));
const maps = new HeatMaps($("maps"), $("heat-legend-box"), tooltip);
const turns = new History($("rate"), $("perf"), $("perf-legend"), tooltip);
const request = new RequestView($("request"), $("requests"));
new Chat($("chat"), $("reply"), (r) => {
  state.last = r;
  request.show({ ...r, cols: state.experts ? state.experts.cols : 0 });
  summary();
  poke();
});

// ------------------------------------------------------------------ the key

const keyForm = $("key");
keyForm.addEventListener("submit", async (e) => {
  e.preventDefault();
  auth.key = $("keyval").value.trim();
  $("key-msg").textContent = "checking…";
  poke();
});

/** Whether we may read the telemetry: /health shows the scheduler only to those who may
 * (asking it, not /experts, means no 401 is ever logged for a missing key). */
async function access() {
  const { status, body } = await get("/health");
  if (!body) throw new Error(`/health: HTTP ${status}`);
  state.health = body;
  state.lastHealth = Date.now();
  return "scheduler" in body;
}

function askKey() {
  keyForm.hidden = false;
  $("app").hidden = true;
  $("key-msg").textContent = auth.key ? "that key was refused" : "this gateway wants its API key";
  $("status").textContent = "waiting for the API key";
  $("keyval").focus();
}

async function start() {
  keyForm.hidden = true;
  $("app").hidden = false;
  if (state.started) return;
  state.started = true;
  const models = await get("/v1/models");
  const id = models.body && models.body.data && models.body.data[0] && models.body.data[0].id;
  if (id) {
    $("model").textContent = id;
    document.title = `colibri · ${id}`;
  }
  const a = await get("/experts.json", { withKey: false });
  state.atlas = a.status === 200 ? readAtlas(a.body) : null;
  if (a.status !== 200) $("atlas").textContent = "No atlas served (colibri gateway --experts-json FILE).";
  else if (!state.atlas) $("atlas").textContent = "/experts.json is not a colibri atlas keyed by layer:expert.";
  atlas();
}

// ------------------------------------------------------------------ polling

let timer = null, running = false, again = false;

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(tick, ms);
}

function poke() {
  if (running) again = true;
  else schedule(0);
}

async function tick() {
  running = true;
  again = false;
  try {
    if (!state.authorized) {
      state.authorized = await access();
      if (!state.authorized) {
        askKey();
        return; // until a key is given
      }
      await start();
    }
    const changed = await pollExperts();
    const now = Date.now();
    if (changed || again || now - state.lastProfile > PROFILE_MS) await pollProfile();
    if (changed || now - state.lastHealth > HEALTH_MS) await pollHealth();
    status();
  } catch (err) {
    $("status").textContent = `gateway unreachable (${err.message})`;
    $("status").dataset.state = "error";
  } finally {
    running = false;
    if (state.authorized || again) schedule(again ? 0 : POLL_MS);
  }
}

async function pollExperts() {
  const q = state.seq === null ? "" : `?since=${state.seq}`;
  const { status, body } = await get(`/experts${q}`);
  if (status === 304) return false;
  if (status === 401) {
    state.authorized = false;
    return false;
  }
  if (status !== 200 || !body) throw new Error(`/experts: HTTP ${status}`);
  const shapeChanged = !state.experts || state.experts.rows !== body.rows ||
    state.experts.cols !== body.cols;
  state.experts = body;
  state.seq = body.seq;
  $("maps-empty").hidden = body.rows > 0;
  if (body.rows > 0) maps.update(body);
  summary();
  if (shapeChanged) atlas();
  return true;
}

async function pollProfile() {
  const { status, body } = await get("/profile");
  state.lastProfile = Date.now();
  if (status === 200 && body) turns.update(body);
}

async function pollHealth() {
  const { body } = await get("/health");
  state.lastHealth = Date.now();
  if (body) state.health = body;
  summary();
}

// ------------------------------------------------------------------ views

function status() {
  const s = $("status"), x = state.experts;
  s.dataset.state = "live";
  s.dataset.seq = x ? x.seq : "";
  const when = new Date().toLocaleTimeString("en-GB");
  s.textContent = x
    ? `${x.rows} MoE layers × ${x.cols} experts · map update ${x.seq} · checked ${when}`
    : `no expert map yet · checked ${when}`;
}

function summary() {
  const x = state.experts, hl = state.health || {}, cards = [];
  if (x && x.rows > 0) {
    const n = tierCounts(x), total = x.rows * x.cols, gb = x.tiers || (hl.tiers ?? {});
    const gbOf = { 2: gb.vram_gb, 1: gb.ram_gb, 0: undefined };
    for (const t of TIER_ORDER) {
      cards.push(h("div", { class: "card tier", "data-tier": TIER_NAMES[t] },
        h("span", {}, h("i", { class: "swatch", style: `background:${TIER_COLORS[t]}` }), TIER_NAMES[t]),
        h("b", { id: `tier-${TIER_NAMES[t]}`, "data-count": n[t] }, String(n[t])),
        h("small", {}, `${fmt((100 * n[t]) / total, 3)}% of ${total}` +
          (gbOf[t] !== undefined ? ` · ${fmt(gbOf[t])} GB` : ""))));
    }
    let routed = 0, resident = 0;
    x.hits_grid.forEach((row, r) => row.forEach((v, c) => {
      if (!v) return;
      routed += 1;
      if (x.map_grid[r][c] >> 6 >= 1) resident += 1;
    }));
    cards.push(h("div", { class: "card" }, h("span", {}, "routed in the last window"),
      h("b", { id: "routed", "data-count": routed }, String(routed)),
      h("small", {}, routed ? `${fmt((100 * resident) / routed, 3)}% of them on device or in RAM` : "–")));
  }
  const last = state.last && state.last.colibri.stats;
  cards.push(h("div", { class: "card" }, h("span", {}, "hit % · last request"),
    h("b", { id: "hit-pct" }, last ? `${fmt(last.hit_pct)}%` : "–"),
    h("small", {}, last ? `${fmt(last.tok_s)} tok/s decode · ${last.emitted} tokens` : "send one below")));
  const sched = hl.scheduler;
  cards.push(h("div", { class: "card" }, h("span", {}, "engine"),
    h("b", {}, hl.status || "–"),
    h("small", {}, sched ? `${sched.active}/${sched.capacity} slots busy · ${sched.queued} queued` +
      (hl.restarts ? ` · ${hl.restarts} restarts` : "") : "")));
  $("summary").replaceChildren(...cards);
  const hw = hl.hwinfo;
  $("host").textContent = hw
    ? `${hw.cpu} (${hw.cores} cores, ${fmt(hw.ram_avail_gb)}/${fmt(hw.ram_total_gb)} GB RAM free)` +
      (hw.gpus ? ` · ${hw.gpus} × ${hw.gpu}, ${fmt(hw.vram_total_gb)} GB` : "")
    : "";
}

function atlas() {
  if (!state.atlas) return;
  const x = state.experts;
  const live = x && x.rows > 0 ? { rows: x.rows, cols: x.cols } : null;
  const match = drawAtlas($("atlas"), state.atlas, tooltip, live);
  maps.atlas = match ? state.atlas.byKey : null;
}

schedule(0);
