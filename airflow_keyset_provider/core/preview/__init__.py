"""The preview: what a round would be and do, seen before anything of it is written.

Owns the read-only rehearsal of a plan and of its first chunk (``rehearsal``): the bounds the plan
would fix and its ranges with the database's row estimates, the chunk query's plan (``EXPLAIN``),
a sample chunk read and timed, the processor run on it inside a target transaction that is always
rolled back (``trial``), and the round's ETA from the sample's rate and the stream's governor
budget (``eta``); the report every front end shows (``report``). Writes nothing: not to the source,
not to the target (rolled back), not to Redis (reads only). May use ``core.sql``, ``core.store``
(its reads), ``core.pace``, ``core.rounds`` and the shared vocabulary; nothing imports it but the
facade (``core.traversal``).
"""

from .report import Eta, ProcessorTrial, RangeEstimate, RoundPreview, SampleRead

__all__ = ["Eta", "ProcessorTrial", "RangeEstimate", "RoundPreview", "SampleRead"]
