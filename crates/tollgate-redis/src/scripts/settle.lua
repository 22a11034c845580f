
local k = 1
for i = 0, (#ARGV - 1) / 7 - 1 do
  local a = 2 + i * 7
  local algo, refund, charge = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local x, y, z, w = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local key = KEYS[k]
  if algo == 1 then
    k = k + 1
    local tat, from, hint = read_tat(key)
    if tat and from ~= 0 and from ~= x and tat > now then
      -- Written under another quota: the units used, at this quota's interval (as CHECK).
      local d = tat - now
      local used = idiv(d, from)
      if used * from < d then used = used + 1 end
      tat = now + used * x
      if tat > now + y then tat = now + y end
    end
    if not tat then tat = nil end
    -- z > 0: a lease's give-back, only while nothing has moved the TAT since its take.
    if refund > 0 and tat ~= nil and (z == 0 or tat == z) then
      write_tat(key, tat - x * refund, x, hint, now)
    elseif charge > 0 then
      local base = now
      if tat ~= nil and tat > now then base = tat end
      local cap = now + y
      if cap < base then cap = base end
      local new = base + x * charge
      if new > cap then new = cap end
      write_tat(key, new, x, hint, now)
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
