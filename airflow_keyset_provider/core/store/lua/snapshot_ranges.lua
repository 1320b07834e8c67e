
-- An atomic read of ranges for the mirror and the status readers (a batch of ranges per call,
-- ``reads.READ_BATCH``): each range hash, its retry hash (entries, or only its size) and
-- its dead list (letters, or only its length).
-- KEYS per range: range hash, retry hash, dead list   ARGV[1] '1' = entries, '0' = sizes only
-- Returns per range {hash as a flat list, retry (flat list or size), dead (list or length)}.
-- Read-only: safe to run twice.
local out = {}
for j = 1, #KEYS, 3 do
  if ARGV[1] == '1' then
    table.insert(out, {redis.call('HGETALL', KEYS[j]), redis.call('HGETALL', KEYS[j + 1]),
      redis.call('LRANGE', KEYS[j + 2], 0, -1)})
  else
    table.insert(out, {redis.call('HGETALL', KEYS[j]), redis.call('HLEN', KEYS[j + 1]),
      redis.call('LLEN', KEYS[j + 2])})
  end
end
return out
