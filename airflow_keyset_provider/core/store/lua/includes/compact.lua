-- compact(key): write a complete range's hash anew without its owner's fields (RELEASE and
-- CLAIM, layout.py): DROP always goes, DROP_ZERO goes when it is 0. Written anew because a hash
-- that once held a long value keeps Redis's large encoding when fields are only deleted.

local DROP = {owner = '1', lineage = '1', lease_until = '1', heartbeat_ms = '1', cursor = '1', epoch = '1', claimed_ms = '1', split_req = '1', split_req_ms = '1', split_req_call = '1', call = '1', split_answer = '1', split_from = '1', created_ms = '1'}
local DROP_ZERO = {done = '1', skipped = '1', takeovers = '1', chunks = '1'}
local function compact(key)
  local h = redis.call('HGETALL', key)
  local keep = {}
  for i = 1, #h, 2 do
    if not DROP[h[i]] and not (DROP_ZERO[h[i]] and h[i + 1] == '0') then
      table.insert(keep, h[i])
      table.insert(keep, h[i + 1])
    end
  end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(keep))
end
