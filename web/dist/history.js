// The recent turns the engine profiled (/profile, every client's): tok/s and the time split.

import { el, fmt, yAxis } from "./svg.js";
import { PERF_COLORS } from "./palette.js";

const SHOW = 40; // turns drawn
const M = { left: 46, right: 10, top: 10, bottom: 34 };

/** A PROF turn's wall time split into the PERF parts it has (attention includes kv expansion;
 * other is what the timers do not cover, never negative). */
export function profParts(t) {
  const parts = {
    "disk wait": t.expert_wait_s,
    "expert matmul": t.expert_matmul_s,
    attention: t.attention_s,
    head: t.lm_head_s,
  };
  const known = Object.values(parts).reduce((a, b) => a + b, 0);
  parts.other = Math.max(0, t.wall_s - known);
  return parts;
}

/** completion tokens / wall time: prefill included, unlike DONE's decode-only tok/s. */
export const wallTokS = (t) => (t.wall_s > 0 ? t.completion_tokens / t.wall_s : 0);

export class History {
  constructor(rate, perf, legend, tooltip) {
    Object.assign(this, { rate, perf, legend, tooltip, seq: null, turns: [] });
    for (const svg of [rate, perf]) {
      svg.addEventListener("mousemove", (e) => this.hover(e));
      svg.addEventListener("mouseleave", () => tooltip.hide());
    }
    this.drawLegend();
  }

  update(profile) {
    if (profile.seq === this.seq) return false;
    this.seq = profile.seq;
    const all = profile.turns;
    const first = profile.seq - all.length + 1; // the number of the oldest turn kept
    this.turns = all.slice(-SHOW).map((t, i) => ({ ...t, n: first + all.length - Math.min(all.length, SHOW) + i }));
    this.draw();
    return true;
  }

  frame(svg, max, title) {
    const width = +svg.getAttribute("width"), height = +svg.getAttribute("height");
    svg.replaceChildren();
    const g = el("g");
    svg.append(g);
    const y = yAxis(g, { x0: M.left, x1: width - M.right, top: M.top, bottom: height - M.bottom,
                         max, title });
    const n = Math.max(this.turns.length, 1), slot = (width - M.left - M.right) / n;
    const x = (i) => M.left + slot * i + slot / 2;
    const yb = height - M.bottom;
    g.append(el("line", { x1: M.left, x2: width - M.right, y1: yb, y2: yb, class: "axis" }));
    const every = Math.ceil(this.turns.length / 10) || 1;
    this.turns.forEach((t, i) => {
      if (i % every && i !== this.turns.length - 1) return;
      g.append(el("text", { x: x(i), y: yb + 12, class: "tick", "text-anchor": "middle" }, t.n));
    });
    g.append(el("text", { x: (M.left + width - M.right) / 2, y: height - 4, class: "axis-title",
                          "text-anchor": "middle" }, "turn (engine-wide, oldest left)"));
    if (!this.turns.length) {
      g.append(el("text", { x: (M.left + width) / 2, y: (M.top + yb) / 2, class: "empty",
                            "text-anchor": "middle" }, "no turn profiled yet"));
    }
    return { g, y, x, slot, yb, title };
  }

  draw() {
    const rates = this.turns.map(wallTokS);
    const r = this.frame(this.rate, Math.max(...rates, 0) || 1, "tok/s");
    const pts = rates.map((v, i) => `${r.x(i)},${r.y(v)}`).join(" ");
    if (rates.length > 1) r.g.append(el("polyline", { points: pts, class: "rate-line" }));
    rates.forEach((v, i) => {
      r.g.append(el("rect", { x: r.x(i) - r.slot / 2, y: 0, width: r.slot, height: r.yb,
                              class: "hover-band", "data-i": i }));
      r.g.append(el("circle", { cx: r.x(i), cy: r.y(v), r: 3, class: "rate-dot",
                                "pointer-events": "none" }));
    });

    const walls = this.turns.map((t) => t.wall_s);
    const p = this.frame(this.perf, Math.max(...walls, 0) || 1, "seconds");
    const bw = Math.max(2, Math.min(24, p.slot * 0.7));
    this.turns.forEach((t, i) => {
      const grp = el("g", { class: "perf-bar", "data-i": i });
      let lo = 0;
      for (const [part, s] of Object.entries(profParts(t))) {
        const y0 = p.y(lo), y1 = p.y(lo + s);
        grp.append(el("rect", { x: p.x(i) - bw / 2, y: y1, width: bw, height: Math.max(0, y0 - y1),
                                fill: PERF_COLORS[part] }));
        lo += s;
      }
      grp.append(el("rect", { x: p.x(i) - p.slot / 2, y: 0, width: p.slot, height: p.yb,
                              class: "hover-band", "data-i": i }));
      p.g.append(grp);
    });
  }

  drawLegend() {
    const parts = ["disk wait", "expert matmul", "attention", "head", "other"];
    this.legend.replaceChildren(
      ...parts.map((part) => {
        const s = document.createElement("span");
        s.innerHTML = `<i class="swatch" style="background:${PERF_COLORS[part]}"></i>`;
        s.append(part === "attention" ? "attention (kv expansion included)" : part);
        return s;
      }),
    );
  }

  hover(e) {
    const band = e.target.closest && e.target.closest(".hover-band");
    if (!band) return this.tooltip.hide();
    const t = this.turns[+band.dataset.i];
    const lines = [
      [`turn ${t.n}`, "b"],
      [`${t.prompt_tokens} prompt + ${t.completion_tokens} completion tokens`],
      [`${fmt(t.wall_s)} s wall · ${fmt(wallTokS(t))} tok/s (prefill included)`],
    ];
    for (const [part, s] of Object.entries(profParts(t))) {
      lines.push([`${part}: ${fmt(s)} s`, null, PERF_COLORS[part]]);
    }
    lines.push([`${t.forwards} forward passes (all slots) · disk read ${fmt(t.expert_disk_s)} s`]);
    this.tooltip.show(e, lines);
  }
}
