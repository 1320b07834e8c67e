"""Coalescing in the split property test: what the model predicts a claim absorbs, and the
checks of the store's answer against it (``split_sim.Sim.claim`` calls them).

The prediction reads the model only, never Redis: a claim of range ``h`` with ``coalesce=m``
absorbs ``h+1, h+2, ...`` (at most ``m``) while each exists, is fresh in the model (never
claimed, nothing committed, not complete, no retries or dead letters) and starts where ``h``
ends by then (its ``lo`` is the host's ``hi``, which grows with each absorbed range); it stops at
the first that is not. The round is open the whole trial (it closes only at the end), so every
accepted claim coalesces. Each absorbed range is then empty and complete at the host's new
``hi``, ``merged_into`` the host, 0 done.
"""

from __future__ import annotations

import random
from typing import Any

from split_model import Attempt, KeySpace, ModelRange, fail

from airflow_keyset_provider.core.store.cursor_store import CursorStore

enc = KeySpace.enc


def pick_coalesce(rng: random.Random) -> int:
    """The ``coalesce`` of one claim: mostly 0, often a few, sometimes more than any run."""
    r = rng.random()
    if r < 0.5:
        return 0
    if r < 0.85:
        return rng.randint(1, 5)
    return rng.randint(6, 40)


def predict_absorbed(model: dict[int, ModelRange], rid: int, m: int) -> list[int]:
    """The ids a claim of ``rid`` with ``coalesce=m`` absorbs, by the model alone."""
    hi, out = model[rid].hi, []
    for j in range(rid + 1, rid + 1 + max(m, 0)):
        r = model.get(j)
        if r is None or not r.fresh or r.lo != hi:
            break
        out.append(j)
        hi = r.hi
    return out


def absorb(model: dict[int, ModelRange], rid: int, ids: list[int]) -> None:
    """The model after the claim of ``rid`` absorbed ``ids``: the host ends where the last
    ended, each absorbed range is empty and complete there."""
    if not ids:
        return
    new_hi = model[ids[-1]].hi
    model[rid].hi = new_hi
    for j in ids:
        model[j] = ModelRange(new_hi, new_hi, new_hi, merged_into=rid)


def check_absorbed(
    seed: int, store: CursorStore, round_id: str, rid: int, ids: list[int], res: Any, host_hi: int
) -> None:
    """The claim's answer and the store's ranges against the model's prediction (``host_hi``:
    the host's hi in the model after the claim)."""
    if res.absorbed != len(ids):
        fail(seed, f"claim of {rid} absorbed {res.absorbed} range(s), the model predicts {ids}")
    host = store.range(round_id, rid)
    if res.hi != enc(host_hi) or host["hi"] != enc(host_hi):
        fail(
            seed,
            f"claim of {rid} absorbing {ids}: the claim says hi {res.hi!r}, Redis "
            f"{host['hi']!r}, the model {enc(host_hi)!r}",
        )
    for j in ids:
        r = store.range(round_id, j)
        got = (r["state"], r["lo"], r["hi"], r["cursor"], r.get("merged_into"), r["done"])
        want = ("complete", enc(host_hi), enc(host_hi), enc(host_hi), str(rid), "0")
        if got != want:
            fail(seed, f"range {j} coalesced into {rid} reads {r}, the model wants {want}")


def check_held_by(seed: int, store: CursorStore, round_id: str, a: Attempt, rid: int) -> None:
    """A pulling claim records the range as its lineage's (``held_by``)."""
    held = store.held_by(round_id, a.lineage)
    if held != rid:
        fail(seed, f"pull claim of {rid} by {a.lineage}: held_by says {held}")


def check_hint(seed: int, model: dict[int, ModelRange], rid: int | None) -> None:
    """``next_unclaimed`` jumps over coalesced runs: it never hands out an absorbed id."""
    if rid is not None and model[rid].merged_into is not None:
        fail(seed, f"next_unclaimed handed out {rid}, coalesced into {model[rid].merged_into}")


def check_open_briefs(
    seed: int, model: dict[int, ModelRange], a: Attempt, briefs: list[Any]
) -> None:
    """``open_briefs(known_complete=...)``: every id it takes as known complete (found complete
    or coalesced, by the round's skip fields) is complete in the model, and it returns exactly
    the ranges the model has open."""
    wrong = sorted(i for i in a.known if not model[i].complete)
    if wrong:
        fail(seed, f"open_briefs took {wrong} as complete, the model has {model[wrong[0]]}")
    got = sorted(b.range_id for b in briefs)
    want = sorted(i for i, m in model.items() if not m.complete)
    if got != want:
        fail(seed, f"open_briefs returned {got}, the model has {want} open")
