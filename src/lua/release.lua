-- ai-load-balancer: releases of one owner's requests, exactly once, whatever the order of events
-- (after shared.lua). Finished requests' releases usually ride on the owner's next pick
-- (pick_settle.lua); this script sends those that no pick carried in time, and cancels abandoned
-- picks.
-- KEYS[1]  in-flight hash of this route+cluster
-- ARGV[1]  the picking owner's id
-- ARGV[2]  requests that were admitted and have ended, `id=pod` joined by ',' (may be empty): each
--          record still there is deleted and its pod's count goes down by one
-- ARGV[3]  (optional) the id of a pick the plugin gave up waiting for (Redis timeout, client
--          gone): undone if it ran; if it has not run yet, a tombstone ('#' and Redis's time)
--          makes the pick, arriving late, do nothing (the owner's heartbeat deletes a tombstone
--          once it is a lease old and the VM no longer lists its id)
-- Returns how many counts went down. Once the owner's lease has run out its picks were already
-- subtracted and its hash deleted: the release then does nothing.

-- The releases of the owner's ended requests, `id=pod` joined by ',': the pods' counts as the
-- plugin expects them after the releases (`freed`, pod -> how many), before any write.
-- `held_ended` then finds which records are still there, and a record already gone (this release
-- ran before and was sent again after an unknown outcome, or the owner was reaped) is taken back
-- out of `freed`: exactly once, and a release may always be sent again.
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

local mine = base .. 'own:' .. ARGV[1]
local ended, freed = parse_ended(ARGV[2] or '')
local held = held_ended(mine, ended, freed)
local n = #held
local abandoned = ARGV[3]
local tomb = false
if abandoned then
  local h = redis.call('HGET', mine, abandoned)
  if not h then
    tomb = true
  elseif is_record(h) then
    held[#held + 1] = abandoned
    freed[h] = (freed[h] or 0) + 1
    n = n + 1
  end
end
-- The counts go down and the tombstone is written before the records go: nothing is written after
-- a record's deletion (see MARKER in prelude.lua for why that order matters).
local delta = {}
for h, c in pairs(freed) do delta[h] = -c end
add_counts(delta)
if tomb then redis.call('HSET', mine, abandoned, '#' .. now_ms()) end
if #held > 0 then redis.call('HDEL', mine, unpack(held)) end
return n
