
-- Close a round if, and only if, every range is complete and the ranges cover (start, end]
-- with no gap and no overlap; then move the stream's watermark forward (never backwards), and
-- only over the contiguous completed prefix: a round that starts above the watermark is parked
-- in the "ahead" hash and absorbed once the rounds below it have closed; a rebase round (field
-- chained = '2') that closes while the stream has no watermark sets it to its end.
-- KEYS[1] round hash  KEYS[2] watermark  KEYS[3] open set  KEYS[4] chained id  KEYS[5] ahead hash
-- KEYS[6..] per range (ids 0..n-1): range hash, retry hash, dead list. Ranges are walked in key
-- order (sorted by lo), not by id: a split appends a range whose keys sit inside the old ones.
-- Returns {'lost'} (round missing or a range not intact) | {'unrecoverable', reason}
--       | {'gap', range id} (in key order, the first range whose lo is not the previous hi, or
--         that overlaps it; n_ranges: end not reached)
--       | {'incomplete', range ids...} | {'closed', done, skipped, dead, watermark}
--       (idempotent once closed: the stored totals and the current watermark, '' if none)
-- Safe to run twice: the second run finds the round closed and returns {'closed', ...} with the
-- totals the first stored and the watermark now (only ever moved forward); the refusals write
-- nothing.
--!include now.lua

--!include intact.lua
--!include fields.lua
--!include compact.lua

if redis.call('EXISTS', KEYS[1]) == 0 then return {'lost'} end
local rnd = redis.call('HMGET', KEYS[1], 'state', 'start', 'end', 'id', 'chained')
local wm = redis.call('GET', KEYS[2])
if rnd[1] == 'closed' then
  local t = redis.call('HMGET', KEYS[1], 'done', 'skipped', 'dead')
  return {'closed', t[1], t[2], t[3], wm or ''}
end
if rnd[1] == 'unrecoverable' then
  return {'unrecoverable', redis.call('HGET', KEYS[1], 'reason') or ''}
end
local expect = rnd[2]
local done, skipped, dead = 0, 0, 0
local lagging = {}
local n = (#KEYS - 5) / 3
local walk = {}
for j = 0, n - 1 do
  local rk = KEYS[6 + 3 * j]
  if not intact(rk, KEYS[7 + 3 * j], KEYS[8 + 3 * j]) then return {'lost'} end
  local r = fields(rk, 'lo', 'hi', 'cursor', 'state', 'done', 'skipped', 'dead')
  r.id = j
  table.insert(walk, r)
end
-- key order; equal lo: the empty range first (a range coalesced into its neighbour keeps
-- lo = hi = the neighbour's end), then by id, so the walk stops on an overlap deterministically
table.sort(walk, function(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] end
  if a[2] ~= b[2] then return a[2] < b[2] end
  return a.id < b.id
end)
for _, r in ipairs(walk) do
  if r[1] ~= expect or r[2] < r[1] then return {'gap', tostring(r.id)} end
  expect = r[2]
  if r[4] ~= 'complete' or r[3] ~= r[2] then table.insert(lagging, tostring(r.id)) end
  done, skipped, dead = done + tonumber(r[5]), skipped + tonumber(r[6]), dead + tonumber(r[7])
end
if expect ~= rnd[3] then return {'gap', tostring(n)} end
table.sort(lagging, function(a, b) return tonumber(a) < tonumber(b) end)
if #lagging > 0 then return {'incomplete', unpack(lagging)} end
redis.call('HSET', KEYS[1], 'state', 'closed', 'closed_ms', now, 'done', done,
  'skipped', skipped, 'dead', dead)
redis.call('SREM', KEYS[3], rnd[4])
if redis.call('GET', KEYS[4]) == rnd[4] then redis.call('DEL', KEYS[4]) end
local function reaches(start) return (wm == false and start == '') or (wm and start <= wm) end
-- chained '2': an explicit round planned when Redis had no state of the stream (the re-plan a
-- loss's refusal names); with still no watermark it becomes the stream's base, as a chained one
if (rnd[5] == '1') or (rnd[5] == '2' and wm == false) or reaches(rnd[2]) then
  if wm == false or rnd[3] > wm then wm = rnd[3] end
  -- absorb parked rounds that now touch the prefix, until none does
  local moved = true
  while moved do
    moved = false
    local ahead = redis.call('HGETALL', KEYS[5])
    for j = 1, #ahead, 2 do
      local s, e = string.match(ahead[j + 1], '^([^|]*)|(.*)$')
      if reaches(s) then
        if e > wm then wm = e; moved = true end
        redis.call('HDEL', KEYS[5], ahead[j])
      end
    end
  end
  redis.call('SET', KEYS[2], wm)
else
  redis.call('HSET', KEYS[5], rnd[4], rnd[2] .. '|' .. rnd[3])
end
return {'closed', done, skipped, dead, wm or ''}
