
-- Recompute a round's done/skipped/dead totals from its ranges (after a dead-letter replay).
-- KEYS[1] round hash  KEYS[2..] range hashes
-- Returns {done, skipped, dead}, or {} when the round or a range is missing (nothing written).
-- Safe to run twice: the totals are recomputed from the ranges, not added to.
--!include fields.lua
--!include compact.lua

if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local done, skipped, dead = 0, 0, 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {} end
  local r = fields(KEYS[i], 'done', 'skipped', 'dead')
  done, skipped, dead = done + tonumber(r[1]), skipped + tonumber(r[2]), dead + tonumber(r[3])
end
redis.call('HSET', KEYS[1], 'done', done, 'skipped', skipped, 'dead', dead)
return {done, skipped, dead}
