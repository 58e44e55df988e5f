-- ai-load-balancer: prelude of the pick scripts (after reap.lua, before least_request.lua or
-- prefix_cache.lua). In-flight counts are held under per-VM leases, so that a gateway that dies
-- (SIGKILL, OOM, partition) cannot leave its +1s behind: nothing here has a TTL that eviction
-- could remove.
-- KEYS[1]  in-flight hash of this route+cluster: host -> sum over the live owners
-- KEYS[2]  time (s) of the last cleanup of hosts that left the cluster
-- KEYS[3]  owners: sorted set, owner (one plugin VM) -> lease expiry (ms, Redis TIME)
-- KEYS[4]  this owner's hash: 'h:'..host -> its share of the count, 'r:'..request -> host
-- ARGV[1]  cleanup interval (s, 0 = never)   ARGV[2] max in-flight (0 = no limit)
-- ARGV[3]  lease (ms)   ARGV[4] owner id   ARGV[5] request id
if redis.replicate_commands then redis.replicate_commands() end
local inflight, owners, mine = KEYS[1], KEYS[3], KEYS[4]
local rec = 'r:' .. ARGV[5]
-- A tombstone: the plugin gave up on this pick before it ran (a stalled Redis runs it late).
if redis.call('HGET', mine, rec) == '' then
  redis.call('HDEL', mine, rec)
  return {'', 0, 0, 0}
end
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local now = tonumber(clock[1])
redis.call('ZADD', owners, now_ms + (tonumber(ARGV[3]) or 10000), ARGV[4])
reap(inflight, owners, now_ms)
-- Cleanup of hosts that left the cluster. `first` is the ARGV index of the first host.
local function cleanup(first)
  local interval = tonumber(ARGV[1]) or 0
  if interval <= 0 then return end
  local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
  if now - last < interval then return end
  local keep = {}
  for i = first, #ARGV do keep[ARGV[i]] = true end
  for _, h in ipairs(redis.call('HKEYS', inflight)) do
    if not keep[h] then redis.call('HDEL', inflight, h) end
  end
  redis.call('SET', KEYS[2], now)
end
-- +1 for host on behalf of this owner; returns the host's count after it.
local function take(h)
  redis.call('HINCRBY', mine, 'h:' .. h, 1)
  return redis.call('HINCRBY', inflight, h, 1)
end
local function untake(h)
  redis.call('HINCRBY', inflight, h, -1)
  if redis.call('HINCRBY', mine, 'h:' .. h, -1) <= 0 then redis.call('HDEL', mine, 'h:' .. h) end
end
-- The admitted pick's record: release.lua undoes the +1 from it, exactly once.
local function admit(h) redis.call('HSET', mine, rec, h) end
local maxc = tonumber(ARGV[2]) or 0
