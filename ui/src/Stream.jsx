// One stream: watermark, control state (pause, throttle, health, with Pause/Resume for DAG
// editors), its rounds table, and the rounds shown in detail.
import { Box, Button, Flex, Heading, Table, Text } from "@chakra-ui/react";
import { pauseStream, resumeStream } from "./api.js";
import { compactInterval, compactKey, fmtDur, fmtInt, fmtPct, fmtRate, fmtWhen } from "./format.js";
import { Clip, ProgressBar, ScrollX, StateBadge } from "./parts.jsx";
import { RoundDetail } from "./Round.jsx";

function ControlBar({ name, snap, onChanged, onError }) {
  const c = snap.control || {};
  const act = async (what) => {
    try {
      if (what === "pause") {
        const reason = window.prompt(`Pause stream ${name}? Reason:`, "");
        if (reason === null) return;
        await pauseStream(name, reason);
      } else {
        await resumeStream(name);
      }
    } catch (e) {
      onError(`Could not ${what} ${name}: ${e.message}`);
    }
    onChanged();
  };
  const parts = [];
  if (c.paused) {
    parts.push(
      <StateBadge key="p" state="paused" data-control="paused" />,
      <Text key="pr" as="span" className="pause-reason">
        {(c.reason || "no reason given") + (c.paused_by ? ` (by ${c.paused_by})` : "")}
      </Text>,
    );
  }
  if (c.max_rows_per_second !== null && c.max_rows_per_second !== undefined) {
    parts.push(
      <StateBadge key="t" state="throttled" data-control="throttled">
        throttled to {fmtInt(Math.round(c.max_rows_per_second))} rows/s
      </StateBadge>,
    );
  }
  if (c.healthy === false) {
    parts.push(
      <StateBadge key="u" state="unhealthy" data-control="unhealthy" />,
      <Text key="ur" as="span" className="health-reason">{c.health_reason || ""}</Text>,
    );
  } else if (c.healthy === true) {
    parts.push(<StateBadge key="h" state="healthy" data-control="healthy" title={c.health_reason || ""} />);
  }
  if (snap.can_edit) {
    parts.push(
      c.paused ? (
        <Button key="b" size="xs" variant="outline" className="resume" onClick={() => act("resume")}>Resume</Button>
      ) : (
        <Button key="b" size="xs" variant="outline" className="pause" onClick={() => act("pause")}>Pause</Button>
      ),
    );
  }
  return parts.length ? (
    <Flex className="control" gap="3" align="center" wrap="wrap" my="2">{parts}</Flex>
  ) : null;
}

function RoundsTable({ snap, shown, onExpand }) {
  const head = ["round", "state", "(start, end]", "progress", "ranges", "done", "skipped", "dead", "lagging", "created / closed", ""];
  const nums = new Set(["ranges", "done", "skipped", "dead", "lagging"]);
  return (
    <ScrollX>
      <Table.Root size="sm" className="rounds" variant="line" css={{ "& td, & th": { px: "1.5" } }}>
        <Table.Header>
          <Table.Row>
            {head.map((c) => (
              <Table.ColumnHeader key={c} textAlign={nums.has(c) ? "end" : "start"}>{c}</Table.ColumnHeader>
            ))}
          </Table.Row>
        </Table.Header>
        <Table.Body>
          {snap.rounds.map((r) => (
            <Table.Row key={r.round_id} className={"round-row" + (r.lagging ? " lagging" : "")} data-round={r.round_id}>
              <Table.Cell fontFamily="mono">{r.round_id}</Table.Cell>
              <Table.Cell><StateBadge state={r.state} /></Table.Cell>
              <Table.Cell><Clip text={compactInterval(r.start_key, r.end_key)} maxW="15em" /></Table.Cell>
              <Table.Cell whiteSpace="nowrap">
                <ProgressBar p={r.progress} tone={r.state === "closed" ? "green" : r.lagging ? "red" : "blue"} width="56px" /> {fmtPct(r.progress)}
              </Table.Cell>
              <Table.Cell textAlign="end">{`${r.ranges_complete}/${r.n_ranges}`}</Table.Cell>
              <Table.Cell textAlign="end">{fmtInt(r.done)}</Table.Cell>
              <Table.Cell textAlign="end">{fmtInt(r.skipped)}</Table.Cell>
              <Table.Cell textAlign="end" color={r.dead ? "fg.error" : undefined}>{fmtInt(r.dead)}</Table.Cell>
              <Table.Cell textAlign="end" color={r.lagging ? "fg.error" : undefined}>{fmtInt(r.lagging)}</Table.Cell>
              <Table.Cell whiteSpace="nowrap" color="fg.muted" title={`${r.closed_at || r.created_at} (UTC)`}>
                {fmtWhen(r.closed_at || r.created_at).replace(" UTC", "")}
              </Table.Cell>
              <Table.Cell>
                {r.state === "closed" && !shown.has(r.round_id) && (
                  <Button size="xs" variant="ghost" onClick={() => onExpand(r.round_id)}>details</Button>
                )}
              </Table.Cell>
            </Table.Row>
          ))}
        </Table.Body>
      </Table.Root>
    </ScrollX>
  );
}

function Fact({ label, children }) {
  return (
    <Flex as="span" gap="1.5" align="baseline" minW="0">
      <Text as="span" fontWeight="semibold">{label}</Text>
      {children}
    </Flex>
  );
}

// The stream's latest preview (PreviewRoundOperator's XCom): what the next round would be and do,
// measured before anything was written. Problems first, in red.
function PreviewPanel({ p }) {
  const proc = p.processor || {};
  const plan = p.chunk_plan || {};
  const eta = p.eta || {};
  return (
    <Box className="preview" data-dag={p.dag_id} data-run={p.run_id} borderWidth="1px" borderRadius="md" p="3" my="2">
      <Flex gap="4" align="baseline" wrap="wrap">
        <Heading as="h3" size="sm">preview</Heading>
        <Fact label="round">
          <Clip text={compactInterval(p.start_key, p.end_key) + (p.existing_round ? ` (${p.existing_round})` : "")} maxW="26em" />
        </Fact>
        <Fact label="rows"><span className="preview-rows">~{fmtInt(p.estimated_rows)} in {fmtInt((p.ranges || []).length)} ranges ({p.row_estimate})</span></Fact>
        <Fact label="chunk query"><span className="preview-scan">{plan.scan || "-"}{plan.index ? ` on ${plan.index}` : ""}</span></Fact>
        <Fact label="ETA"><span className="preview-eta">{fmtDur(eta.seconds)} at {fmtRate(eta.rows_per_second)} ({eta.limited_by})</span></Fact>
        <Fact label="previewed"><span>{fmtWhen(p.previewed_at)} by {p.dag_id} / {p.task_id}</span></Fact>
      </Flex>
      <Text className="preview-processor" fontSize="sm">
        {proc.ran
          ? proc.raised
            ? `processor raised on the sample (rolled back): ${proc.raised}`
            : `processor on ${fmtInt(proc.keys)} sample keys (rolled back): ${fmtInt(proc.applied)} applied, ${fmtInt(proc.not_applied)} not applied, ${fmtInt(proc.failed)} failed`
          : `processor not run: ${proc.why_not}`}
      </Text>
      {(p.problems || []).map((x, i) => (
        <Text key={i} className="preview-problem" fontSize="sm" color="fg.error">problem: {x}</Text>
      ))}
    </Box>
  );
}

export function StreamPanel({ entry, onExpand, onChanged, onError }) {
  const { name, snap, details, preview } = entry;
  const shown = new Set(details.map((d) => d.round_id));
  return (
    <Box as="section" className="stream" data-stream={name} borderWidth="1px" borderRadius="md" p="4" my="3" bg="bg.subtle">
      <Flex className="stream-head" gap="4" align="baseline" wrap="wrap">
        <Heading as="h2" size="lg" className="stream-name">{name}</Heading>
        <Fact label="watermark">
          <Clip className="watermark" text={snap.watermark === null ? "none yet" : compactKey(snap.watermark)} maxW="22em" />
        </Fact>
        <Fact label="retention floor">
          <Clip text={snap.retention_floor === null ? "-" : compactKey(snap.retention_floor)} maxW="22em" />
        </Fact>
        <Fact label="rounds planned"><span>{fmtInt(snap.rounds_planned)}</span></Fact>
        <Fact label="open"><span>{snap.open_rounds.join(", ") || "none"}</span></Fact>
      </Flex>
      <ControlBar name={name} snap={snap} onChanged={onChanged} onError={onError} />
      {preview ? <PreviewPanel p={preview} /> : null}
      {snap.rounds.length ? (
        <RoundsTable snap={snap} shown={shown} onExpand={onExpand} />
      ) : (
        <Text color="fg.muted">no rounds in Redis</Text>
      )}
      {details.map((d) => (
        <RoundDetail key={d.round_id} round={d} stream={name} canEdit={snap.can_edit} onChanged={onChanged} onError={onError} />
      ))}
    </Box>
  );
}
