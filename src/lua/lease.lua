-- ai-load-balancer: the leases of a pick (after shared.lua, before prefix_cache.lua; the
-- least-request pick, least_request.lua, takes the same steps written out flat). In-flight counts
-- are held under per-VM leases: each admitted pick is recorded in its owner's hash, and an owner
-- whose lease runs out has its picks subtracted (reap.lua), so a gateway that dies cannot leave its
-- +1s behind. Nothing here has a TTL that eviction could remove.
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
-- The carried releases (parsed here, applied by settle): `freed` is pod -> how many the pick
-- scripts subtract from the counts they read.
local carried, freed = parse_ended(ended)
-- The carried releases' records that are still there, deleted (a pick's first write, after its
-- reads): the ids held, and `freed` keeps only their pods. One HDEL whose reply says it for a single
-- release (the common case), else one HMGET then one HDEL.
local function take_ended(mine, ended, freed)
  if #ended == 1 then
    local e = ended[1]
    if redis.call('HDEL', mine, e[1]) == 1 then return {e[1]} end
    freed[e[2]] = freed[e[2]] - 1
    return {}
  end
  local held = held_ended(mine, ended, freed)
  if #held > 0 then redis.call('HDEL', mine, unpack(held)) end
  return held
end
local settled = false
-- Deletes the carried releases' records and keeps in `freed` only those whose record was still
-- there (exactly once: a release sent again, or of a reaped owner, finds nothing). The pick scripts
-- call it after their reads and before anything they write: on a Redis Cluster slot being migrated,
-- a key the old master no longer holds fails the call at its first access, and every key accessed
-- after these deletions was read before them or is KEYS[1], which Redis checks before the script
-- runs. Deleting a record can never empty the owner's hash, whose marker field stays until the
-- reaper deletes the hash (see register), so the later writes to it cannot fail there either.
-- The owner must be registered, or its record would sit under an owner no reaper sees: a pick that
-- Redis runs late (frozen, or read from the socket of a gateway that died meanwhile) after the
-- reaper removed its owner brings the owner back. A carried record that was still there proves it
-- without a read: a record is only written by a pick whose owner was registered, and only the
-- reaper unregisters an owner, deleting its whole hash in the same script. So only a pick that
-- found none of its carried records (none carried, or reaped) reads the owners set.
local function settle()
  settled = true
  if #take_ended(mine, carried, freed) == 0 and not redis.call('ZSCORE', owners, ARGV[3]) then
    register(mine, ARGV[3], now_ms() + (tonumber(ARGV[2]) or 10000))
  end
end
-- The in-flight hash as the pick read it (host -> stored value): the pick scripts set it from
-- all_counts(); nil before (a pick with no candidates reads nothing).
local counts = nil
-- A host's count once the carried releases are applied (what the pick chooses on); a stored count
-- below 0 counts as 0.
local function read_count(h)
  local c = (tonumber(counts[h]) or 0) - (freed[h] or 0)
  if c < 0 then return 0 end
  return c
end
-- Adds delta[pod] to each pod's count. Once the pick has read the whole hash, the changed counts get
-- their new values in one HSET (the script is atomic: nothing changed them since the read, and a
-- pod absent from the hash was at 0), clamped at 0. Only the changed pods are touched: a pick's
-- Lua work does not grow with the cluster beyond the one read. Before any read, add_counts.
local function write_counts(delta)
  if not counts then return add_counts(delta) end
  local set = {}
  for h, d in pairs(delta) do
    if d ~= 0 then
      local c = tonumber(counts[h]) or 0
      if c < 0 then c = 0 end
      c = c + d
      if c < 0 then c = 0 end
      set[#set + 1] = h
      set[#set + 1] = c
    end
  end
  if #set > 0 then redis.call('HSET', inflight, unpack(set)) end
end
-- The count writes of a pick, after settle: the carried releases' -1s, and with `h` the pick
-- itself: its record (for release.lua and, if the owner dies first, reap.lua) and its +1, netted
-- with the releases per pod.
-- Returns false when a tombstone is there: the plugin gave up on this pick before it ran (a stalled
-- Redis runs it late); the pick then does nothing but delete it (the releases still apply).
local function commit(h)
  if not settled then settle() end
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
  write_counts(delta)
  return admitted
end
