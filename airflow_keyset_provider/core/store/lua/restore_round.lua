
-- Rebuild what Redis lost of a round from its durable mirror, never overwriting intact state:
-- the whole round when its hash is gone, else only the ranges that are not intact (a range hash,
-- retry hash or dead list evicted or deleted on its own); an intact range is left as it is.
-- KEYS[1] round hash  KEYS[2] open set  KEYS[3] chained id  KEYS[4] by_key hash  KEYS[5] seq
-- then per range: range hash, retry hash, dead list
-- ARGV[1] call id (unique per call, '' = none)  ARGV[2] round info (JSON)
-- ARGV[3..] one JSON document per range (all values strings)
-- Owners of rewritten ranges are cleared (every old token is fenced out); running -> pending;
-- 'merged_into' (a range coalesced into another at claim time) is kept.
-- Returns {round rewritten 0/1, ranges rewritten}; {0, 0} means nothing was written.
-- Safe to run twice: a restore that wrote anything keeps 'restore_call' = '<call id>|<round
-- rewritten>|<ranges rewritten>' in the round hash, so its second run writes nothing and
-- returns the same counts (not {0, 0}, which would read as "the mirror could not help").

--!include intact.lua

local call = ARGV[1]
if call ~= '' then
  local seen = redis.call('HGET', KEYS[1], 'restore_call') or ''
  local w, n = string.match(seen, '^' .. call .. '|(%d)|(%d+)$')
  if w then return {tonumber(w), tonumber(n)} end
end
local whole = redis.call('EXISTS', KEYS[1]) == 0
local info = cjson.decode(ARGV[2])
if whole then
  for k, v in pairs(info) do redis.call('HSET', KEYS[1], k, v) end
  if info.state ~= 'closed' then
    redis.call('SADD', KEYS[2], info.id)
    if info.chained == '1' then redis.call('SET', KEYS[3], info.id) end
  end
  if info.round_key and info.round_key ~= '' then
    redis.call('HSET', KEYS[4], info.round_key, info.id)
  end
  local num = tonumber(string.sub(info.id, 2))
  if num and num > tonumber(redis.call('GET', KEYS[5]) or '0') then
    redis.call('SET', KEYS[5], num)
  end
end
local rewritten = 0
for i = 1, #ARGV - 2 do
  local rk, tk, dk = KEYS[3 + 3 * i], KEYS[4 + 3 * i], KEYS[5 + 3 * i]
  if whole or not intact(rk, tk, dk) then
    local d = cjson.decode(ARGV[i + 2])
    local state = d.state
    if state == 'running' then state = 'pending' end
    redis.call('DEL', rk, tk, dk)
    local retries = 0
    for key, v in pairs(d.retry) do
      redis.call('HSET', tk, key, v)
      retries = retries + 1
    end
    for _, letter in ipairs(d.dead_letters) do redis.call('RPUSH', dk, letter) end
    redis.call('HSET', rk, 'lo', d.lo, 'hi', d.hi, 'cursor', d.cursor, 'state', state, 'owner', '',
      'lineage', '', 'epoch', d.epoch, 'lease_until', 0, 'heartbeat_ms', 0, 'done', d.done,
      'skipped', d.skipped, 'dead', d.dead, 'takeovers', d.takeovers, 'chunks', d.chunks,
      'retries', retries, 'restored', 1)
    -- a range coalesced into another (empty, complete) stays marked as such
    if d.merged_into and d.merged_into ~= '' then
      redis.call('HSET', rk, 'merged_into', d.merged_into)
    end
    rewritten = rewritten + 1
  end
end
local w = 0
if whole then w = 1 end
if call ~= '' and (w == 1 or rewritten > 0) then
  redis.call('HSET', KEYS[1], 'restore_call', call .. '|' .. w .. '|' .. rewritten)
end
return {w, rewritten}
