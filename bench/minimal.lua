-- The yardstick of bench/redis-script.sh and bench/h2load.sh: the smallest
-- sliding log worth the name (TIME, drop what left the window, count, add
-- and expire when there is room). KEYS[1]; ARGV: window µs, limit.
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
local window, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now - window))
if redis.call('ZCARD', KEYS[1]) < limit then
  local member = string.format('%d', now)
  redis.call('ZADD', KEYS[1], member, member)
  redis.call('PEXPIRE', KEYS[1], string.format('%d', window / 1000))
  return 1
end
return 0
