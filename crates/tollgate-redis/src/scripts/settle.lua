
local k = 1
for i = 0, (#ARGV - 1) / 7 - 1 do
  local a = 2 + i * 7
  local algo, refund, charge = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local x, y, z, w = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local key = KEYS[k]
  if algo == 1 then
    -- x: the interval, y: the burst's span, z: the TAT the check left, w: the check's time.
    k = k + 1
    local stored, from, hint, since = read_tat(key)
    -- Written under another quota: the units used, at this quota's interval, whole (a debt
    -- is kept across plans).
    local tat = carry(stored, from, x, now)
    if refund > 0 then
      local back = refunded(stored, from, tat, since, x, y, refund, w, z, now)
      if back then write_tat(key, back, x, hint, since, now) end
    elseif charge > 0 then
      local base = now
      if tat and tat > now then base = tat end
      local cap = now + 2 * y
      if cap < base then cap = base end
      local new = base + x * charge
      if new > cap then new = cap end
      write_tat(key, new, x, hint, run_of(tat, since, now), now)
    end
  elseif algo == 2 then
    k = k + 1
    if now < x then
      if refund > 0 then
        local count = tonumber(redis.call('GET', key) or '')
        if count ~= nil then
          if count <= refund then redis.call('DEL', key) else redis.call('DECRBY', key, refund) end
        end
      elseif charge > 0 then
        redis.call('INCRBY', key, charge)
        redis.call('PEXPIRE', key, ttl_ms(x - now))
      end
    end
  elseif algo == 3 then
    local seq_key = KEYS[k + 1]
    k = k + 2
    if refund > 0 then
      log_units('ZREM', key, fmt(x), y - refund + 1, y)
    elseif charge > 0 then
      -- x: how long the log keeps an entry (the longest period of the limit's quotas); the
      -- units of this quota's period (z) are those it counts.
      redis.call('ZREMRANGEBYSCORE', key, '-inf', now - x)
      local alive = redis.call('ZCOUNT', key, '(' .. fmt(now - z), '+inf')
      local more = charge
      if alive + more > w then more = w - alive end
      if more > 0 then
        local last = redis.call('INCRBY', seq_key, more)
        log_units('ZADD', key, fmt(now), last - more + 1, last)
        if x > z then redis.call('ZREMRANGEBYRANK', key, 0, -LOG_ENTRIES - 1) end
        redis.call('PEXPIRE', key, ttl_ms(x))
        redis.call('PEXPIRE', seq_key, ttl_ms(x))
      end
    end
  end
end
return 1
