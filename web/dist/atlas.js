// The expert atlas the gateway serves at /experts.json (colibri atlas, keyed "layer:expert"):
// MoE layers by experts, each expert coloured by its top topic and deepened by how
// specialised it is; specialists outlined.

import { el, fmt, h } from "./svg.js";
import { TOPIC_COLORS } from "./palette.js";

const CELL = 14;
const M = { left: 52, right: 8, top: 16, bottom: 30 };

/** Map "layer:expert" -> entry, with the atlas's shape; null when not a keyed atlas. */
export function readAtlas(a) {
  if (!a || typeof a.experts !== "object" || Array.isArray(a.experts)) return null;
  const byKey = new Map(Object.entries(a.experts));
  let layers = 0, experts = 0;
  for (const x of byKey.values()) {
    layers = Math.max(layers, x.layer + 1);
    experts = Math.max(experts, x.expert + 1);
  }
  layers = Math.max(layers, a.layers || 0);
  experts = Math.max(experts, a.experts_per_layer || 0);
  const categories = a.categories || [...new Set([...byKey.values()].map((x) => x.top))];
  return { byKey, layers, experts, categories, model: a.model || {}, raw: a };
}

export function drawAtlas(root, atlas, tooltip, live) {
  const { byKey, layers, experts, categories } = atlas;
  const colour = (cat) => TOPIC_COLORS[Math.max(0, categories.indexOf(cat)) % TOPIC_COLORS.length];
  const maxSpec = Math.max(1e-9, ...[...byKey.values()].map((x) => x.spec || 0));
  const width = M.left + experts * CELL + M.right, height = M.top + layers * CELL + M.bottom;
  const svg = el("svg", { id: "atlas-map", width, height, viewBox: `0 0 ${width} ${height}`,
                          "data-layers": layers, "data-experts": experts });
  for (let l = 0; l < layers; l++) {
    svg.append(el("text", { x: M.left - 4, y: M.top + l * CELL + CELL / 2 + 3, class: "tick",
                            "text-anchor": "end" }, l));
  }
  const step = experts <= 16 ? 1 : 4, yb = M.top + layers * CELL;
  for (let e = 0; e < experts; e++) {
    if (e % step && e !== experts - 1) continue;
    svg.append(el("text", { x: M.left + e * CELL + CELL / 2, y: yb + 12, class: "tick",
                            "text-anchor": "middle" }, e));
  }
  svg.append(el("text", { x: M.left + (experts * CELL) / 2, y: height - 3, class: "axis-title",
                          "text-anchor": "middle" }, "expert"));
  svg.append(el("text", { x: M.left - 4, y: 10, class: "axis-title", "text-anchor": "end" },
                "MoE layer"));
  for (const [key, x] of byKey) {
    const spec = Math.max(0, x.spec || 0) / maxSpec;
    const specialist = x.label === "specialist";
    svg.append(el("rect", {
      x: M.left + x.expert * CELL, y: M.top + x.layer * CELL, width: CELL - 1, height: CELL - 1,
      fill: colour(x.top), "fill-opacity": 0.2 + 0.8 * spec, class: "atlas-cell", "data-key": key,
      stroke: specialist ? "#000" : "none", "stroke-width": specialist ? 1 : 0,
    }));
  }
  svg.addEventListener("mousemove", (e) => {
    const r = e.target.closest && e.target.closest("rect.atlas-cell");
    if (!r) return tooltip.hide();
    const x = byKey.get(r.dataset.key);
    const aff = Object.entries(x.affinity || {}).sort((a, b) => b[1] - a[1]).slice(0, 3);
    const lines = [
      [`MoE layer ${x.layer} · expert ${x.expert}`, "b"],
      [`top topic: ${x.top}`, null, colour(x.top)],
      [`spec ${fmt(x.spec, 2)}${x.label ? ` (${x.label})` : ""}${x.lift ? ` · lift ${fmt(x.lift, 3)}` : ""}`],
    ];
    if (x.total !== undefined) lines.push([`${fmt(x.total)} selections over the probes`]);
    if (aff.length) lines.push([`p(topic | expert): ${aff.map(([c, p]) => `${c} ${fmt(p, 2)}`).join(", ")}`]);
    tooltip.show(e, lines);
  });
  svg.addEventListener("mouseleave", () => tooltip.hide());

  const counts = new Map(categories.map((c) => [c, 0]));
  for (const x of byKey.values()) counts.set(x.top, (counts.get(x.top) || 0) + 1);
  const legend = h("div", { class: "legend" }, [...counts].map(([c, n]) =>
    h("span", {}, h("i", { class: "swatch", style: `background:${colour(c)}` }), `${c} ${n}`)));
  const m = atlas.model, shape = `${layers} MoE layers × ${experts} experts`;
  const match = live && live.rows === layers && live.cols === experts;
  const about = [
    `${shape}${m.path ? `, measured on ${m.path}` : ""}${m.family ? ` (${m.family})` : ""}. `,
    "Colour: the topic an expert is most used for; depth: its specialisation (spec, scaled to the ",
    `atlas's most specialised, ${fmt(maxSpec, 2)}); outlined: specialists. `,
    live ? (match ? "Same shape as the live map: its tooltips name each expert's top topic."
                  : `The live map is ${live.rows} × ${live.cols}: a different model's atlas?`) : "",
  ].join("");
  root.replaceChildren(h("p", { class: "note" }, about), svg, legend);
  return match;
}
