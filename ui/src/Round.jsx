// One round: its head line, the per-range chart, the ranges table and the dead letters.
import { Box, Button, Flex, Heading, Link, Table, Text } from "@chakra-ui/react";
import { replayDead, requeueDead } from "./api.js";
import { RangeChart } from "./RangeChart.jsx";
import { Clip, ProgressBar, ScrollX, StateBadge } from "./parts.jsx";
import { compactInterval, compactKey, fmtDur, fmtInt, fmtPct, fmtRate, fmtWhen, taskInstanceHref } from "./format.js";

const NUMS = ["done", "skipped", "dead", "retries"];

function heartbeat(r) {
  if (r.state === "complete") return r.completed_at ? "done " + r.completed_at.slice(11, 19) : "-";
  return r.heartbeat_age_s === null ? "never" : fmtDur(r.heartbeat_age_s) + " ago";
}

/** What the store recorded about why an unfinished range is not moving: the lag rule that
 * fired, the task instance that held it last (a link to it in the Airflow UI) and the last
 * error of the items waiting for a retry. */
function RangeNote({ r }) {
  const stop = r.stopped;
  const task = stop && stop.last_task;
  return (
    <Flex gap="3" wrap="wrap" className="note" minW="0" fontSize="sm">
      {r.lag_reason && (
        <Text as="span" color="fg.error" fontWeight="semibold" className="lag-reason">
          {r.lag_reason}
        </Text>
      )}
      {task && (
        <Text as="span" className="last-task">
          last held by{" "}
          <Link
            href={new URL(taskInstanceHref(task), document.baseURI).href}
            color="fg.info"
            className="ti-link"
            title={`${task.dag_id} / ${task.run_id} / ${task.task_id}`}
          >
            {task.task_id}
            {task.map_index === null ? "" : ` [${task.map_index}]`}
          </Link>
        </Text>
      )}
      {stop && stop.retry_errors.length > 0 && (
        <Text as="span" className="retry-error" color="fg.error">
          {fmtInt(r.retries)} item(s) waiting for a retry; last error:{" "}
          <Clip text={stop.retry_errors[0].error} maxW="28em" mono={false} />
        </Text>
      )}
      {!r.lag_reason && !stop && r.takeovers > 0 && (
        <Text as="span" color="fg.muted">
          {r.takeovers} takeover(s)
        </Text>
      )}
    </Flex>
  );
}

function hasNote(r) {
  return Boolean(r.lag_reason || r.stopped || r.takeovers > 0);
}

// A range is one row; what is known of why it is not moving (RangeNote) is a second row under it
// across the whole table, so the table stays narrow enough for a 1024 px window.
function RangeRows({ r, highlighted, columns }) {
  const tone = r.lagging ? "red" : r.state === "complete" ? "green" : "blue";
  const bg = r.lagging ? "bg.error" : highlighted ? "bg.emphasized" : undefined;
  const note = hasNote(r);
  const rowCls = (extra) => extra + (r.lagging ? " lagging" : "") + (highlighted ? " highlighted" : "");
  return (
    <>
      <Table.Row className={rowCls("range-row")} data-range={r.range_id} data-state={r.state} bg={bg}
        css={note ? { "& > td": { borderBottomWidth: 0 } } : undefined}>
        <Table.Cell textAlign="end">{r.range_id}</Table.Cell>
        <Table.Cell className="bounds">
          <Clip text={compactInterval(r.lo, r.hi)} maxW={{ base: "12em", xl: "17em" }} />
        </Table.Cell>
        <Table.Cell className="cursor">
          <Clip text={compactKey(r.cursor)} maxW={{ base: "6em", xl: "9em" }} />
        </Table.Cell>
        <Table.Cell whiteSpace="nowrap">
          {r.progress_basis === "counts only" ? (
            <>
              <ProgressBar p={null} width="40px" /> {fmtInt(r.items)} items
            </>
          ) : (
            <>
              <ProgressBar p={r.progress} tone={tone} width="40px" /> {fmtPct(r.progress)}
            </>
          )}
        </Table.Cell>
        <Table.Cell className="state" whiteSpace="nowrap">
          <StateBadge state={r.state} /> {r.lagging && <StateBadge state="lagging" />}
          {r.merged_into !== null && r.merged_into !== undefined && (
            <Text as="span" fontSize="xs"> coalesced into {r.merged_into}</Text>
          )}
        </Table.Cell>
        <Table.Cell className="owner">
          <Clip text={r.owner || "-"} maxW="6em" />
        </Table.Cell>
        <Table.Cell whiteSpace="nowrap" title={r.expected_heartbeat_s ? `a live owner heartbeats every ${fmtDur(r.expected_heartbeat_s)}` : undefined}>
          {heartbeat(r)}
        </Table.Cell>
        {NUMS.map((k) => (
          <Table.Cell key={k} textAlign="end" color={k === "dead" && r.dead ? "fg.error" : undefined}>
            {fmtInt(r[k])}
          </Table.Cell>
        ))}
      </Table.Row>
      {note && (
        <Table.Row className={rowCls("range-note")} data-range={r.range_id} bg={bg}>
          <Table.Cell />
          <Table.Cell colSpan={columns - 1} pt="0">
            <RangeNote r={r} />
          </Table.Cell>
        </Table.Row>
      )}
    </>
  );
}

function RangesTable({ round, highlight }) {
  const head = ["range", "(lo, hi]", "cursor", "progress", "state", "owner", "heartbeat", ...NUMS];
  return (
    <ScrollX>
      <Table.Root size="sm" className="ranges" variant="line" css={{ "& td, & th": { px: "1.5" } }}>
        <Table.Header>
          <Table.Row>
            {head.map((c) => (
              <Table.ColumnHeader key={c} textAlign={NUMS.includes(c) || c === "range" ? "end" : "start"}>
                {c}
              </Table.ColumnHeader>
            ))}
          </Table.Row>
        </Table.Header>
        <Table.Body>
          {round.ranges.map((r) => (
            <RangeRows key={r.range_id} r={r} highlighted={highlight === r.range_id} columns={head.length} />
          ))}
        </Table.Body>
      </Table.Root>
    </ScrollX>
  );
}

/** The DAG that planned the round (its round key `<dag_id>/<run_id>/<task_id>`), or null. */
function planningDag(round) {
  const parts = (round.round_key || "").split("/");
  return parts.length >= 3 && parts.every(Boolean) ? parts[0] : null;
}

/** For DAG editors, per range with dead letters: **Replay** (open and closed rounds) runs them
 * now through the DAG's own traverse task, in the API server (plugins/replays.py); a replay that
 * fails puts them back and the page says so. **Requeue** (open rounds) moves them back to the
 * range's retry set for the next traverse try; the answer says which try that is. Both ask for a
 * confirmation first. */
function DeadLetterActions({ stream, round, onChanged, onError }) {
  const ranges = round.ranges.filter((r) => r.dead > 0);
  if (!ranges.length) return null;
  const dag = planningDag(round);
  const open = round.state !== "closed";
  const replay = async (r) => {
    const ask =
      `Replay the ${r.dead} dead letter(s) of round ${round.round_id} range ${r.range_id} of stream ${stream} now?\n\n` +
      `They run through DAG ${dag}'s own traverse task (its processor, target connection and exactly_once), ` +
      "in the API server. Letters that fail again stay dead letters; if the replay fails, the letters it moved are put back as they were.";
    if (!window.confirm(ask)) return;
    try {
      const res = await replayDead(stream, round.round_id, r.range_id);
      if (res.state === "failed") onError(`Replay of range ${r.range_id} failed: ${res.message}`, null, true);
      else onError(null, res.message);
    } catch (e) {
      onError(`Could not replay range ${r.range_id}: ${e.message}`, null, true);
    }
    onChanged();
  };
  const requeue = async (r) => {
    const ask =
      `Requeue the ${r.dead} dead letter(s) of round ${round.round_id} range ${r.range_id} of stream ${stream}?\n\n` +
      "They go back to the range's retry set with fresh attempts and nothing runs them now: the next traverse try " +
      "that claims the range processes them (the answer names it). To process them now, use Replay.";
    if (!window.confirm(ask)) return;
    try {
      const res = await requeueDead(stream, round.round_id, r.range_id);
      onError(null, res.message);
    } catch (e) {
      onError(`Could not requeue range ${r.range_id}: ${e.message}`, null, true);
    }
    onChanged();
  };
  return (
    <Box className="dead-actions" my="1">
      {!dag && (
        <Text color="fg.muted" fontSize="sm" className="replay-no-dag">
          No Airflow DAG planned this round: replay with{" "}
          <code>airflow-keyset replay-dead-letters {stream} {round.round_id} --processor pkg.mod:fn</code>.
        </Text>
      )}
      <Flex className="requeue" gap="2" wrap="wrap" align="center">
        {ranges.map((r) => (
          <Flex key={r.range_id} gap="1" align="center">
            {dag && (
              <Button size="xs" variant="outline" className="replay-dead" data-range={r.range_id} onClick={() => replay(r)}
                title={`run them now through DAG ${dag}'s traverse task`}>
                Replay range {r.range_id}'s {fmtInt(r.dead)} dead letter(s)
              </Button>
            )}
            {open && (
              <Button size="xs" variant="ghost" className="requeue-dead" data-range={r.range_id} onClick={() => requeue(r)}
                title="back to the retry set for the next traverse try">
                Requeue range {r.range_id}'s {fmtInt(r.dead)} dead letter(s)
              </Button>
            )}
          </Flex>
        ))}
      </Flex>
    </Box>
  );
}

function DeadLetters({ round, actions }) {
  const rows = round.ranges.flatMap((r) => (r.dead_letters || []).map((d, i) => ({ r, d, i })));
  const total = round.dead || 0;
  return (
    <Box className="dead-letters" data-dead={total} mt="3">
      <Heading as="h4" size="sm">
        Dead letters <StateBadge state={total ? "dead" : "complete"}>{fmtInt(total)}</StateBadge>
      </Heading>
      {!total ? (
        <Text color="fg.muted">none</Text>
      ) : (
        <>
          <Text color="fg.muted" fontSize="sm">
            Newest first, up to a few per range. Replay them here (editors) or with{" "}
            <code>airflow-keyset replay-dead-letters</code>.
          </Text>
          {actions}
          <ScrollX>
            <Table.Root size="sm" variant="line">
              <Table.Header>
                <Table.Row>
                  {["range", "key", "attempts", "at", "error"].map((c) => (
                    <Table.ColumnHeader key={c}>{c}</Table.ColumnHeader>
                  ))}
                </Table.Row>
              </Table.Header>
              <Table.Body>
                {rows.map(({ r, d, i }) => (
                  <Table.Row key={`${r.range_id}-${i}`} className="dead-letter" data-range={r.range_id}>
                    <Table.Cell>{r.range_id}</Table.Cell>
                    <Table.Cell>
                      <Clip text={d.key_label} maxW="14em" />
                    </Table.Cell>
                    <Table.Cell>{d.attempts}</Table.Cell>
                    <Table.Cell whiteSpace="nowrap" color="fg.muted">{fmtWhen(d.at)}</Table.Cell>
                    <Table.Cell color="fg.error" fontFamily="mono" fontSize="xs" whiteSpace="pre-wrap" wordBreak="break-word">
                      {d.error}
                    </Table.Cell>
                  </Table.Row>
                ))}
              </Table.Body>
            </Table.Root>
          </ScrollX>
        </>
      )}
    </Box>
  );
}

/** The round's verification (``verify=``): pending, verified (after a repair pass), or failed
 * with the count and first keys that still match; keys only, never row data. */
function verifyText(v) {
  if (v.state === "pending") return "pending (the barrier verifies before closing)";
  const repaired = v.repaired === null || v.repaired === undefined ? "" : ` after repairing ${fmtInt(v.repaired)} key(s)`;
  if (v.state === "verified") return `verified${repaired}: no row still matches`;
  const more = v.first_keys.length < v.matching ? ", …" : "";
  return `failed${repaired}: ${fmtInt(v.matching)} row(s) still match (first keys: ${v.first_keys.join(", ")}${more})`;
}

export function RoundDetail({ round, highlight, stream, canEdit, onChanged, onError }) {
  const merged = round.ranges_merged ? ` (${round.ranges_merged} coalesced)` : "";
  return (
    <Box as="section" className="round" data-round={round.round_id} data-state={round.state} mt="4" pt="2" borderTopWidth="1px" borderStyle="dashed">
      <Flex className="round-head" gap="3" align="baseline" wrap="wrap">
        <Heading as="h3" size="md">Round {round.round_id}</Heading>
        <StateBadge state={round.state} />
        {round.lagging > 0 && <StateBadge state="lagging">{round.lagging} lagging</StateBadge>}
        <Clip text={compactInterval(round.start_key, round.end_key)} maxW="30em" />
        <Text as="span">
          {round.ranges_complete}/{round.n_ranges} ranges complete{merged}, progress {fmtPct(round.progress)}
        </Text>
        <Text as="span" color="fg.muted">
          rate {fmtRate(round.rate)}
          {round.rate_basis ? ` (${round.rate_basis})` : ""}, ETA {fmtDur(round.eta_s)}
        </Text>
        {round.source && round.source.table && (
          <Text as="span" color="fg.muted">
            table {round.source.table}, key {[].concat(round.source.key).join(", ")}
          </Text>
        )}
        {round.verification && (
          <Text as="span" className="verification" data-verify={round.verification.state} color={round.verification.state === "failed" ? "fg.error" : "fg.muted"}>
            verify {verifyText(round.verification)}
          </Text>
        )}
      </Flex>
      <Heading as="h4" size="sm" mt="3">Cursor progress per range</Heading>
      <Text fontSize="xs" color="fg.muted" className="legend">
        green complete · blue in progress · red lagging (no owner, or heartbeat older than 2× the expected interval) · grey no key-space position (counts only)
      </Text>
      <RangeChart round={round} />
      <RangesTable round={round} highlight={highlight} />
      <DeadLetters
        round={round}
        actions={canEdit && stream ? <DeadLetterActions stream={stream} round={round} onChanged={onChanged} onError={onError} /> : null}
      />
    </Box>
  );
}
