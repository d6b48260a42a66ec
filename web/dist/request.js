// One request's `colibri` frame (the last chunk of a chat stream): its statistics, its time
// split (PERF), its routing entropy per MoE layer, and the top candidates when sent.

import { el, fmt, h, yAxis } from "./svg.js";
import { PERF_COLORS, TIER_COLORS } from "./palette.js";

/** PERF's dt split as colibri.client.perf_parts does: the parts sum to dt. */
export function perfParts(p) {
  const parts = {
    "disk wait": p.t_ewait,
    "expert matmul": p.t_emm,
    attention: Math.max(0, p.t_attn - p.t_kvb),
    "kv expansion": p.t_kvb,
    head: p.t_head,
  };
  parts.other = Math.max(0, p.dt - Object.values(parts).reduce((a, b) => a + b, 0));
  return parts;
}

export class RequestView {
  constructor(root, table) {
    Object.assign(this, { root, table, n: 0, rows: [] });
  }

  /** Show a finished request: frame = the colibri object, usage, finish, the prompt. */
  show({ colibri, usage, finish, prompt, cols }) {
    this.n += 1;
    const s = colibri.stats || {};
    const stat = (label, value, key) =>
      h("div", { class: "stat" }, h("span", {}, label), h("b", { "data-field": key }, value));
    const stats = h(
      "div",
      { class: "stats" },
      stat("completion tokens", fmt(s.emitted ?? usage.completion_tokens), "emitted"),
      stat("prompt tokens", fmt(s.prompt_tokens ?? usage.prompt_tokens), "prompt_tokens"),
      stat("reused from the slot's cache", fmt(s.reused_tokens), "reused_tokens"),
      stat("decode tok/s", fmt(s.tok_s), "tok_s"),
      stat("hit % (experts found on device or in RAM)", `${fmt(s.hit_pct)}%`, "hit_pct"),
      stat("KV slot", fmt(s.slot), "slot"),
      stat("engine RSS", `${fmt(s.rss_gb)} GB`, "rss_gb"),
      stat("finish", finish + (s.length_limited ? " (length limit)" : ""), "finish"),
    );
    const parts = [h("h3", {}, `request ${this.n}: “${clip(prompt, 60)}”`), stats];
    if (colibri.perf) parts.push(perfBar(colibri.perf));
    if (colibri.entropy && colibri.entropy.length) parts.push(entropyChart(colibri.entropy, cols));
    if (colibri.topk && colibri.topk.length) parts.push(topkTable(colibri.topk));
    if (colibri.repin && colibri.repin.length) {
      parts.push(h("p", {}, `${colibri.repin.length} experts re-pinned during the turn`));
    }
    this.root.replaceChildren(...parts);
    this.root.dataset.requests = this.n;

    this.rows.unshift([this.n, clip(prompt, 28), s.prompt_tokens, s.reused_tokens, s.emitted,
                       fmt(s.tok_s), `${fmt(s.hit_pct)}%`, colibri.perf ? fmt(colibri.perf.dt) : "–"]);
    this.rows = this.rows.slice(0, 20);
    const head = ["#", "prompt", "prompt tok", "reused", "completion", "decode tok/s", "hit %", "dt s"];
    this.table.replaceChildren(
      h("thead", {}, h("tr", {}, head.map((x) => h("th", {}, x)))),
      h("tbody", {}, this.rows.map((r) => h("tr", {}, r.map((x) => h("td", {}, String(x ?? "–")))))),
    );
  }
}

function clip(text, n) {
  const t = text.replace(/\s+/g, " ").trim();
  return t.length > n ? `${t.slice(0, n - 1)}…` : t;
}

function perfBar(perf) {
  const parts = perfParts(perf), width = 520, height = 46, x0 = 4, w = width - 8;
  const svg = el("svg", { class: "perf-split", width, height, viewBox: `0 0 ${width} ${height}` });
  let at = 0;
  for (const [part, s] of Object.entries(parts)) {
    const pw = perf.dt > 0 ? (w * s) / perf.dt : 0;
    const r = el("rect", { x: x0 + at, y: 4, width: Math.max(0, pw), height: 18,
                           fill: PERF_COLORS[part] });
    r.append(el("title", {}, `${part}: ${fmt(s)} s`));
    svg.append(r);
    at += pw;
  }
  svg.append(el("text", { x: x0, y: 38, class: "axis-title" },
                `dt ${fmt(perf.dt)} s (prefill and decode), split by PERF; disk read ` +
                `${fmt(perf.t_edisk)} s (reader threads, overlaps compute)`));
  const legend = h("div", { class: "legend" }, Object.entries(parts).map(([part, s]) =>
    h("span", {}, h("i", { class: "swatch", style: `background:${PERF_COLORS[part]}` }),
      `${part} ${fmt(s)} s`)));
  return h("div", { class: "figure" }, h("h4", {}, "time split"), svg, legend);
}

function entropyChart(bits, cols) {
  const width = Math.max(220, 40 + bits.length * 22), height = 150;
  const M = { left: 40, right: 8, top: 8, bottom: 30 };
  const svg = el("svg", { class: "entropy", width, height, viewBox: `0 0 ${width} ${height}` });
  const ceiling = cols > 1 ? Math.log2(cols) : 0;
  const y = yAxis(svg, { x0: M.left, x1: width - M.right, top: M.top, bottom: height - M.bottom,
                         max: Math.max(ceiling, ...bits), title: "bits" });
  const slot = (width - M.left - M.right) / bits.length, yb = height - M.bottom;
  bits.forEach((b, i) => {
    const x = M.left + i * slot;
    const r = el("rect", { x: x + slot * 0.15, y: y(b), width: slot * 0.7, height: yb - y(b),
                           fill: TIER_COLORS[2] });
    r.append(el("title", {}, `MoE layer ${i}: ${fmt(b)} bits`));
    svg.append(r);
    svg.append(el("text", { x: x + slot / 2, y: yb + 12, class: "tick", "text-anchor": "middle" }, i));
  });
  svg.append(el("text", { x: (M.left + width) / 2, y: height - 3, class: "axis-title",
                          "text-anchor": "middle" }, "MoE layer"));
  if (ceiling) {
    svg.append(el("line", { x1: M.left, x2: width - M.right, y1: y(ceiling), y2: y(ceiling),
                            class: "ceiling" }));
  }
  const note = ceiling
    ? `dashed: log₂ ${cols} = ${fmt(ceiling)} bits, the most any router can reach over ${cols} ` +
      "experts (a finite sample of a uniform router reads less)"
    : "";
  return h("div", { class: "figure" }, h("h4", {}, "routing entropy of the turn"), svg,
           h("p", { class: "note" }, note));
}

function topkTable(topk) {
  const rows = topk.slice(0, 12).map((cands, i) =>
    h("tr", {}, h("td", {}, String(i)),
      cands.slice(0, 5).map((c) => h("td", {}, `${JSON.stringify(c.token)} ${fmt(Math.exp(c.logprob), 2)}`))));
  return h("div", { class: "figure" }, h("h4", {}, "top candidates per token (p)"),
           h("table", { class: "topk" }, h("tbody", {}, rows)));
}
