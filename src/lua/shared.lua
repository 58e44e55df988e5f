-- ai-load-balancer: the functions the scripts share (after prelude.lua). Redis runs a script's
-- whole body at every call, so each function defined here is a new closure at every call of each
-- script that includes this file: least_request.lua, on the path of every routed request, does
-- without.

-- Redis's clock in ms (every gateway uses the same clock for leases).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A field of an owner's hash is a record (the pod of an admitted request) or not: the marker
-- (MARKER in prelude.lua, value ''), or the tombstone of an abandoned pick ('#' and the Redis time
-- it was written, ms; '' before 2026-11-27). Pod addresses never start with '#'.
local function is_record(h)
  return h ~= '' and string.byte(h, 1) ~= 35
end

-- The releases of an owner's ended requests, `id=pod` joined by ',' (carried by its next pick, or
-- sent by release.lua): the pods' counts as the plugin expects them after the releases (`freed`,
-- pod -> how many), before any write. `take_ended` (a pick, lease.lua) or `held_ended` (release.lua) then
-- finds which records are still there, and a record already gone (this release ran before and was
-- sent again after an unknown outcome, or the owner was reaped) is taken back out of `freed`:
-- exactly once, and a release may always be sent again.
local function parse_ended(list)
  local ended, freed = {}, {}
  for id, h in string.gmatch(list, '([^,=]+)=([^,]+)') do
    ended[#ended + 1] = {id, h}
    freed[h] = (freed[h] or 0) + 1
  end
  return ended, freed
end
local function held_ended(mine, ended, freed)
  if #ended == 0 then return {} end
  local ids = {}
  for i, e in ipairs(ended) do ids[i] = e[1] end
  local vals = redis.call('HMGET', mine, unpack(ids))
  local held = {}
  for i, e in ipairs(ended) do
    if vals[i] and is_record(vals[i]) then
      held[#held + 1] = e[1]
    else
      freed[e[2]] = freed[e[2]] - 1
    end
  end
  return held
end

-- Registers an owner until `expires` (ms): its marker first, so that no owner is ever registered
-- without one (if that write fails, nothing is registered).
local function register(mine, owner, expires)
  redis.call('HSET', mine, MARKER, '')
  redis.call('ZADD', owners, expires, owner)
end

-- Every count of the in-flight hash, host -> stored value: the pick scripts' read of the counts.
-- One HGETALL rather than an HMGET of the candidates: inside a script Redis pays for each command
-- argument (about 0.5 us each past its small cache of argument objects, Redis 7), so an HMGET of 256
-- hosts took 150 us where an HGETALL of the same hash took 35 (equal at 8 hosts). The hash holds
-- only this route+cluster's pods (and, until the cleanup, pods that left).
local function all_counts()
  local a = redis.call('HGETALL', inflight)
  local m = {}
  for i = 1, #a, 2 do m[a[i]] = a[i + 1] end
  return m
end

-- Adds delta[pod] to each pod's in-flight count (one HINCRBY per pod whose count changes);
-- a count below 0 (a decrement that outlived a cleanup) is repaired to 0.
local function add_counts(delta)
  for h, d in pairs(delta) do
    if d ~= 0 and redis.call('HINCRBY', inflight, h, d) < 0 then
      redis.call('HSET', inflight, h, 0)
    end
  end
end
