// Wording shared by every part of the page. fmtDur and fmtRate mirror core/rounds/status.py
// format_duration and format_rate (the terminal's wording): 45s, 1m05s, 2h03m; 2.5/s, 340/s, 12k/s.

export const fmtInt = (n) => (n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US"));

export const fmtPct = (p) =>
  p === null || p === undefined ? "n/a" : (100 * p).toFixed(p > 0 && p < 0.001 ? 2 : 1) + "%";

export function fmtDur(sec) {
  if (sec === null || sec === undefined) return "-";
  const s = Math.round(sec);
  const pad = (n) => String(n).padStart(2, "0");
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + pad(s % 60) + "s";
  return Math.floor(s / 3600) + "h" + pad(Math.floor((s % 3600) / 60)) + "m";
}

export function fmtRate(r) {
  if (r === null || r === undefined) return "-";
  if (r >= 10000) return fmtInt(Math.round(r / 1000)) + "k/s";
  return r >= 10 ? fmtInt(Math.round(r)) + "/s" : r.toFixed(1) + "/s";
}

export const fmtWhen = (t) => (t ? String(t).replace("T", " ").replace(/\+00:00$/, " UTC") : "-");

// A UTC timestamp as ISO with "Z" (2024-05-01T10:00:00Z); the same rule as
// operators/traverse.py compact_key, which writes the Map Index column.
const UTC_ISO = /^(\d{4}-\d\d-\d\dT\d\d:\d\d(?::\d\d(?:\.\d+)?)?)(?:\+00:00|Z)$/;
const compactScalar = (v) => {
  const s = typeof v === "string" ? v : JSON.stringify(v);
  const m = UTC_ISO.exec(s);
  return m ? m[1] + "Z" : s;
};

/** A key (its JSON form: a scalar, or a list for a composite key) on one line:
 * `2024-05-01T10:00:00Z · 41235`; null is the open lower end, `-inf`. */
export function compactKey(value) {
  if (value === null || value === undefined) return "-inf";
  if (Array.isArray(value)) return value.map(compactScalar).join(" · ");
  return compactScalar(value);
}

/** `(lo, hi]` of two keys, compact. */
export const compactInterval = (lo, hi) => `(${compactKey(lo)}, ${compactKey(hi)}]`;

/** The Airflow UI's page of one task instance (its routes: dags/:dagId/runs/:runId/tasks/:taskId
 * and .../mapped/:mapIndex), relative to the UI's base URL. */
export function taskInstanceHref({ dag_id, run_id, task_id, map_index }) {
  const e = encodeURIComponent;
  const base = `dags/${e(dag_id)}/runs/${e(run_id)}/tasks/${e(task_id)}`;
  return map_index === null || map_index === undefined ? base : `${base}/mapped/${map_index}`;
}
