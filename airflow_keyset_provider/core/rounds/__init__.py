"""The round level: planning a round, reading and closing it, one status model, the mirror.

Owns the balanced cut of ``(start, end]`` into ranges (``planner``), the operations on rounds that
need Redis but not the source (``control``: the barrier, the CLI and the page use it), the status
model every front end reads (``status``, with key-space ``progress``) and the durable checkpoint
mirror in the source database (``mirror``). May use ``core.store`` and the shared vocabulary.
"""
