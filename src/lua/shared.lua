-- ai-load-balancer: the functions the release and heartbeat scripts share (after prelude.lua).
-- Redis runs a script's whole body at every call, so each function defined here is a new closure at
-- every call of each script that includes this file: the pick scripts, one per routed request, are
-- written out flat and do without.

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

-- Registers an owner until `expires` (ms): its marker first, so that no owner is ever registered
-- without one (if that write fails, nothing is registered).
local function register(mine, owner, expires)
  redis.call('HSET', mine, MARKER, '')
  redis.call('ZADD', owners, expires, owner)
end

-- Every count of the in-flight hash, host -> stored value (one HGETALL: see pick_settle.lua).
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
