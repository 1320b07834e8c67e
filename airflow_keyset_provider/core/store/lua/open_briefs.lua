
-- The fields a pulling task reads of each range of one batch that is not complete (it never
-- claims, rescues or splits a complete one), so its polls at a round's end return what is left,
-- not every range. KEYS range hashes  ARGV[1] lineage ('' = any; else only the ranges whose
-- 'lineage' is this one: what a retry resumes)  ARGV[2] F  ARGV[3..F+2] field names
-- ARGV[F+3..] the range id of each key, in order
-- Returns {'lost', id} (a range has no state) | {'ok', now, id, values..., id, values..., ...}
-- (missing fields as '').
-- Read-only: safe to run twice.
--!include now.lua

local f = tonumber(ARGV[2])
local names = {}
for j = 3, f + 2 do names[#names + 1] = ARGV[j] end
local out = {'ok', now}
for k = 1, #KEYS do
  local v = redis.call('HMGET', KEYS[k], 'lo', 'hi', 'state', 'lineage', unpack(names))
  if not v[1] and not v[2] then return {'lost', ARGV[f + 2 + k]} end
  if v[3] ~= 'complete' and (ARGV[1] == '' or v[4] == ARGV[1]) then
    out[#out + 1] = ARGV[f + 2 + k]
    for j = 5, #v do out[#out + 1] = v[j] or '' end
  end
end
return out
