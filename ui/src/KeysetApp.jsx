// The Keyset traversals page, rendered by the Airflow UI inside its own layout (react_apps):
//
// - on the navigation entry (no props): every stream under the key prefix, or the one the query
//   string names (`?stream=S&round=R`: what the operators' "Keyset round" extra link opens);
// - on a DAG run's tab (dagId, runId) and a task instance's tab (also taskId, mapIndex): the
//   rounds that run's plan tasks planned; on a task instance's tab its range is highlighted.
//
// The page scrolls with Airflow's content area (it sets no height and no overflow of its own), so
// there is one vertical scrollbar; tables too wide for their panel scroll inside it.
import { Box, Flex, Heading, Spinner, Text } from "@chakra-ui/react";
import { useCallback, useEffect, useState } from "react";
import { getConnections, getPreview, getRound, getRunRounds, getStream, getStreams, setConnection } from "./api.js";
import { RoundDetail } from "./Round.jsx";
import { StreamPanel } from "./Stream.jsx";

async function loadStreams(only, expanded) {
  const list = await getStreams();
  const names = list.streams.map((s) => s.stream).filter((s) => !only.stream || s === only.stream);
  const streams = await Promise.all(
    names.map(async (name) => {
      const snap = await getStream(name);
      const wanted = snap.rounds
        .filter((r) => (only.round ? r.round_id === only.round : r.state !== "closed" || expanded.has(`${name}/${r.round_id}`)))
        .map((r) => r.round_id);
      if (only.round && !wanted.length) wanted.push(only.round);
      const details = await Promise.all(wanted.map((id) => getRound(name, id)));
      // the stream's latest preview (an XCom of PreviewRoundOperator); none, or not readable: null
      const preview = await getPreview(name).then((p) => p.preview, () => null);
      return { name, snap, details, preview };
    }),
  );
  return { kind: "streams", list, streams };
}

async function loadRun(dagId, runId) {
  const run = await getRunRounds(dagId, runId);
  const rounds = await Promise.all(
    run.rounds.map(async (entry) => {
      if (!entry.in_redis) return { entry, missing: entry.lost_message };
      try {
        return { entry, detail: await getRound(entry.stream, entry.round_id) };
      } catch (e) {
        if (e.status === 410 || e.status === 404) return { entry, missing: e.detail };
        throw e;
      }
    }),
  );
  return { kind: "run", run, rounds };
}

function RunView({ data, mapIndex }) {
  const { run, rounds } = data;
  if (!rounds.length) {
    return (
      <Text className="run-empty" data-why={run.absent_reason}>
        {run.absent_message}
      </Text>
    );
  }
  return rounds.map(({ entry, detail, missing }) => (
    <Box as="section" key={`${entry.stream}/${entry.round_id}`} className="stream run-round" data-stream={entry.stream}>
      <Text color="fg.muted">
        planned by task {entry.task_id}
        {entry.map_index === null ? "" : ` [${entry.map_index}]`}: stream {entry.stream}, round {entry.round_id}
      </Text>
      {missing ? (
        <Text className="round-lost" color="fg.error">{missing}</Text>
      ) : (
        <RoundDetail round={detail} highlight={mapIndex} />
      )}
    </Box>
  ));
}

/** The Redis connection selector: the configured default first, then every Airflow connection
 * of type redis (GET api/connections). The choice is kept in the URL (`?conn=`). */
function ConnectionSelect({ value, onChange }) {
  const [list, setList] = useState(null);
  useEffect(() => {
    getConnections().then(setList, () => setList(null));
  }, []);
  if (!list) return null;
  const current = value || list.default;
  const ids = list.connections.includes(current) ? list.connections : [...list.connections, current];
  return (
    <Text as="label" color="fg.muted" display="inline-flex" gap="1.5" alignItems="baseline">
      Redis connection
      <select
        id="redis-conn"
        value={current}
        onChange={(ev) => onChange(ev.target.value === list.default ? null : ev.target.value)}
        style={{ background: "transparent", color: "inherit", border: "1px solid currentColor", borderRadius: "4px", padding: "0 4px" }}
      >
        {ids.map((id) => (
          <option key={id} value={id}>
            {id}
            {id === list.default ? " (default)" : ""}
          </option>
        ))}
      </select>
    </Text>
  );
}

function errorText(e) {
  if (e.status === 401 || e.status === 403) return `Not signed in to Airflow or not allowed (${e.message}). Sign in to Airflow and reload.`;
  return `Could not load: ${e.message}`;
}

export default function KeysetApp({ dagId, runId, taskId, mapIndex }) {
  const search = window.location.search; // the Airflow UI re-renders the page when it changes
  const query = new URLSearchParams(search);
  const only = { stream: query.get("stream"), round: query.get("round") };
  const refreshS = Number(query.get("refresh") ?? "15");
  const runScope = Boolean(dagId && runId);
  const highlight = taskId && mapIndex !== undefined && Number(mapIndex) >= 0 ? Number(mapIndex) : null;
  const [expanded, setExpanded] = useState(() => new Set());
  const [conn, setConn] = useState(() => query.get("conn"));
  const [notice, setNotice] = useState(null);
  // An action's failure (a replay that failed): kept across reloads, until the next action.
  const [actionError, setActionError] = useState(null);
  const chooseConn = useCallback((id) => {
    const url = new URL(window.location.href);
    if (id) url.searchParams.set("conn", id);
    else url.searchParams.delete("conn");
    window.history.replaceState(window.history.state, "", url);
    setExpanded(new Set());
    setNotice(null);
    setActionError(null);
    setConn(id);
  }, []);
  const [tick, setTick] = useState(0);
  const [view, setView] = useState({ data: null, error: null, ready: false, at: null });
  const reload = useCallback(() => setTick((t) => t + 1), []);

  useEffect(() => {
    let gone = false;
    setConnection(conn);
    const load = runScope ? loadRun(dagId, runId) : loadStreams(only, expanded);
    load.then(
      (data) => !gone && setView({ data, error: null, ready: true, at: new Date() }),
      (error) => !gone && setView((v) => ({ ...v, error: errorText(error), ready: true })),
    );
    const timer = refreshS > 0 ? setTimeout(reload, refreshS * 1000) : null;
    return () => {
      gone = true;
      if (timer) clearTimeout(timer);
    };
    // `only` is read from `search`
  }, [tick, search, runScope, dagId, runId, expanded, refreshS, reload, conn]);

  const { data, error, ready, at } = view;
  return (
    <Box id="keyset-app" data-ready={ready ? "1" : "0"} p={runScope ? "2" : "4"} minW="0" color="fg">
      {!runScope && (
        <Flex as="header" gap="4" align="baseline" wrap="wrap" mb="2">
          <Heading as="h1" size="xl">Keyset traversals</Heading>
          <ConnectionSelect value={conn} onChange={chooseConn} />
          {data && data.kind === "streams" && (
            <Text color="fg.muted" id="source-info" data-conn={data.list.redis_conn_id}>
              key prefix {data.list.key_prefix}
            </Text>
          )}
          {at && <Text color="fg.muted" id="refreshed">updated {at.toLocaleTimeString("en-GB")}</Text>}
        </Flex>
      )}
      {error && (
        <Box id="error" role="alert" color="fg.error" borderWidth="1px" borderColor="border.error" bg="bg.error" borderRadius="md" px="3" py="2" my="2" whiteSpace="pre-wrap">
          {error}
        </Box>
      )}
      {actionError && (
        <Box id="action-error" role="alert" color="fg.error" borderWidth="1px" borderColor="border.error" bg="bg.error" borderRadius="md" px="3" py="2" my="2" whiteSpace="pre-wrap">
          {actionError}
        </Box>
      )}
      {notice && (
        <Box id="notice" role="status" borderWidth="1px" borderColor="border.info" bg="bg.info" borderRadius="md" px="3" py="2" my="2">
          {notice}
        </Box>
      )}
      {!ready && <Spinner size="sm" />}
      {data && data.kind === "run" && <RunView data={data} mapIndex={highlight} />}
      {data && data.kind === "streams" &&
        (data.streams.length ? (
          data.streams.map((entry) => (
            <StreamPanel
              key={entry.name}
              entry={entry}
              onExpand={(id) => setExpanded((s) => new Set([...s, `${entry.name}/${id}`]))}
              onChanged={reload}
              onError={(text, done, sticky) => {
                if (sticky) setActionError(text);
                else {
                  if (text) setView((v) => ({ ...v, error: text }));
                  setActionError(null);
                }
                setNotice(done || null);
              }}
            />
          ))
        ) : (
          <Text color="fg.muted">
            No streams under key prefix {data.list.key_prefix} in the Redis of connection {data.list.redis_conn_id}.
          </Text>
        ))}
    </Box>
  );
}
