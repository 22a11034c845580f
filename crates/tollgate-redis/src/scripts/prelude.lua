
-- Members of a sliding log that one ZADD or ZREM takes: unpack passes at most a few
-- thousand values.
local CHUNK = 1000
-- The most members a sliding log keeps, the newest: 2 x tollgate_engine::MAX_LOG_UNITS, at
-- least twice any quota's limit, which still answers every check exactly.
local LOG_ENTRIES = 20000
-- Adds (`ZADD`, scored at `stamp`) or removes (`ZREM`) a sliding log's members
-- `<stamp>-<from>` to `<stamp>-<to>`: one unique member per unit, a chunk per command.
local function log_units(cmd, key, stamp, from, to)
  local members = {}
  while from <= to do
    local last, n = math.min(from + CHUNK - 1, to), 0
    for s = from, last do
      if cmd == 'ZADD' then
        n = n + 1
        members[n] = stamp
      end
      n = n + 1
      members[n] = stamp .. '-' .. fmt(s)
    end
    redis.call(cmd, key, unpack(members, 1, n))
    from = last + 1
  end
end
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
