-- ai-load-balancer: global least request pick, one round trip (after prelude.lua only). The same
-- leases as the prefix-cache pick's (lease.lua says why each step is where it is), written out
-- flat: Redis runs a script's whole body at every call, and each function it defines is a new
-- closure, made and collected at every call. Without shared.lua's and lease.lua's twelve, a pick
-- takes about 4 us less of its 22-26 (bench/HISTORY.md, "A flat least-request script").
-- KEYS[1]  in-flight hash of this route+cluster: host -> in-flight requests over the live owners
-- ARGV[1]  max in-flight (0 = no limit)   ARGV[2] lease (ms)   ARGV[3] owner id
-- ARGV[4]  this request's id (unique per owner), then the owner's ended requests whose release
--          this pick carries as `id=pod`, all joined by ','
-- ARGV[5 ..]  the healthy hosts, shuffled by the plugin (first minimum wins => random among ties).
--             Whole: rebuilding each host from a shared prefix and suffix cost more Redis time (a
--             new string per host) than its bytes saved.
-- Returns {host, in-flight after the pick, admitted 1|0}; admitted 0: over maxRequestCount, no +1
-- (429); {'', 0, 0}: no candidate, or a tombstone was there (the plugin gave up on this pick before
-- Redis ran it; the pick then only deletes it, the carried releases still apply).
local owner = ARGV[3]
local mine = base .. 'own:' .. owner
local rec, ended = ARGV[4], nil
local comma = string.find(rec, ',', 1, true)
if comma then
  ended = string.sub(rec, comma + 1)
  rec = string.sub(rec, 1, comma - 1)
end
-- The read, before any write (host -> stored count).
local counts = nil
if #ARGV >= 5 then
  counts = {}
  local all = redis.call('HGETALL', inflight)
  for i = 1, #all, 2 do counts[all[i]] = all[i + 1] end
end
-- The carried releases whose record is still there: their records deleted, and `down` (pod -> by
-- how much its count goes down) gets their pods; a record already gone (a release sent again, or of
-- a reaped owner) counts nothing. One release, the common case, is cut out with string.find (about
-- 1 us less than gmatch and its tables) and settled by its HDEL's reply; several by one HMGET then
-- one HDEL.
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
-- A carried record still there proves the owner is registered; otherwise the owners set says, and
-- an owner missing there (a late pick of a reaped owner) is registered again, marker first.
if settled == 0 and not redis.call('ZSCORE', owners, owner) then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('HSET', mine, MARKER, '')
  redis.call('ZADD', owners, now + (tonumber(ARGV[2]) or 10000), owner)
end
-- The least loaded candidate once the releases are applied (a count below 0 counts as 0).
local best, bestc = nil, nil
for i = 5, #ARGV do
  local h = ARGV[i]
  local c = (tonumber(counts[h]) or 0) - (down[h] or 0)
  if c < 0 then c = 0 end
  if bestc == nil or c < bestc then best, bestc = h, c end
end
local reply = {'', 0, 0}
if best then
  local maxc = tonumber(ARGV[1]) or 0
  if maxc > 0 and bestc >= maxc then
    reply = {best, bestc + 1, 0}
  elseif redis.call('HSETNX', mine, rec, best) == 1 then
    reply = {best, bestc + 1, 1}
    down[best] = (down[best] or 0) - 1
  else
    redis.call('HDEL', mine, rec)
  end
end
-- The counts that change, netted per pod. Having read the whole hash, one HSET of their new values
-- (the script is atomic: nothing changed them since the read, and a pod absent from the hash was at
-- 0; a stored count below 0 counts as 0); with no read (no candidate), one HINCRBY each.
local set = {}
for h, d in pairs(down) do
  if d ~= 0 then
    if counts then
      local c = tonumber(counts[h]) or 0
      if c < 0 then c = 0 end
      c = c - d
      if c < 0 then c = 0 end
      set[#set + 1] = h
      set[#set + 1] = c
    elseif redis.call('HINCRBY', inflight, h, -d) < 0 then
      redis.call('HSET', inflight, h, 0)
    end
  end
end
if #set > 0 then redis.call('HSET', inflight, unpack(set)) end
return reply
