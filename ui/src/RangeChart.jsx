// One horizontal bar per range: the fraction of (lo, hi] its cursor has passed. Colours are
// Chakra's semantic tokens as CSS variables, so the chart follows Airflow's colour mode. Font
// sizes are inline styles: the Airflow UI's CSS would otherwise override the SVG attribute, and
// labels grown past the right margin are cut off by the SVG (tests/ui check each label's box).

const v = (token) => `var(--chakra-colors-${token.replace(".", "-")})`;

function barColour(r) {
  if (r.lagging) return v("red.solid");
  if (r.state === "complete") return v("green.solid");
  return r.progress === null ? v("gray.solid") : v("blue.solid");
}

export function RangeChart({ round }) {
  const rows = round.ranges;
  const compact = rows.length > 48; // up to Airflow's max_map_length: thin bars, a label every 16th
  const barH = compact ? 5 : 14;
  const gap = compact ? 1 : 6;
  const left = 74, right = 72, width = 860, top = 8;
  const height = top + rows.length * (barH + gap) + 22;
  const plotW = width - left - right;
  return (
    <svg
      className="range-chart"
      width="100%"
      style={{ maxWidth: width, display: "block" }}
      viewBox={`0 0 ${width} ${height}`}
      role="img"
      aria-label={`cursor progress per range of round ${round.round_id}`}
    >
      {[0, 0.25, 0.5, 0.75, 1].map((q) => (
        <g key={q}>
          <line x1={left + q * plotW} x2={left + q * plotW} y1={top - 4} y2={height - 18} stroke={v("border")} />
          <text x={left + q * plotW} y={height - 5} textAnchor="middle" style={{ fontSize: "11px" }} fill={v("fg.muted")}>
            {q * 100}%
          </text>
        </g>
      ))}
      {rows.map((r, i) => {
        const y = top + i * (barH + gap);
        const p = r.progress === null ? 1 : Math.min(Math.max(r.progress, 0), 1);
        const colour = barColour(r);
        return (
          <g key={r.range_id}>
            {(!compact || i % 16 === 0) && (
              <text x={left - 8} y={y + Math.max(barH, 9) - 1} textAnchor="end" style={{ fontSize: `${compact ? 10 : 12}px` }} fill={v("fg")}>
                range {r.range_id}
              </text>
            )}
            <rect x={left} y={y} width={plotW} height={barH} rx={compact ? 1 : 3} fill={r.lagging ? v("red.muted") : v("bg.emphasized")} />
            <rect
              className={"chart-bar" + (r.lagging ? " lagging" : "")}
              data-range={r.range_id}
              x={left}
              y={y}
              width={r.progress === null ? plotW : p * plotW}
              height={barH}
              rx={3}
              fill={colour}
              fillOpacity={r.progress === null ? 0.35 : 1}
            >
              <title>{`range ${r.range_id}: ${r.progress === null ? "n/a" : (100 * p).toFixed(1) + "%"} (${r.state}${r.lagging ? ", lagging" : ""})`}</title>
            </rect>
            {!compact && (
              <text x={left + plotW + 6} y={y + barH - 3} style={{ fontSize: "12px" }} fill={colour}>
                {r.progress === null ? `${r.items} items` : `${(100 * p).toFixed(1)}%`}
              </text>
            )}
          </g>
        );
      })}
    </svg>
  );
}
