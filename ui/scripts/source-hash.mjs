// The SHA-256 of the sources the bundle is built from, written next to the bundle (--write, run by
// `npm run build`) or compared with it (--check). tests/ui/test_ui_bundle.py computes the same hash
// in Python, so a change to ui/ without `make ui` fails the tests without needing Node.
import { createHash } from "node:crypto";
import { readFileSync, readdirSync, writeFileSync } from "node:fs";
import { join, relative, resolve } from "node:path";

const UI = resolve(import.meta.dirname, "..");
const OUT = resolve(UI, "../airflow_keyset_provider/plugins/static/ui/SOURCE_SHA256");
const TOP = ["package.json", "package-lock.json", "vite.config.js", "scripts/source-hash.mjs"];

function walk(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? walk(join(dir, e.name)) : [join(dir, e.name)],
  );
}

export function sourceHash() {
  const files = [...TOP.map((f) => join(UI, f)), ...walk(join(UI, "src"))]
    .map((f) => relative(UI, f).split("\\").join("/"))
    .sort();
  const h = createHash("sha256");
  for (const f of files) {
    h.update(f + "\0");
    h.update(readFileSync(join(UI, f)));
    h.update("\0");
  }
  return h.digest("hex");
}

const digest = sourceHash();
if (process.argv.includes("--write")) {
  writeFileSync(OUT, digest + "\n");
} else if (process.argv.includes("--check")) {
  const recorded = readFileSync(OUT, "utf8").trim();
  if (recorded !== digest) {
    console.error(`bundle out of date: sources ${digest}, bundle built from ${recorded}; run make ui`);
    process.exit(1);
  }
}
console.log(digest);
