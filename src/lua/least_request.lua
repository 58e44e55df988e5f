-- ai-load-balancer: global least request pick, one round trip.
-- KEYS[1]  in-flight hash of this route+cluster (field host -> in-flight count)
-- KEYS[2]  time (s) of the last cleanup of hosts that left the cluster
-- KEYS[3]  this request's pick record: written with the chosen host when admitted (release.lua
--          undoes the +1 from it); if it already exists, the plugin gave up on this pick: do nothing
-- ARGV[1]  now (s)   ARGV[2] cleanup interval (s, 0 = never)   ARGV[3] max in-flight (0 = no limit)
-- ARGV[4]  N = number of healthy candidates
-- ARGV[5 .. 4+N]  healthy hosts, shuffled by the plugin (first minimum wins => random among ties)
-- ARGV[5+N ..]    other hosts still in the cluster (unhealthy/degraded: kept by the cleanup)
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0 means the +1 was undone (429).
local inflight = KEYS[1]
if redis.call('EXISTS', KEYS[3]) == 1 then return {'', 0, 0} end
local now = tonumber(ARGV[1]) or 0
local interval = tonumber(ARGV[2]) or 0
local maxc = tonumber(ARGV[3]) or 0
local n = tonumber(ARGV[4]) or 0
if interval > 0 then
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if now - last >= interval then
    local keep = {}
    for i = 5, #ARGV do keep[ARGV[i]] = true end
    for _, h in ipairs(redis.call('HKEYS', inflight)) do
      if not keep[h] then redis.call('HDEL', inflight, h) end
    end
    redis.call('SET', KEYS[2], now)
  end
end
if n < 1 then return {'', 0, 0} end
local counts = redis.call('HMGET', inflight, unpack(ARGV, 5, 4 + n))
local best, bestc = nil, nil
for i = 1, n do
  local c = tonumber(counts[i]) or 0
  if c < 0 then
    -- a decrement outlived a cleanup: repair instead of favouring this host forever
    redis.call('HSET', inflight, ARGV[4 + i], 0)
    c = 0
  end
  if bestc == nil or c < bestc then best, bestc = ARGV[4 + i], c end
end
local after = redis.call('HINCRBY', inflight, best, 1)
if maxc > 0 and after > maxc then
  redis.call('HINCRBY', inflight, best, -1)
  return {best, after, 0}
end
redis.call('SET', KEYS[3], best, 'EX', 21600)
return {best, after, 1}
