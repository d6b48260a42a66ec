// The page's colours, defined once. The tier colours, MIN_DEPTH, HIT_COLOR and PERF_COLORS are
// the notebooks' and widgets' (colibri/widgets/plots.py; tests/test_page.py checks they agree).
// Tiers are Okabe–Ito blue, orange and grey: told apart under every common colour-vision
// deficiency, also when paled by a low heat.

export const TIER_COLORS = { 2: "#0072B2", 1: "#E69F00", 0: "#999999" }; // device, RAM, disk
export const TIER_NAMES = { 2: "device", 1: "RAM", 0: "disk" };
export const TIER_ORDER = [2, 1, 0]; // hottest storage first
export const MIN_DEPTH = 0.25; // colour depth of a never-selected expert (1 = the full colour)
export const HIT_COLOR = "#000000"; // the dot of an expert routed in the last HITS window

// A turn's time split, bottom to top (colibri.client.PERF_PARTS).
export const PERF_COLORS = {
  "disk wait": "#d7191c",
  "expert matmul": "#2c7bb6",
  attention: "#fdae61",
  "kv expansion": "#abd9e9",
  head: "#7b3294",
  other: "#bababa",
};

// Atlas topics: Okabe–Ito first, then Paul Tol's muted colours (more topics than any
// colour-blind-safe set holds: the legend and tooltips name them).
export const TOPIC_COLORS = [
  "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
  "#332288", "#44AA99", "#882255", "#999933", "#AA4499", "#666666",
];

function rgb01(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255].map((v) => v / 255);
}

/** The colour of an expert of `tier` with `heat`, the map's hottest being `top`: the tier
 * colour blended toward white as heat falls (plots.cell_rgb). Returns [r, g, b] in 0..255. */
export function cellRGB(tier, heat, top) {
  const depth = MIN_DEPTH + (1 - MIN_DEPTH) * Math.min(Math.max(heat / Math.max(top, 1), 0), 1);
  return rgb01(TIER_COLORS[Math.min(tier, 2)]).map((v) => Math.round(255 * (1 - (1 - v) * depth)));
}

export const css = ([r, g, b]) => `rgb(${r},${g},${b})`;
