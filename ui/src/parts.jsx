// Small pieces every table uses: one-line clipped text with its full value as a tooltip, state
// badges and progress bars, all in Chakra's semantic tokens (so they follow Airflow's light and
// dark mode).
import { Badge, Box, Text } from "@chakra-ui/react";
import { fmtPct } from "./format.js";

/** Text on one line, cut with an ellipsis at `maxW`; the whole text is the `title` tooltip. */
export function Clip({ text, maxW = "16em", mono = true, className }) {
  return (
    <Text
      as="span"
      className={"keyset-clip " + (className || "")}
      display="inline-block"
      maxW={maxW}
      overflow="hidden"
      textOverflow="ellipsis"
      whiteSpace="nowrap"
      verticalAlign="bottom"
      fontFamily={mono ? "mono" : undefined}
      fontSize={mono ? "xs" : undefined}
      title={text}
    >
      {text}
    </Text>
  );
}

const PALETTE = {
  open: "blue",
  running: "blue",
  closed: "green",
  complete: "green",
  healthy: "green",
  pending: "gray",
  lagging: "red",
  dead: "red",
  paused: "red",
  unhealthy: "red",
  unrecoverable: "red",
  throttled: "orange",
};

export function StateBadge({ state, children, ...rest }) {
  return (
    <Badge colorPalette={PALETTE[state] || "gray"} variant="solid" size="sm" {...rest}>
      {children ?? state}
    </Badge>
  );
}

/** A bar of `p` (0..1); hatched when there is no key-space position (p null). */
export function ProgressBar({ p, tone = "blue", width = "64px" }) {
  const known = p !== null && p !== undefined;
  return (
    <Box
      as="span"
      display="inline-block"
      verticalAlign="middle"
      position="relative"
      w={width}
      h="10px"
      borderRadius="full"
      overflow="hidden"
      bg="bg.emphasized"
      title={fmtPct(p)}
      className={"keyset-bar" + (known ? "" : " unknown")}
    >
      {known && (
        <Box
          position="absolute"
          left="0"
          top="0"
          bottom="0"
          bg={`${tone}.solid`}
          style={{ width: `${(100 * Math.min(Math.max(p, 0), 1)).toFixed(1)}%` }}
        />
      )}
    </Box>
  );
}

/** A table's own horizontal scroll container: the page never scrolls sideways, a table wider
 * than its panel scrolls inside it. */
export function ScrollX({ children, ...rest }) {
  return (
    <Box className="keyset-scroll" overflowX="auto" maxW="100%" {...rest}>
      {children}
    </Box>
  );
}
