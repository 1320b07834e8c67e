"""The engine's tests, one folder per room of ``core/`` (``run``, ``store``, ``sql``, ``pace``,
``rounds``, ``writeback``) and the shared vocabulary and the facade here. Their helpers
(``core_support``, ``supervised_worker``) live here: pytest puts this folder on ``sys.path`` when it
loads this file, so every test below imports them by name."""
