
-- Create a round and its ranges, or return the round that already answers this request.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash
-- KEYS[5..] one range hash per range, in range order
-- ARGV[1] round id  ARGV[2] idempotency key ('' = none)  ARGV[3] chained ('1'/'0'; '2': explicit, a rebase: close_round.lua)
-- ARGV[4] start  ARGV[5] end  ARGV[6] source fingerprint  ARGV[7] key arity
-- ARGV[8] call id (unique per call, '' = none)  ARGV[9..] lo, hi per range
-- Returns {'existing', id} when the idempotency key or the open chained round already has a
-- round (nothing written), {'taken'} when a round or range hash of this id already exists (the
-- round counter was lost and handed out a used id: nothing written, the caller re-derives the
-- counter), else {'created', id}.
-- Safe to run twice (redis-py sends it again when the reply is lost): the round hash keeps the
-- call id ('create_call'), so a second run of the call that created the round writes nothing
-- and returns {'created', id} again. Without it, the second run of an explicit plan (no
-- idempotency key, not chained) read its own round as 'taken', and the caller created another
-- round while the first stayed open for ever; with an idempotency key it read 'existing' and
-- the caller skipped mirroring the round it had just created.
--!include now.lua

if ARGV[8] ~= '' and redis.call('HGET', KEYS[1], 'create_call') == ARGV[8] then
  return {'created', ARGV[1]}
end
if ARGV[2] ~= '' then
  local known = redis.call('HGET', KEYS[4], ARGV[2])
  if known then return {'existing', known} end
end
if ARGV[3] == '1' then
  local open = redis.call('GET', KEYS[3])
  if open then
    if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[2], open) end
    return {'existing', open}
  end
end
local n = #KEYS - 4
for i = 1, n + 1 do
  local k = KEYS[1]
  if i > 1 then k = KEYS[3 + i] end
  if redis.call('EXISTS', k) == 1 then return {'taken'} end
end
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'state', 'open', 'chained', ARGV[3],
  'start', ARGV[4], 'end', ARGV[5], 'source', ARGV[6], 'arity', ARGV[7],
  'n_ranges', n, 'round_key', ARGV[2], 'created_ms', now, 'create_call', ARGV[8])
for i = 1, n do
  local lo, hi = ARGV[7 + 2 * i], ARGV[8 + 2 * i]
  local state = 'pending'
  if lo == hi then state = 'complete' end
  redis.call('HSET', KEYS[4 + i], 'lo', lo, 'hi', hi, 'cursor', lo, 'state', state,
    'dead', 0, 'retries', 0)
end
redis.call('SADD', KEYS[2], ARGV[1])
if ARGV[3] == '1' then redis.call('SET', KEYS[3], ARGV[1]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[4], ARGV[2], ARGV[1]) end
return {'created', ARGV[1]}
