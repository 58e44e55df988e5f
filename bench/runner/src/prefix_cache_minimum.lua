-- Bench only: the least a shared prefix-cache pick can make Redis do, the reference beside the
-- plugin's pick: read the chain's keys (MGET) and every count (HGETALL), take the holder of the
-- longest matched prefix when it is a candidate, else the least loaded candidate, +1 it (HINCRBY),
-- and write the chain's keys past the match (SET with a TTL). No lease, no record, no refresh of a
-- matched key's TTL, no load guard; its release is a plain HINCRBY -1, sent at top level.
-- KEYS[1]  the count hash   KEYS[2 ..]  the chain's keys, shortest prefix first
-- ARGV[1]  key TTL (s)   ARGV[2 ..]  the healthy hosts
local chain = {}
for i = 2, #KEYS do chain[i - 1] = KEYS[i] end
local holder, matched = nil, 0
local candidate = {}
for i = 2, #ARGV do candidate[ARGV[i]] = true end
if #chain > 0 then
  local vals = redis.call('MGET', unpack(chain))
  for i = 1, #chain do
    if not vals[i] then break end
    if candidate[vals[i]] then holder, matched = vals[i], i end
  end
end
local stored = redis.call('HGETALL', KEYS[1])
local counts = {}
for i = 1, #stored, 2 do counts[stored[i]] = stored[i + 1] end
local best = holder
if not best then
  local bestc = nil
  for i = 2, #ARGV do
    local c = tonumber(counts[ARGV[i]]) or 0
    if bestc == nil or c < bestc then best, bestc = ARGV[i], c end
  end
end
redis.call('HINCRBY', KEYS[1], best, 1)
for i = matched + 1, #chain do redis.call('SET', chain[i], best, 'EX', ARGV[1]) end
return best
