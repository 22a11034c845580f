-- The reports of refused identities: per limit and bucket, a sorted set of counts (KEYS[1])
-- and a hash of `<error>:<first seen>:<last seen>` per identity (KEYS[2]).
--
-- ARGV[1] == 'merge': ARGV[2] keep, ARGV[3] the keys' life in milliseconds, then five
-- arguments per identity: identity, count, error, first seen, last seen (microseconds). Adds
-- them, keeps the `keep` largest counts, and sets both keys' life.
-- ARGV[1] == 'read': KEYS[3], KEYS[4] are the previous bucket's; answers per bucket its
-- counts (identity, score, ...) and the hash's values in the same order.
local function fmt(x) return string.format('%d', x) end
if ARGV[1] == 'merge' then
  local keep = tonumber(ARGV[2])
  for i = 4, #ARGV, 5 do
    local id = ARGV[i]
    redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], id)
    local err, first, last = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local seen = redis.call('HGET', KEYS[2], id)
    if seen then
      local e, f, l = string.match(seen, '^(%d+):(%d+):(%d+)$')
      if e then
        err = err + tonumber(e)
        first = math.min(first, tonumber(f))
        last = math.max(last, tonumber(l))
      end
    end
    redis.call('HSET', KEYS[2], id, fmt(err) .. ':' .. fmt(first) .. ':' .. fmt(last))
  end
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
