-- ai-load-balancer: prelude of the pick scripts (after reap.lua, before least_request.lua or
-- prefix_cache.lua). In-flight counts are held under per-VM leases: each admitted pick is recorded
-- in its owner's hash, and an owner whose lease runs out has its picks subtracted (reap.lua), so a
-- gateway that dies cannot leave its +1s behind. Nothing here has a TTL that eviction could remove.
-- A pick also carries the releases of the owner's requests that ended since its last pick: one
-- script call per routed request, and one HSET of the counts that change (none when -1 +1 net out).
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
local maxc = tonumber(ARGV[1]) or 0
-- The carried releases: which of their records are still there, read first (on a Redis Cluster
-- slot being migrated, touching a key the old master no longer holds fails the call there, so that
-- must happen before any write). Their records are deleted and their counts go down in commit,
-- netted with the pick's +1; the pick scripts choose on the counts as they are once these releases
-- are applied (read_count).
local carried, freed = parse_ended(ended)
-- The owner must be registered, or its record would sit under an owner no reaper sees: a pick that
-- Redis runs late (frozen, or read from the socket of a gateway that died meanwhile) after the
-- reaper removed its owner brings the owner back. A carried record that was still there proves it
-- without a read: a record is only written by a pick whose owner was registered, and only the
-- reaper unregisters an owner, deleting its whole hash in the same script. So only a pick that
-- found none of its carried records (none carried, or reaped) reads the owners set.
local held = held_ended(mine, carried, freed)
if #held == 0 and not redis.call('ZSCORE', owners, ARGV[3]) then
  redis.call('ZADD', owners, now_ms() + (tonumber(ARGV[2]) or 10000), ARGV[3])
end
-- Each candidate host's count as this pick read it (the pick scripts fill it from their HMGET,
-- through read_count), so that commit writes every changed count in one HSET instead of one
-- HINCRBY per pod.
local stored = {}
-- A candidate's count once the carried releases are applied (what the pick chooses on), from its
-- stored value `raw` (nil: 0), remembered for commit.
local function read_count(h, raw)
  local s = tonumber(raw) or 0
  stored[h] = s
  local c = s - (freed[h] or 0)
  if c < 0 then return 0 end
  return c
end
-- Adds delta[pod] to each pod's count. The pods this pick read get their new values in one HSET
-- (the script is atomic: nothing changed them since the read); a count below 0 (a decrement that
-- outlived a cleanup) is repaired to 0 there, changed or not. Any other pod (a carried release's
-- pod that is no longer a candidate) goes by add_counts.
local function write_counts(delta)
  local set, other = {}, {}
  for h, s in pairs(stored) do
    local d = delta[h] or 0
    if d ~= 0 or s < 0 then
      local c = s
      if c < 0 then c = 0 end
      c = c + d
      if c < 0 then c = 0 end
      set[#set + 1] = h
      set[#set + 1] = c
    end
  end
  for h, d in pairs(delta) do
    if stored[h] == nil then other[h] = d end
  end
  add_counts(other)
  if #set > 0 then redis.call('HSET', inflight, unpack(set)) end
end
-- The count writes of a pick, after all its reads: the carried releases' -1s, and with `h` the
-- pick itself: its record (for release.lua and, if the owner dies first, reap.lua) and its +1,
-- netted with the releases per pod. The record is the first write to the owner's hash (when the
-- hash is missing on a master migrating the slot, the call fails there before any count changes)
-- and the carried records' deletion the last (see delete_fields).
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
      held[#held + 1] = rec
    end
  end
  delete_fields(mine, held)
  write_counts(delta)
  return admitted
end
