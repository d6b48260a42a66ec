// The gateway's API key (kept for this tab in sessionStorage) and JSON reads with it.

const KEY = "colibri-key";

export const auth = {
  get key() {
    return sessionStorage.getItem(KEY) || "";
  },
  set key(v) {
    if (v) sessionStorage.setItem(KEY, v);
    else sessionStorage.removeItem(KEY);
  },
  headers(extra = {}) {
    const k = this.key;
    return k ? { ...extra, Authorization: `Bearer ${k}` } : extra;
  },
};

/** {status, body}: body is the parsed JSON, or null (304, or not JSON). */
export async function get(path, { withKey = true } = {}) {
  const r = await fetch(path, { headers: withKey ? auth.headers() : {}, cache: "no-store" });
  let body = null;
  if (r.status !== 304 && r.status !== 204) {
    try { body = await r.json(); } catch { body = null; }
  }
  return { status: r.status, body };
}
