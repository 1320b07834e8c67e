
-- Move a key's value forward to a given value unless it already holds one at or above it: the
-- watermark (string order: the key encoding is order-preserving ASCII) or the round counter
-- (number order). Used by the failover reconciliation (core/rounds/regressions.py) and by a
-- restore from Airflow's records (core/rounds/durability.py); never moves a value back.
-- KEYS[1] the key (of one stream: its hash tag)  ARGV[1] value  ARGV[2] 'n' (numbers) or 's'.
-- Returns 1 if the value was moved, 0 if it already held one at or above it.
-- Safe to run twice: a maximum, never an increment.
local cur = redis.call('GET', KEYS[1])
if cur then
  if ARGV[2] == 'n' then
    if tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
  elseif cur >= ARGV[1] then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
