// The plugin's JSON API (plugins/app.py), the page's one data source. URLs are relative to the
// Airflow UI's base URL (its <base href>), so the page works behind a path prefix; the browser
// sends Airflow's own `_token` cookie with them (same origin).

const root = () => new URL("keyset/", document.baseURI);

export class ApiError extends Error {
  constructor(status, detail) {
    super(`${status}: ${detail}`);
    this.status = status;
    this.detail = detail;
  }
}

async function call(path, init) {
  const resp = await fetch(new URL(path, root()), {
    credentials: "same-origin",
    ...init,
    headers: { Accept: "application/json", ...(init && init.headers) },
  });
  let body = null;
  try {
    body = await resp.json();
  } catch {
    /* not JSON */
  }
  if (!resp.ok) {
    const d = body && body.detail;
    throw new ApiError(resp.status, d ? (typeof d === "string" ? d : JSON.stringify(d)) : resp.statusText);
  }
  return body;
}

const e = encodeURIComponent;

// The Redis connection every call reads (`?conn=`; null: the server's configured default). Set
// by the page's connection selector (KeysetApp) before it loads.
let conn = null;
export const setConnection = (id) => {
  conn = id || null;
};
const q = (path) => (conn ? `${path}${path.includes("?") ? "&" : "?"}conn=${e(conn)}` : path);

export const getConnections = () => call("api/connections");
export const getStreams = () => call(q("api/streams"));
export const getStream = (name) => call(q(`api/streams/${e(name)}?closed=3`));
export const getRound = (name, roundId) => call(q(`api/streams/${e(name)}/rounds/${e(roundId)}?dead=3`));
export const getPreview = (name) => call(`api/streams/${e(name)}/preview`);
export const getRunRounds = (dagId, runId) => call(q(`api/runs/${e(dagId)}/${e(runId)}`));
const post = (path, body) =>
  call(q(path), { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
export const pauseStream = (name, reason) => post(`api/streams/${e(name)}/pause`, { reason });
export const resumeStream = (name) => post(`api/streams/${e(name)}/resume`, {});
export const requeueDead = (name, roundId, rangeId) =>
  post(`api/streams/${e(name)}/rounds/${e(roundId)}/ranges/${e(rangeId)}/requeue-dead`, {});
export const replayDead = (name, roundId, rangeId) =>
  post(`api/streams/${e(name)}/rounds/${e(roundId)}/ranges/${e(rangeId)}/replay-dead`, {});
