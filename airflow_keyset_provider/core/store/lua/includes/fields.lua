-- fields(key, name, ...): the named fields of a range hash, defaults filled in (one HMGET).
-- Range fields at their default may be missing (layout.py); RANGE_DEFAULTS here must equal
-- layout.RANGE_DEFAULTS, the Python readers' (tests/core/store/test_store_scripts.py checks it). A
-- missing cursor is hi once the range is complete, else lo.

local RANGE_DEFAULTS = {owner = '', lineage = '', epoch = '0', lease_until = '0', heartbeat_ms = '0', claimed_ms = '0', completed_ms = '0', done = '0', skipped = '0', dead = '0', retries = '0', takeovers = '0', chunks = '0', state = 'pending'}
local function fields(key, ...)
  local names = {...}
  local r = redis.call('HMGET', key, 'state', 'lo', 'hi', unpack(names))
  local out = {}
  for i, name in ipairs(names) do
    local v = r[3 + i]
    if not v and name == 'cursor' then
      if r[1] == 'complete' then v = r[3] else v = r[2] end
    elseif not v then
      v = RANGE_DEFAULTS[name]
    end
    out[i] = v
  end
  return out
end
