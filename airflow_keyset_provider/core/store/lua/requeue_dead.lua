
-- Move dead letters back into the range's retry set (attempts reset) so a normal, fenced
-- traverse processes them again; the range is no longer complete until they reach a terminal
-- state. Refused while a live owner holds the range.
-- KEYS[1] range hash  KEYS[2] dead list  KEYS[3] retry hash   ARGV[1] max letters to move
-- ARGV[2] call id (unique per call, '' = none)
-- Returns {'lost'} (range not intact) | {'held', owner} | {'ok', moved, {letter, ...}}: the
-- letters moved, as they were (JSON), so a replay that fails can put them back (restore_dead.lua).
-- Safe to run twice: an 'ok' that moved letters writes 'call' = '<call id>|<moved>' in the range hash, so its second
-- run moves nothing more (not another ARGV[1] letters) and returns {'ok', moved} again (without
-- the letters: the first run's reply had them).
--!include now.lua

--!include intact.lua
--!include fields.lua
--!include compact.lua

if not intact(KEYS[1], KEYS[3], KEYS[2]) then return {'lost'} end
local call = ARGV[2] or ''
if call ~= '' then
  local seen = redis.call('HGET', KEYS[1], 'call') or ''
  local head = call .. '|'
  if string.sub(seen, 1, #head) == head then return {'ok', tonumber(string.sub(seen, #head + 1))} end
end
local r = fields(KEYS[1], 'owner', 'lease_until', 'state', 'cursor')
if r[1] ~= '' and tonumber(r[2]) > now then return {'held', r[1]} end
local moved = 0
local letters = {}
for _ = 1, tonumber(ARGV[1]) do
  local raw = redis.call('RPOP', KEYS[2])
  if not raw then break end
  local d = cjson.decode(raw)
  redis.call('HSET', KEYS[3], d.key, '0|replay of: ' .. d.error)
  moved = moved + 1
  letters[moved] = raw
end
if moved > 0 then
  redis.call('HINCRBY', KEYS[1], 'dead', -moved)
  redis.call('HSET', KEYS[1], 'retries', redis.call('HLEN', KEYS[3]))
  if r[3] == 'complete' then redis.call('HSET', KEYS[1], 'state', 'pending', 'cursor', r[4]) end
end
if call ~= '' and moved > 0 then redis.call('HSET', KEYS[1], 'call', call .. '|' .. moved) end
return {'ok', moved, letters}
