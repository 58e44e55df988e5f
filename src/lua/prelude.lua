-- ai-load-balancer: the first lines of every script (then shared.lua, except in the pick scripts).
-- Every key of a route+cluster shares one hash tag, so the scripts derive them from the in-flight
-- hash key they are given (KEYS[1] = `<base>inflight`): `<base>owners`, `<base>own:<owner>`,
-- `<base>pfx:<hex>`, `<base>last_clean`, `<base>last_recount`. One slot, and far fewer bytes per
-- call than passing each key.
local inflight = KEYS[1]
local base = string.sub(inflight, 1, #inflight - 8)
local owners = base .. 'owners'

-- Redis before 5 needs effects replication for a write after TIME (now_ms), and asks for it
-- before any write: here, first thing in every script.
if redis.replicate_commands then redis.replicate_commands() end

-- Every owner's hash holds this field (value '', skipped like a tombstone by reap) from the owner's
-- registration until the reaper deletes the hash, so deleting records can never delete the hash:
-- on a Redis Cluster slot being migrated, a script's access to a key the old master no longer holds
-- (Redis checks only KEYS[1], the in-flight hash, before the script runs) fails there, and a write
-- after a record's deletion would then fail after the record was gone and before its count went
-- down (the release, sent again, would find nothing). Request ids are hex.
local MARKER = '~'
