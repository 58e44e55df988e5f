-- ai-load-balancer: a pick's lease steps, first part (where a pick script says `--@settle`: after
-- its reads of keys other than KEYS[1], before anything it writes). In-flight counts are held under
-- per-VM leases: each admitted pick is recorded in its owner's hash, and an owner whose lease runs
-- out has its picks subtracted (reap.lua), so a gateway that dies cannot leave its +1s behind.
-- Nothing here has a TTL that eviction could remove. A pick also carries the releases of the
-- owner's requests that ended since its last pick: one script call per routed request.
-- The pick scripts are written out flat, these steps included: Redis runs a script's whole body at
-- every call, and each function a script defines is a new closure, made and collected at every
-- call (without twelve of them a least-request pick took about 4 us less of its 22-26:
-- bench/HISTORY.md, "A flat least-request script").
-- ARGV[1]  max in-flight (0 = no limit)   ARGV[2] lease (ms)   ARGV[3] owner id
-- ARGV[4]  this request's id (unique per owner), then the owner's ended requests whose release
--          this pick carries as `id=pod`, all joined by ','
-- Leaves: `counts` (host -> stored count, the whole in-flight hash), `down` (pod -> by how much
-- the carried releases take its count down), `owner`, `mine` (the owner's hash), `rec`.
local owner = ARGV[3]
local mine = base .. 'own:' .. owner
local rec, ended = ARGV[4], nil
local comma = string.find(rec, ',', 1, true)
if comma then
  ended = string.sub(rec, comma + 1)
  rec = string.sub(rec, 1, comma - 1)
end
-- The read of the counts. One HGETALL rather than an HMGET of the candidates: inside a script Redis
-- pays for each command argument (about 0.5 us each past its small cache of argument objects,
-- Redis 7), so an HMGET of 256 hosts took 150 us where an HGETALL of the same hash took 35 (equal
-- at 8 hosts). The hash holds only this route+cluster's pods (and, until the cleanup, pods that
-- left).
local counts = {}
local all = redis.call('HGETALL', inflight)
for i = 1, #all, 2 do counts[all[i]] = all[i + 1] end
-- The carried releases whose record is still there: their records deleted, and `down` gets their
-- pods; a record already gone (this release ran before and was sent again after an unknown outcome,
-- or the owner was reaped) counts nothing: exactly once, and a release may always be sent again.
-- One release, the common case, is cut out with string.find (about 1 us less than gmatch and its
-- tables) and settled by its HDEL's reply; several by one HMGET then one HDEL.
-- This is the pick's first write: on a Redis Cluster slot being migrated, a key the old master no
-- longer holds fails the call at its first access, and every key accessed after these deletions
-- was read before them or is KEYS[1], which Redis checks before the script runs. Deleting a record
-- can never empty the owner's hash, whose marker stays until the reaper deletes the hash (MARKER in
-- prelude.lua), so the later writes to it cannot fail there either.
local down, settled = {}, 0
local eq = ended and string.find(ended, '=', 1, true)
if eq and eq > 1 and eq < #ended and not string.find(ended, ',', 1, true) then
  if redis.call('HDEL', mine, string.sub(ended, 1, eq - 1)) == 1 then
    down[string.sub(ended, eq + 1)], settled = 1, 1
  end
elseif ended then
  local ids, pods = {}, {}
  for id, h in string.gmatch(ended, '([^,=]+)=([^,]+)') do
    ids[#ids + 1] = id
    pods[#ids] = h
  end
  if #ids > 0 then
    local held = {}
    for i, v in ipairs(redis.call('HMGET', mine, unpack(ids))) do
      -- A record (not the marker '', nor a tombstone '#...').
      if v and v ~= '' and string.byte(v, 1) ~= 35 then
        held[#held + 1] = ids[i]
        down[pods[i]] = (down[pods[i]] or 0) + 1
      end
    end
    settled = #held
    if settled > 0 then redis.call('HDEL', mine, unpack(held)) end
  end
end
-- The owner must be registered, or its record would sit under an owner no reaper sees: a pick that
-- Redis runs late (frozen, or read from the socket of a gateway that died meanwhile) after the
-- reaper removed its owner brings the owner back, marker first. A carried record that was still
-- there proves it without a read: a record is only written by a pick whose owner was registered,
-- and only the reaper unregisters an owner, deleting its whole hash in the same script.
if settled == 0 and not redis.call('ZSCORE', owners, owner) then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', mine, MARKER, '')
  redis.call('ZADD', owners, now + (tonumber(ARGV[2]) or 10000), owner)
end
