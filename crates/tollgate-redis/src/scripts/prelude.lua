
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function fmt(x) return string.format('%d', x) end
-- A GCRA key's value: its TAT and the emission interval it was written under.
local function read_tat(key)
  local v = redis.call('GET', key)
  if not v then return false, 0 end
  local t, i = string.match(v, '^(%d+):(%d+)$')
  if not t then return false, 0 end
  return tonumber(t), tonumber(i)
end
local function tat_value(tat, interval) return fmt(tat) .. ':' .. fmt(interval) end
-- Members of a sliding log that one ZADD or ZREM takes: unpack passes at most a few
-- thousand values.
local CHUNK = 1000
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
local function ttl_ms(us)
  local ms = idiv(us + 999, 1000)
  if ms < 1 then ms = 1 end
  return fmt(ms)
end
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
