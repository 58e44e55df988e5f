-- ai-load-balancer: prelude of the pick scripts (after reap.lua, before least_request.lua or
-- prefix_cache.lua). In-flight counts are held under per-VM leases: each admitted pick is recorded
-- in its owner's hash, and an owner whose lease runs out has its picks subtracted (reap.lua), so a
-- gateway that dies cannot leave its +1s behind. Nothing here has a TTL that eviction could remove.
-- A pick also carries the releases of the owner's requests that ended since its last pick: one
-- script call per routed request, and one count write per pod whose count changes.
-- KEYS[1]  in-flight hash of this route+cluster: host -> in-flight requests over the live owners
-- ARGV[1]  max in-flight (0 = no limit)   ARGV[2] lease (ms)   ARGV[3] owner id
-- ARGV[4]  this request's id (unique per owner), then the owner's ended requests whose release
--          this pick carries as `id=pod`, all joined by ','
local mine = base .. 'own:' .. ARGV[3]
local rec, ended = ARGV[4], ''
local comma = string.find(rec, ',', 1, true)
if comma then
  ended = string.sub(rec, comma + 1)
  rec = string.sub(rec, 1, comma - 1)
end
-- Register the owner when it is not (its first pick; its heartbeats renew the lease). Checked on
-- every pick, not only when the plugin thinks it needs to: a pick that Redis runs late (frozen, or
-- read from the socket of a gateway that died meanwhile) after the reaper removed its owner must
-- bring the owner back, or its record would sit under an owner no reaper sees.
if not redis.call('ZSCORE', owners, ARGV[3]) then
  redis.call('ZADD', owners, now_ms() + (tonumber(ARGV[2]) or 10000), ARGV[3])
end
local maxc = tonumber(ARGV[1]) or 0
-- The carried releases: their records deleted first (on a Redis Cluster slot being migrated, the
-- owner's hash is the one key a pick may write without having read it, and touching a key the old
-- master no longer holds fails the call there: before any count changes). Their counts go down in
-- commit, netted with the pick's +1; the pick scripts choose on the counts as they are once these
-- releases are applied (count_after_releases).
local carried, freed = parse_ended(ended)
release_ended(mine, carried, freed)
local function count_after_releases(h, stored)
  local c = (tonumber(stored) or 0) - (freed[h] or 0)
  if c < 0 then return 0 end
  return c
end
-- The count writes of a pick, after all its reads: the carried releases' -1s, and with `h` the
-- pick itself: its record (for release.lua and, if the owner dies first, reap.lua) and its +1,
-- netted with the releases per pod. Without carried releases the record is the first write to the
-- owner's hash, before any count changes (see above).
-- Returns false when a tombstone is there: the plugin gave up on this pick before it ran (a stalled
-- Redis runs it late); the pick then does nothing (the releases still apply).
local function commit(h)
  local delta = {}
  for host, c in pairs(freed) do delta[host] = -c end
  local admitted = false
  if h then
    if redis.call('HSETNX', mine, rec, h) == 1 then
      admitted = true
      delta[h] = (delta[h] or 0) + 1
    else
      redis.call('HDEL', mine, rec)
    end
  end
  add_counts(delta)
  return admitted
end
