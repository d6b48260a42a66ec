// One heat map per MoE layer: its experts as cells (wrapped after WRAP columns), coloured by
// tier and deepened by heat, the heat scale fitted to the map's hottest expert; a dot marks
// the experts routed in the last HITS window.

import { el, fmt } from "./svg.js";
import { HIT_COLOR, TIER_COLORS, TIER_NAMES, TIER_ORDER, cellRGB, css } from "./palette.js";

const WRAP = 32; // experts a row
const cellSize = (cols) => (cols <= 16 ? 20 : 14); // px a cell, gap included
const M = { left: 30, right: 8, top: 20, bottom: 30 };

/** [rows][cols] tiers, heats and routed flags of an /experts answer. */
export function decode(x) {
  const tier = x.map_grid.map((row) => row.map((b) => Math.min(b >> 6, 2)));
  const heat = x.map_grid.map((row) => row.map((b) => b & 63));
  const hit = x.hits_grid.map((row) => row.map((v) => !!v));
  return { tier, heat, hit };
}

/** Selections an expert of this heat (the count's bit length) has had. */
export function selections(heat) {
  if (heat === 0) return "never selected";
  if (heat === 1) return "1 selection";
  const lo = 2 ** (heat - 1), hi = 2 ** heat - 1;
  return `${fmt(lo)}–${fmt(hi)} selections`;
}

export class HeatMaps {
  constructor(root, legend, tooltip) {
    Object.assign(this, { root, legend, tooltip, shape: "", cells: [], dots: [], state: null });
    this.atlas = null; // (layer, expert) -> atlas entry, when the atlas matches this map
    root.addEventListener("mousemove", (e) => this.hover(e));
    root.addEventListener("mouseleave", () => tooltip.hide());
  }

  update(x) {
    const shape = `${x.rows}x${x.cols}`;
    if (shape !== this.shape) this.build(x.rows, x.cols);
    const d = decode(x);
    const top = Math.max(1, ...d.heat.flat());
    for (let r = 0; r < x.rows; r++) {
      for (let c = 0; c < x.cols; c++) {
        this.cells[r][c].setAttribute("fill", css(cellRGB(d.tier[r][c], d.heat[r][c], top)));
        this.dots[r][c].style.display = d.hit[r][c] ? "" : "none";
      }
    }
    this.state = { ...d, top, rows: x.rows, cols: x.cols };
    this.drawLegend(top);
  }

  build(rows, cols) {
    this.shape = `${rows}x${cols}`;
    this.root.replaceChildren();
    this.cells = [];
    this.dots = [];
    const CELL = (this.cell = cellSize(cols));
    const W = Math.min(cols, WRAP), R = Math.ceil(cols / W);
    const width = M.left + W * CELL + M.right, height = M.top + R * CELL + M.bottom;
    const step = W <= 16 ? 1 : 4;
    for (let r = 0; r < rows; r++) {
      const svg = el("svg", {
        class: "layer-map", "data-layer": r, width, height, viewBox: `0 0 ${width} ${height}`,
        role: "img", "aria-label": `MoE layer ${r}: ${cols} experts`,
      });
      svg.append(el("text", { x: M.left, y: 13, class: "map-title" }, `MoE layer ${r}`));
      if (R > 1) {
        for (let row = 0; row < R; row++) {
          const y = M.top + row * CELL + CELL / 2 + 3;
          svg.append(el("text", { x: M.left - 4, y, class: "tick", "text-anchor": "end" }, row * W));
        }
      }
      const yb = M.top + R * CELL;
      for (let col = 0; col < W; col++) {
        if (col % step && col !== W - 1) continue;
        const x = M.left + col * CELL + CELL / 2;
        svg.append(el("line", { x1: x, x2: x, y1: yb, y2: yb + 3, class: "axis" }));
        svg.append(el("text", { x, y: yb + 12, class: "tick", "text-anchor": "middle" }, col));
      }
      const title = R > 1 ? "expert = row start + column" : "expert";
      svg.append(el("text", { x: M.left + (W * CELL) / 2, y: height - 3, class: "axis-title",
                              "text-anchor": "middle" }, title));
      const cells = [], dots = [];
      for (let e = 0; e < cols; e++) {
        const x = M.left + (e % W) * CELL, y = M.top + Math.floor(e / W) * CELL;
        const rect = el("rect", { x, y, width: CELL - 1, height: CELL - 1, class: "cell",
                                  "data-e": e, fill: "#fff" });
        const dot = el("circle", { cx: x + (CELL - 1) / 2, cy: y + (CELL - 1) / 2, r: 3,
                                   fill: HIT_COLOR, stroke: "#fff", "stroke-width": 1,
                                   class: "hit", "data-e": e, "pointer-events": "none" });
        dot.style.display = "none";
        svg.append(rect, dot);
        cells.push(rect);
        dots.push(dot);
      }
      this.cells.push(cells);
      this.dots.push(dots);
      this.root.append(svg);
    }
  }

  drawLegend(top) {
    const levels = [];
    const n = Math.min(top, 20);
    for (let i = 0; i <= n; i++) levels.push(Math.round((i * top) / n));
    const sw = 16, x0 = 64, width = Math.max(x0 + levels.length * sw + 150, 480);
    const height = 3 * 18 + 34;
    const svg = el("svg", { id: "heat-legend", width, height, "data-top": top,
                            viewBox: `0 0 ${width} ${height}` });
    TIER_ORDER.forEach((t, i) => {
      const y = 4 + i * 18;
      svg.append(el("text", { x: x0 - 6, y: y + 11, class: "tick", "text-anchor": "end" },
                    TIER_NAMES[t]));
      levels.forEach((hv, j) => {
        const r = el("rect", { x: x0 + j * sw, y, width: sw - 1, height: 15,
                               fill: css(cellRGB(t, hv, top)) });
        r.append(el("title", {}, `${TIER_NAMES[t]}, heat ${hv}: ${selections(hv)}`));
        svg.append(r);
      });
    });
    const yb = 4 + 3 * 18;
    const marks = [...new Set([0, levels[Math.floor(levels.length / 2)], top])];
    for (const hv of marks) {
      const j = levels.indexOf(hv), x = x0 + j * sw + (sw - 1) / 2;
      svg.append(el("text", { x, y: yb + 10, class: "tick", "text-anchor": "middle" }, hv));
    }
    svg.append(el("text", { x: x0, y: yb + 24, class: "axis-title" },
                  `heat (bit length of the selection count); scale 0–${top}, this map's hottest`));
    const xd = x0 + levels.length * sw + 16;
    svg.append(el("circle", { cx: xd + 6, cy: 4 + 18 + 7, r: 3, fill: HIT_COLOR }));
    svg.append(el("text", { x: xd + 14, y: 4 + 18 + 11, class: "tick" }, "routed (last window)"));
    this.legend.replaceChildren(svg);
  }

  hover(e) {
    const cell = e.target.closest && e.target.closest("rect.cell");
    if (!cell || !this.state) return this.tooltip.hide();
    const r = +cell.closest("svg").dataset.layer, c = +cell.dataset.e, s = this.state;
    const tier = s.tier[r][c], heat = s.heat[r][c];
    const lines = [
      [`MoE layer ${r} · expert ${c}`, "b"],
      [`tier: ${TIER_NAMES[tier]}`, null, TIER_COLORS[tier]],
      [`heat ${heat} of ${s.top}: ${selections(heat)}`],
    ];
    if (s.hit[r][c]) lines.push(["routed in the last window"]);
    const a = this.atlas && this.atlas.get(`${r}:${c}`);
    if (a) lines.push([`atlas: top ${a.top} · spec ${fmt(a.spec, 2)} · ${a.label || ""}`]);
    this.tooltip.show(e, lines);
  }
}

/** Experts per tier in an /experts answer's map (the same tiers the heat maps draw). */
export function tierCounts(x) {
  const n = { 0: 0, 1: 0, 2: 0 };
  for (const row of x.map_grid) for (const b of row) n[Math.min(b >> 6, 2)] += 1;
  return n;
}
