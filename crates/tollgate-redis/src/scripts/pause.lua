-- Holds a GCRA key back (tollgate_engine's `Backend::pause`): its TAT moves to at least
-- now + ARGV[1] + (ARGV[3] - 1) × ARGV[2] (the pause, the burst less one, the emission
-- interval), carried to that interval first, never back. KEYS[1]: the key's `:v3`.
-- Answers the server's time.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local key = KEYS[1]
local micros, interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local target = now + micros + interval * (burst - 1)
local tat, from, hint, since = read_tat(key)
tat = carry(tat, from, interval, now)
if not tat or tat < target then
  write_tat(key, target, interval, hint, run_of(tat, since, now), now)
end
return fmt(now)
