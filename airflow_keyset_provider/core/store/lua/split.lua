
-- The owner splits its range at a chunk boundary: (lo, hi] becomes (lo, at] and a new range
-- (at, hi], pending and unowned, is appended to the round; or it declines the pending request.
-- The owner passes an ``at`` above every key it has read (prefetch included); the script
-- refuses one that is not strictly between the committed cursor and hi, so no committed key,
-- retry or dead letter (all <= cursor) changes range, and the ranges still partition the round.
-- KEYS[1] round hash  KEYS[2] range hash  KEYS[3] retry hash  KEYS[4] dead list
-- KEYS[5] new range hash  KEYS[6] new retry hash  KEYS[7] new dead list  KEYS[8] events channel
-- ARGV[1] owner token  ARGV[2] at ('' = decline the request)  ARGV[3] new range id (= n_ranges
-- as the caller read it)  ARGV[4] this range's id  ARGV[5] call id (unique per call, '' = none)
-- ARGV[6] '1' = the caller keeps a checkpoint mirror: the range is marked
-- 'unmirrored_split:<new id>' = '<at> <old hi>' until the mirror has recorded the split
-- (``mirrored_split``); until then each mirror record of the range carries it
-- Returns {'lost'} | {'not_owner', owner} | {'expired'} | {'closed'} (round not open)
--       | {'declined'} | {'moved', n_ranges} (another split took that id: read n again)
--       | {'bad_key', cursor, hi} | {'taken'} (the new range's keys exist) | {'ok', new id}
-- Safe to run twice: a split writes 'call' = '<call id>|<new id>' in the range hash, so its
-- second run writes nothing and returns {'ok', new id} again (not 'moved' then 'bad_key', which
-- would leave the owner reading keys of the new range). A decline only clears the request and
-- records the answer 'no': its second run finds no request and declines again.
--!include now.lua

--!include intact.lua

if redis.call('EXISTS', KEYS[1]) == 0 or not intact(KEYS[2], KEYS[3], KEYS[4]) then
  return {'lost'}
end
local call = ARGV[5] or ''
local r = redis.call('HMGET', KEYS[2], 'owner', 'lease_until', 'cursor', 'hi', 'split_req', 'call')
if call ~= '' and r[1] == ARGV[1] then
  local head = call .. '|'
  if string.sub(r[6] or '', 1, #head) == head then return {'ok', string.sub(r[6], #head + 1)} end
end
if r[1] ~= ARGV[1] then return {'not_owner', r[1] or ''} end
if tonumber(r[2]) <= now then return {'expired'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'n_ranges')
if rnd[1] ~= 'open' then return {'closed'} end
local asked = r[5] or ''
local at = ARGV[2]
if at == '' then
  if asked ~= '' then redis.call('HSET', KEYS[2], 'split_req', '', 'split_answer', asked .. '|no') end
  return {'declined'}
end
if rnd[2] ~= ARGV[3] then return {'moved', rnd[2]} end
if not (at > r[3] and at < r[4]) then return {'bad_key', r[3], r[4]} end
if redis.call('EXISTS', KEYS[5], KEYS[6], KEYS[7]) > 0 then return {'taken'} end
redis.call('HSET', KEYS[5], 'lo', at, 'hi', r[4], 'cursor', at, 'state', 'pending',
  'dead', 0, 'retries', 0, 'split_from', ARGV[4], 'created_ms', now)
local answer = ''
if asked ~= '' then answer = asked .. '|' .. ARGV[3] end
redis.call('HSET', KEYS[2], 'hi', at, 'split_req', '', 'split_answer', answer)
if ARGV[6] == '1' then redis.call('HSET', KEYS[2], 'unmirrored_split:' .. ARGV[3], at .. ' ' .. r[4]) end
if call ~= '' then redis.call('HSET', KEYS[2], 'call', call .. '|' .. ARGV[3]) end
redis.call('HSET', KEYS[1], 'n_ranges', tonumber(ARGV[3]) + 1)
redis.call('HINCRBY', KEYS[1], 'splits', 1)
redis.call('PUBLISH', KEYS[8], ARGV[4] .. ':split:' .. ARGV[3])
return {'ok', ARGV[3]}
