-- ai-load-balancer: release one request's +1, exactly once, whatever the order of events (after
-- reap.lua, for the key names).
-- KEYS[1]  in-flight hash of this route+cluster
-- ARGV[1]  the picking owner's id   ARGV[2] request id
-- ARGV[3]  '0': the end of an admitted request; ARGV[4] is the host it was admitted to.
--          '1': the plugin gave up waiting for the pick (Redis timeout, client gone): undo it if it
--          ran; if it has not run yet, leave a tombstone so that the pick, arriving late, does
--          nothing.
-- Returns the released host, or ''. Once the owner's lease has run out its picks were already
-- subtracted and its hash deleted: the release then does nothing.
local mine = base .. 'own:' .. ARGV[1]
local rec = 'r:' .. ARGV[2]
local function release(h)
  if redis.call('HINCRBY', inflight, h, -1) < 0 then redis.call('HSET', inflight, h, 0) end
  return h
end
if ARGV[3] ~= '1' then
  if redis.call('HDEL', mine, rec) == 1 then return release(ARGV[4]) end
  return ''
end
local h = redis.call('HGET', mine, rec)
if h and h ~= '' then
  redis.call('HDEL', mine, rec)
  return release(h)
end
if not h then redis.call('HSET', mine, rec, '') end
return ''
