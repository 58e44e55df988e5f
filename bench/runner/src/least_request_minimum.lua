-- Bench only: the least a shared least-request pick can make Redis do, the reference beside the
-- plugin's pick: read every count (HGETALL), +1 the least loaded candidate (HINCRBY). No lease, no
-- record, so no exactly-once release and no recovery from a dead gateway; its release is a plain
-- HINCRBY -1, sent at top level.
-- KEYS[1]  the count hash   ARGV  the healthy hosts
local stored = redis.call('HGETALL', KEYS[1])
local counts = {}
for i = 1, #stored, 2 do counts[stored[i]] = stored[i + 1] end
local best, bestc = nil, nil
for i = 1, #ARGV do
  local c = tonumber(counts[ARGV[i]]) or 0
  if bestc == nil or c < bestc then best, bestc = ARGV[i], c end
end
redis.call('HINCRBY', KEYS[1], best, 1)
return best
