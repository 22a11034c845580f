-- The reports of refused identities: per limit and bucket, a sorted set of counts (KEYS[1])
-- and a hash of `<error>:<first seen>:<last seen>` per identity (KEYS[2]).
--
-- ARGV[1] == 'merge': ARGV[2] keep, ARGV[3] the keys' life in milliseconds, then five
-- arguments per identity: identity, count, error, first seen, last seen (microseconds). Adds
-- each to the summary as Space-Saving does (a known identity adds to its counter; a new one
-- takes a free counter, or, once `keep` are taken, the smallest, whose count it inherits as
-- its error), so that a count is never below the truth and over-counts by at most its error;
-- and sets both keys' life.
-- ARGV[1] == 'read': KEYS[3], KEYS[4] are the previous bucket's; answers per bucket its
-- counts (identity, score, ...) and the hash's values in the same order.
local function fmt(x) return string.format('%d', x) end
if ARGV[1] == 'merge' then
  local keep = math.max(1, tonumber(ARGV[2]))
  for i = 4, #ARGV, 5 do
    local id = ARGV[i]
    local n = tonumber(ARGV[i + 1])
    local err, first, last = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    if redis.call('ZSCORE', KEYS[1], id) then
      redis.call('ZINCRBY', KEYS[1], fmt(n), id)
      local seen = redis.call('HGET', KEYS[2], id)
      local e, f, l
      if seen then e, f, l = string.match(seen, '^(%d+):(%d+):(%d+)$') end
      if e then
        err = err + tonumber(e)
        first = math.min(first, tonumber(f))
        last = math.max(last, tonumber(l))
      end
    elseif redis.call('ZCARD', KEYS[1]) < keep then
      redis.call('ZADD', KEYS[1], fmt(n), id)
    else
      -- Full: the identity takes the smallest counter and inherits its count as its error
      -- (Space-Saving), so that its count never falls below the truth.
      local least = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
      local floor = tonumber(least[2])
      redis.call('ZREM', KEYS[1], least[1])
      redis.call('HDEL', KEYS[2], least[1])
      redis.call('ZADD', KEYS[1], fmt(floor + n), id)
      err = err + floor
    end
    redis.call('HSET', KEYS[2], id, fmt(err) .. ':' .. fmt(first) .. ':' .. fmt(last))
  end
  -- A smaller `keep` than before (a reload) drops the smallest.
  local excess = redis.call('ZCARD', KEYS[1]) - keep
  if excess > 0 then
    local gone = redis.call('ZRANGE', KEYS[1], 0, excess - 1)
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
    for i = 1, #gone, 1000 do
      redis.call('HDEL', KEYS[2], unpack(gone, i, math.min(i + 999, #gone)))
    end
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return 1
end
local out = {}
for b = 0, 1 do
  local counts = redis.call('ZRANGE', KEYS[2 * b + 1], 0, -1, 'WITHSCORES')
  local ids = {}
  for i = 1, #counts, 2 do ids[#ids + 1] = counts[i] end
  local seen = {}
  if #ids > 0 then seen = redis.call('HMGET', KEYS[2 * b + 2], unpack(ids)) end
  out[b + 1] = {counts, seen}
end
return out
