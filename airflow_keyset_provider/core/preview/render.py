"""A preview document (``RoundPreview.as_dict()``, as XCom holds it) in words: ``text_lines`` for
logs and the CLI, ``markdown`` for an approval's body (Airflow's ``ApprovalOperator`` renders
Markdown). Both read the dict, so any front end renders a preview it only has as JSON."""

from __future__ import annotations

from typing import Any

from ..keys import key_label

#: ranges listed one by one (the rest summed)
SHOWN_RANGES = 16


def duration(seconds: float | None) -> str:
    """``93.2`` -> ``1 min 33 s``; None -> ``unknown``."""
    if seconds is None:
        return "unknown"
    s = round(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h} h {m} min" if h else f"{m} min {sec} s"


def _eta_line(eta: dict[str, Any]) -> str:
    rate = eta.get("rows_per_second")
    budget = eta.get("max_rows_per_second")
    return (
        f"ETA {duration(eta.get('seconds'))} for ~{eta.get('estimated_rows', 0):,} rows at "
        f"{'?' if rate is None else f'{rate:,.0f}'} rows/s with {eta.get('workers')} task(s)"
        f"{'' if budget is None else f', governor budget {budget:,.0f} rows/s'}"
        f" (limited by the {eta.get('limited_by')})"
    )


def _processor_line(p: dict[str, Any]) -> str:
    if not p.get("ran"):
        return f"processor: not run ({p.get('why_not')})"
    if p.get("raised"):
        return f"processor: raised on the sample ({p['raised']}); rolled back"
    return (
        f"processor on {p['keys']} key(s), rolled back: {p['applied']} applied, "
        f"{p['not_applied']} not applied, {p['failed']} failed ({p['seconds']:.3f} s)"
    )


def text_lines(doc: dict[str, Any]) -> list[str]:
    """The preview in plain lines (no row data: keys, counts, the plan, reasons)."""
    out = [
        f"stream {doc['stream']}: round ({key_label(doc['start_key'])}, "
        f"{key_label(doc['end_key'])}] of {doc['table']} by {', '.join(doc['key'])}"
        + (f" (existing round {doc['existing_round']})" if doc.get("existing_round") else ""),
        f"~{doc['estimated_rows']:,} rows ({doc['row_estimate']} estimate) in "
        f"{len(doc['ranges'])} range(s):",
    ]
    for r in doc["ranges"][:SHOWN_RANGES]:
        out.append(
            f"  range {r['range_id']} ({key_label(r['lo'])}, {key_label(r['hi'])}]: "
            f"~{r['estimated_rows']:,} rows"
        )
    if len(doc["ranges"]) > SHOWN_RANGES:
        out.append(f"  ... and {len(doc['ranges']) - SHOWN_RANGES} more")
    plan = doc.get("chunk_plan")
    if plan:
        out.append(
            f"chunk query: {plan['scan']}"
            + (f" on index {plan['index']}" if plan.get("index") else "")
        )
        out += [f"  {line}" for line in plan.get("plan", [])]
    sample = doc.get("sample")
    if sample:
        out.append(
            f"sample: {sample['rows']} row(s) in {sample.get('chunks', 1)} chunk(s) of range "
            f"{sample['range_id']} "
            f"({key_label(sample['first_key'])} .. {key_label(sample['last_key'])}) "
            f"read in {sample['seconds']:.4f} s (chunk_size {doc['chunk_size']})"
        )
    out.append(_processor_line(doc["processor"]))
    for reason, n in doc["processor"].get("reasons", {}).items():
        out.append(f"  failed x{n}: {reason}")
    out.append(_eta_line(doc["eta"]))
    out += [f"PROBLEM: {p}" for p in doc.get("problems", [])]
    out += [f"note: {n}" for n in doc.get("notes", [])]
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The preview as Markdown, for a person who approves or rejects the round."""
    p = doc["processor"]
    lines = [
        f"**Stream `{doc['stream']}`**: round `({key_label(doc['start_key'])}, "
        f"{key_label(doc['end_key'])}]` of `{doc['table']}`"
        + (f" (existing round `{doc['existing_round']}`)" if doc.get("existing_round") else ""),
        "",
        f"- **Rows**: ~{doc['estimated_rows']:,} ({doc['row_estimate']} estimate) in "
        f"{len(doc['ranges'])} range(s)",
        f"- **{_eta_line(doc['eta'])}**",
    ]
    plan = doc.get("chunk_plan")
    if plan:
        lines.append(
            f"- **Chunk query**: {plan['scan']}"
            + (f" on index `{plan['index']}`" if plan.get("index") else "")
        )
    if p.get("ran") and not p.get("raised"):
        lines.append(
            f"- **Processor on a sample of {p['keys']} key(s)** (rolled back): "
            f"{p['applied']} applied, {p['not_applied']} not applied, {p['failed']} failed"
        )
        lines += [f"  - failed x{n}: `{reason}`" for reason, n in p.get("reasons", {}).items()]
    else:
        lines.append(f"- **Processor**: {_processor_line(p).split(': ', 1)[1]}")
    if doc.get("problems"):
        lines += ["", "**Problems**:"] + [f"- {x}" for x in doc["problems"]]
    if doc.get("notes"):
        lines += ["", "Notes:"] + [f"- {x}" for x in doc["notes"]]
    return "\n".join(lines)
