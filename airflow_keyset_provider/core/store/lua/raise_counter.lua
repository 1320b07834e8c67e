
-- Move the round counter up to at least a value (after it was lost); never down.
-- KEYS[1] seq  ARGV[1] value.  Returns the counter.
-- Safe to run twice: a maximum, never an increment.
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if want > cur then
  redis.call('SET', KEYS[1], want)
  return want
end
return cur
