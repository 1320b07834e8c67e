"""One range's run, and pull mode: how a task turns a claimed range into committed progress.

Owns the claim (``claim``), the chunk loop (``range_run``), the fenced commits and the mirror
checkpoints they carry (``commits``), the owner's split of a straggler (``split``), the item
failures and retry passes (``item_failures``), the heartbeat and committed state (``state``), the
watchdog for a dead supervisor (``supervision``) and the loop that pulls range after range
(``pull``). Everything a run needs arrives in one ``RunContext`` (``context``), built by the facade
(``core.traversal``); nothing here imports the facade. May use ``core.store``, ``core.sql``,
``core.pace``, ``core.rounds`` and the shared vocabulary.
"""
