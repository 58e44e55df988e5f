-- ai-load-balancer: prelude of the pick scripts (after reap.lua, before least_request.lua or
-- prefix_cache.lua). In-flight counts are held under per-VM leases: each admitted pick is recorded
-- in its owner's hash, and an owner whose lease runs out has its picks subtracted (reap.lua), so a
-- gateway that dies cannot leave its +1s behind. Nothing here has a TTL that eviction could remove.
-- KEYS[1]  in-flight hash of this route+cluster: host -> in-flight requests over the live owners
-- ARGV[1]  max in-flight (0 = no limit)   ARGV[2] lease (ms)
-- ARGV[3]  owner id   ARGV[4] request id (unique per owner)
local mine = base .. 'own:' .. ARGV[3]
local rec = ARGV[4]
-- Register the owner when it is not (its first pick; its heartbeats renew the lease). Checked on
-- every pick, not only when the plugin thinks it needs to: a pick that Redis runs late (frozen, or
-- read from the socket of a gateway that died meanwhile) after the reaper removed its owner must
-- bring the owner back, or its record would sit under an owner no reaper sees.
if not redis.call('ZSCORE', owners, ARGV[3]) then
  redis.call('ZADD', owners, now_ms() + (tonumber(ARGV[2]) or 10000), ARGV[3])
end
local maxc = tonumber(ARGV[1]) or 0
-- +1 for host; returns the host's count after it.
local function take(h) return redis.call('HINCRBY', inflight, h, 1) end
local function untake(h) redis.call('HINCRBY', inflight, h, -1) end
-- Records the pick for release.lua (exactly once) and reap.lua (if the owner dies first), before
-- its +1. The owner's hash is the one key a pick may write without having read it first, and on a
-- Redis Cluster slot being migrated touching a key the old master no longer holds fails the call
-- there: done first, such a failure happens before any count changes.
-- False when a tombstone is there: the plugin gave up on this pick before it ran (a stalled Redis
-- runs it late); the caller does nothing more.
local function admit(h)
  if redis.call('HSETNX', mine, rec, h) == 1 then return true end
  redis.call('HDEL', mine, rec)
  return false
end
-- The recorded pick is not admitted after all (maxRequestCount): drop its record.
local function unadmit() redis.call('HDEL', mine, rec) end
