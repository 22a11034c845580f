
local floor = math.floor
local function idiv(a, b)
  local q = floor(a / b)
  if q * b > a then q = q - 1 elseif (q + 1) * b <= a then q = q + 1 end
  return q
end
local function fmt(x) return string.format('%d', x) end
local function ttl_ms(us)
  local ms = idiv(us + 999, 1000)
  if ms < 1 then ms = 1 end
  return fmt(ms)
end
-- The furthest ahead of now a sanction's end is taken to lie, in microseconds: 100 years,
-- tollgate_engine's `MAX_DENY`. An end stored further ahead (set before denies were bounded)
-- reads as this, so that every figure answered and every value written stays below 2^53,
-- whole and positive.
local MAX_AHEAD = 3155760000000000
-- A time `t` no further ahead of `now` than `MAX_AHEAD`.
local function within(t, now)
  if t > now + MAX_AHEAD then return now + MAX_AHEAD end
  return t
end
-- A GCRA key's value (`<base>:v3`), tollgate_engine's `GcraState`: its TAT, the emission
-- interval it was written under, while the key has a block or a deny (at `<base>:pb`) when the
-- later of them ends (else 0), and when the key's run began (the check, charge or pause that
-- found its bucket full): `<tat>:<interval>:<until>:<since>`. A value of an earlier version,
-- `<tat>:<interval>[:<until>]`, reads with `since` 0. The lean check (`check_lean.lua`) reads a
-- key's sanctions only when `until` is ahead, so every script that writes the value keeps it
-- while it is ahead, and the key alive until then. Every script that reads or writes a GCRA
-- value does it with these functions. Answers false for a value that is none of these.
local function parse_tat(v)
  local t, i, u, s = string.match(v, '^(%d+):(%d+):?(%d*):?(%d*)$')
  if not t then return false, 0, 0, 0 end
  return tonumber(t), tonumber(i), tonumber(u) or 0, tonumber(s) or 0
end
-- A key's value (`parse_tat`); false for a key with none.
local function read_tat(key)
  local v = redis.call('GET', key)
  if not v then return false, 0, 0, 0 end
  return parse_tat(v)
end
-- The value to write at `now`, and its TTL in milliseconds: the key lives until its TAT and
-- `hint` (its sanctions' end, kept while ahead) are both past; false when they are.
local function tat_value(tat, interval, hint, since, now)
  if not tat or tat < now then tat = 0 end
  hint = within(hint, now)
  local last = tat
  if hint > now then
    if hint > last then last = hint end
  else
    hint = 0
  end
  if last <= now then return false, nil end
  return fmt(tat) .. ':' .. fmt(interval) .. ':' .. fmt(hint) .. ':' .. fmt(since), ttl_ms(last - now)
end
-- Writes a GCRA key's value at `now` (`tat_value`), or deletes it when it need not live.
local function write_tat(key, tat, interval, hint, since, now)
  local v, ms = tat_value(tat, interval, hint, since, now)
  if v then
    redis.call('SET', key, v, 'PX', ms)
  else
    redis.call('DEL', key)
  end
end
-- The run of a TAT moved at `now` over one that was `tat` in run `since`
-- (tollgate_engine's `GcraState::moved`): the same while `tat` is ahead, else one from now.
local function run_of(tat, since, now)
  if tat and tat > now then return since end
  return now
end
-- tollgate_engine::algorithm::gcra_carry: a TAT stored under the interval `from`, counted in
-- the interval `to` at `now`: now + ceil((tat - now) / from) * to, at most MAX_PERIOD ahead.
-- Every figure below 2^53 is exact; a product above the cap may round, but never to the other
-- side of it. (`MAX_AHEAD` above is MAX_PERIOD too: 100 years.)
local function carry(tat, from, to, now)
  if (not tat) or tat <= now or from == to or from == 0 then return tat end
  local d = tat - now
  local used = idiv(d, from)
  if used * from < d then used = used + 1 end
  local ahead = used * to
  if ahead > MAX_AHEAD then ahead = MAX_AHEAD end
  return now + ahead
end
-- The TAT a refund of `units` leaves, or false when it gives nothing back
-- (tollgate_engine's `algorithm::gcra_refund`): for the reservation that a check at `at` left
-- at `mark`, on a TAT `tat` written under `from` (`carried`: counted in the settle's interval
-- `interval`) in the run that began at `since`, for a quota whose burst spans `span`. Only
-- within the check's run, when it frees the last reservation or nobody waits, by the part of
-- the reservation still ahead of now; with no time (`at` 0), only on the exact mark.
local function refunded(tat, from, carried, since, interval, span, units, at, mark, now)
  if not carried or carried <= now then return false end
  local last = mark ~= 0 and from == interval and tat == mark
  local applies = last
  if at ~= 0 then applies = since <= at and (last or carried - span <= now) end
  local back = interval * units
  if mark - now < back then back = mark - now end
  if not applies or back <= 0 then return false end
  local t = carried - back
  if t < now then t = now end
  return t
end
