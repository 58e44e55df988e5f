-- ai-load-balancer: every third of a lease, each plugin VM renews its lease for a route+cluster it
-- uses, reaps owners whose lease ran out (so a dead gateway's counts return even when no request
-- comes), releases its own records that it no longer knows, and runs the periodic recount of the
-- counts and cleanup of hosts that left the cluster (after shared.lua and reap.lua).
-- KEYS[1]  in-flight hash
-- ARGV[1]  lease (ms)   ARGV[2] owner id   ARGV[3] cleanup interval (s, 0 = never)
-- ARGV[4]  the owner's requests whose records must stay, joined by ',': picks not answered yet,
--          admitted requests not ended, and ended ones whose release is still on its way
-- ARGV[5 ..] every host still in the cluster (healthy or not), as this VM last saw it
-- Returns {how many of the owner's records it released, how many pods' counts the recount
-- corrected}.
local now = now_ms()
local lease = tonumber(ARGV[1]) or 10000
local mine = base .. 'own:' .. ARGV[2]
register(mine, ARGV[2], now + lease)
reap(now)
-- Any other record of this owner is one whose release can no longer come: Redis came back from a
-- snapshot or a lagging replica older than the releases the VM sent, the VM gave a release up, or
-- (Redis Cluster) a release ran where the record had not arrived yet. Every release is sent before
-- this heartbeat on the same connection or is listed, and the owner's next picks come after it, so
-- what is released here was released by nobody else and never will be: exactly once still. Counts
-- go down before the records go (see MARKER in prelude.lua).
-- A tombstone the VM no longer lists goes once it is a lease old (one without a time, written
-- before tombstones had one, at once): its pick, if Redis runs it at all, runs within moments of the
-- cancel that wrote it (both were sent before the VM forgot the id), and should one come later
-- still, it is admitted and its record, which no VM lists, is released here exactly once. So an
-- owner's hash holds no more tombstones than its picks abandoned in the last lease.
local keep = {}
for id in string.gmatch(ARGV[4] or '', '[^,]+') do keep[id] = true end
local records = redis.call('HGETALL', mine)
local gone, delta, released = {}, {}, 0
for i = 1, #records, 2 do
  local id, h = records[i], records[i + 1]
  if not keep[id] and id ~= MARKER then
    if is_record(h) then
      gone[#gone + 1] = id
      delta[h] = (delta[h] or 0) - 1
      released = released + 1
    elseif now - (tonumber(string.sub(h, 2)) or 0) >= lease then
      gone[#gone + 1] = id
    end
  end
end
add_counts(delta)
-- (HDEL in slices: unpack has a limit on how many values it returns)
for i = 1, #gone, 1000 do
  redis.call('HDEL', mine, unpack(gone, i, math.min(i + 999, #gone)))
end
-- The recount, every six leases (a minute by default; by whichever VM's heartbeat comes first):
-- each pod's count is set to the number of records naming it in the live owners' hashes, which is
-- what it always equals (a +1 is written with its record, a -1 with its record's deletion, a dead
-- owner's records and counts go together). So a count that went wrong anyway mends within six leases instead of staying wrong:
-- on a Redis Cluster, a script run on the importing master of a half-moved slot, where some keys
-- had not arrived, or a record lost when the resharding tool replaced a key (`--cluster-replace`);
-- a hand edit; a bug. Its cost is one read of every live owner's hash, every six leases per route.
local corrected = 0
local last_recount = base .. 'last_recount'
if now - (tonumber(redis.call('GET', last_recount)) or 0) >= 6 * lease then
  local truth = {}
  for _, owner in ipairs(redis.call('ZRANGE', owners, 0, -1)) do
    local held = redis.call('HGETALL', base .. 'own:' .. owner)
    for i = 2, #held, 2 do
      local h = held[i]
      if is_record(h) then truth[h] = (truth[h] or 0) + 1 end
    end
  end
  local set = {}
  for h, c in pairs(all_counts()) do
    local t = truth[h] or 0
    if tonumber(c) ~= t then
      set[#set + 1] = h
      set[#set + 1] = t
    end
    truth[h] = nil
  end
  for h, t in pairs(truth) do
    set[#set + 1] = h
    set[#set + 1] = t
  end
  corrected = #set / 2
  for i = 1, #set, 1000 do
    redis.call('HSET', inflight, unpack(set, i, math.min(i + 999, #set)))
  end
  redis.call('SET', last_recount, now)
end
local interval = tonumber(ARGV[3]) or 0
if interval > 0 and #ARGV >= 5 then
  local last_clean = base .. 'last_clean'
  local last = tonumber(redis.call('GET', last_clean) or '0') or 0
  if now / 1000 - last >= interval then
    -- Only a count at 0 (or below) goes: this VM's view may be older than another gateway's (an
    -- idle group, or endpoints that reached that gateway first), and a new pod it has not seen may
    -- already have requests in flight. A pod that left with requests in flight reaches 0 as they
    -- end (or as their owner is reaped) and goes at a later cleanup. A missing field reads as 0,
    -- so deleting a 0 changes no pick.
    local in_cluster = {}
    for i = 5, #ARGV do in_cluster[ARGV[i]] = true end
    for h, c in pairs(all_counts()) do
      if not in_cluster[h] and (tonumber(c) or 0) <= 0 then redis.call('HDEL', inflight, h) end
    end
    redis.call('SET', last_clean, math.floor(now / 1000))
  end
end
return {released, corrected}
