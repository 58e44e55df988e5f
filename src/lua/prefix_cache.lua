-- ai-load-balancer: prefix-cache pick, one round trip. Chain keys are computed by the plugin.
-- KEYS[1]  in-flight hash of this route+cluster (field host -> in-flight count)
-- KEYS[2]  time (s) of the last cleanup of hosts that left the cluster
-- KEYS[3]  this request's pick record (see least_request.lua)
-- KEYS[4 ..] prefix chain keys key_1 .. key_K (key_i = key_{i-1} XOR sha1(block_i)), value = host
-- ARGV[1]  now (s)   ARGV[2] cleanup interval (s, 0 = never)   ARGV[3] max in-flight (0 = no limit)
-- ARGV[4]  key TTL (s)   ARGV[5] hit load factor (0 = off)
-- ARGV[6]  N = number of healthy candidates
-- ARGV[7 .. 6+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- ARGV[7+N ..]    other hosts still in the cluster (kept by the cleanup)
-- Returns {host, in-flight after the pick, admitted 1|0, matched blocks}.
local inflight = KEYS[1]
if redis.call('EXISTS', KEYS[3]) == 1 then return {'', 0, 0, 0} end
local now = tonumber(ARGV[1]) or 0
local interval = tonumber(ARGV[2]) or 0
local maxc = tonumber(ARGV[3]) or 0
local ttl = tonumber(ARGV[4]) or 1800
local factor = tonumber(ARGV[5]) or 0
local n = tonumber(ARGV[6]) or 0
if interval > 0 then
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if now - last >= interval then
    local keep = {}
    for i = 7, #ARGV do keep[ARGV[i]] = true end
    for _, h in ipairs(redis.call('HKEYS', inflight)) do
      if not keep[h] then redis.call('HDEL', inflight, h) end
    end
    redis.call('SET', KEYS[2], now)
  end
end
if n < 1 then return {'', 0, 0, 0} end
local healthy = {}
for i = 7, 6 + n do healthy[ARGV[i]] = true end

-- Longest present prefix of the chain, then the longest part of it whose host is still healthy.
-- Keys past that point name a gone/unhealthy host: they are re-homed below (same key, new host),
-- so the chain stays aligned.
local nk = #KEYS - 3
local matched, target = 0, nil
if nk > 0 then
  local vals = redis.call('MGET', unpack(KEYS, 4, 3 + nk))
  local present = 0
  for i = 1, nk do
    if vals[i] then present = i else break end
  end
  for i = present, 1, -1 do
    if healthy[vals[i]] then matched, target = i, vals[i]; break end
  end
end

-- Least loaded healthy host (the miss path, and the load guard's reference).
local counts = redis.call('HMGET', inflight, unpack(ARGV, 7, 6 + n))
local least, leastc, targetc = nil, nil, 0
for i = 1, n do
  local h = ARGV[6 + i]
  local c = tonumber(counts[i]) or 0
  if c < 0 then redis.call('HSET', inflight, h, 0); c = 0 end
  if leastc == nil or c < leastc then least, leastc = h, c end
  if h == target then targetc = c end
end

local chosen = least
if target ~= nil then
  chosen = target
  -- Load guard (ours): a hot prefix must not pile every request onto one pod.
  if factor > 0 and targetc > factor * (leastc + 1) then chosen = least end
end

local after = redis.call('HINCRBY', inflight, chosen, 1)
if maxc > 0 and after > maxc then
  redis.call('HINCRBY', inflight, chosen, -1)
  if chosen == least then return {chosen, after, 0, matched} end
  chosen = least
  after = redis.call('HINCRBY', inflight, chosen, 1)
  if after > maxc then
    redis.call('HINCRBY', inflight, chosen, -1)
    return {chosen, after, 0, matched}
  end
end

-- Matched keys still name a healthy host that holds that prefix: refresh them. The rest of the
-- chain (new blocks, and keys that named a gone/unhealthy host) now belongs to the chosen host.
for i = 1, nk do
  local k = KEYS[3 + i]
  if i <= matched then
    redis.call('EXPIRE', k, ttl)
  else
    redis.call('SET', k, chosen, 'EX', ttl)
  end
end
redis.call('SET', KEYS[3], chosen, 'EX', 21600)
return {chosen, after, 1, matched}
