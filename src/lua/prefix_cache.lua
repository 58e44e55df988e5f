-- ai-load-balancer: prefix-cache pick, one round trip (after lease.lua). Chain values are
-- computed by the plugin; their keys are `<base>pfx:<hex>`.
-- ARGV[5]  key TTL (s)   ARGV[6] hit load factor (0 = off)
-- ARGV[7]  K = number of chain values (key_i = key_{i-1} XOR sha1(block_i)), value = host
-- ARGV[8 .. 7+K]  the chain values, upper-case hex, shortest prefix first
-- ARGV[8+K]  N = number of healthy candidates
-- ARGV[9+K .. 8+K+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- Returns {host, in-flight after the pick, admitted 1|0, matched blocks, diverted 1|0} (diverted:
-- a prefix was found but its pod was too loaded, so the least loaded pod was chosen instead).
local ttl = tonumber(ARGV[5]) or 1800
local factor = tonumber(ARGV[6]) or 0
local nk = tonumber(ARGV[7]) or 0
local chain = {}
for i = 1, nk do chain[i] = base .. 'pfx:' .. ARGV[7 + i] end
local first = 9 + nk
local n = tonumber(ARGV[8 + nk]) or 0
if n < 1 then return {'', 0, 0, 0, 0} end
local healthy = {}
for i = first, first + n - 1 do healthy[ARGV[i]] = true end

-- Longest present prefix of the chain, then the longest part of it whose host is still healthy.
-- Keys past that point name a gone/unhealthy host: they are re-homed below (same key, new host),
-- so the chain stays aligned.
local matched, target = 0, nil
if nk > 0 then
  local vals = redis.call('MGET', unpack(chain))
  local present = 0
  for i = 1, nk do
    if vals[i] then present = i else break end
  end
  for i = present, 1, -1 do
    if healthy[vals[i]] then matched, target = i, vals[i]; break end
  end
end

-- Least loaded healthy host (the miss path, and the load guard's reference).
local counts = redis.call('HMGET', inflight, unpack(ARGV, first, first + n - 1))
local least, leastc, targetc = nil, nil, 0
for i = 1, n do
  local h = ARGV[first - 1 + i]
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
local function diverted() if target ~= nil and chosen ~= target then return 1 end return 0 end

if not admit(chosen) then return {'', 0, 0, 0, 0} end
local after = take(chosen)
if maxc > 0 and after > maxc then
  untake(chosen)
  if chosen == least then
    unadmit()
    return {chosen, after, 0, matched, diverted()}
  end
  chosen = least
  after = take(chosen)
  if after > maxc then
    untake(chosen)
    unadmit()
    return {chosen, after, 0, matched, diverted()}
  end
  redis.call('HSET', mine, rec, chosen)
end

-- Matched keys still name a healthy host that holds that prefix: refresh them. The rest of the
-- chain (new blocks, and keys that named a gone/unhealthy host) now belongs to the chosen host.
for i = 1, nk do
  local k = chain[i]
  if i <= matched then
    redis.call('EXPIRE', k, ttl)
  else
    redis.call('SET', k, chosen, 'EX', ttl)
  end
end
return {chosen, after, 1, matched, diverted()}
