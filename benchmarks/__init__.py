"""Benchmark suite of issue 5: the engine against the hand-written loop and the physical limit.

``python -m benchmarks`` (``make bench``) creates its tables in PostgreSQL (schema ``kbench``,
reused while the row count matches), runs every baseline and the project in the same run,
interleaving their repetitions, and prints ``metric | project | baseline | ratio | target | met``;
the same rows go to ``benchmarks/results/<timestamp>.json``. See docs/performance.md.

Nothing here asserts an absolute time: every verdict is a ratio against a baseline measured in
the same run (or a size/byte budget stated by the issue).
"""
