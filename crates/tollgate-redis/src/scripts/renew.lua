
local ttl = tonumber(ARGV[2])
if redis.call('ZADD', KEYS[1], 'XX', 'CH', fmt(now + ttl), ARGV[3]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms(ttl))
end
return 1
