// Small helpers for the SVG figures: elements, nice ticks, axes, number formats.

const NS = "http://www.w3.org/2000/svg";

/** An SVG element with attributes (and text, when `text` is given). */
export function el(tag, attrs = {}, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

/** An HTML element with attributes, class and children (strings become text). */
export function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else if (k in e) e[k] = v;
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}

/** About `count` round tick values covering [0, max]. */
export function ticks(max, count = 4) {
  if (!(max > 0)) return [0];
  const raw = max / count, mag = 10 ** Math.floor(Math.log10(raw)), f = raw / mag;
  const step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10) * mag;
  const out = [];
  for (let v = 0; v <= max * (1 + 1e-9) + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  if (out[out.length - 1] < max) out.push(+(out[out.length - 1] + step).toPrecision(12));
  return out;
}

/** A number for a tick or a table: few digits, no trailing zeros. */
export function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1000) return Math.round(v).toLocaleString("en");
  if (a >= 100) return v.toFixed(0);
  return String(+v.toPrecision(digits));
}

/** A y axis at x = `x0` from `top` to `bottom` for values [0, max]: tick labels, grid lines
 * across to `x1`, and a rotated title. Returns the value -> y function. */
export function yAxis(g, { x0, x1, top, bottom, max, title, count = 4 }) {
  const ts = ticks(max, count), hi = ts[ts.length - 1] || 1;
  const y = (v) => bottom - ((bottom - top) * v) / hi;
  for (const t of ts) {
    g.append(el("line", { x1: x0, x2: x1, y1: y(t), y2: y(t), class: "grid" }));
    g.append(el("text", { x: x0 - 4, y: y(t) + 3, class: "tick", "text-anchor": "end" }, fmt(t)));
  }
  g.append(el("line", { x1: x0, x2: x0, y1: top, y2: bottom, class: "axis" }));
  const mid = (top + bottom) / 2;
  g.append(
    el("text", { x: 11, y: mid, class: "axis-title", transform: `rotate(-90 11 ${mid})`,
                 "text-anchor": "middle" }, title),
  );
  return y;
}
