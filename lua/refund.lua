-- refund.lua: gives back what one slot group of a request took, from the
-- receipts lua/decide.lua returned for it.
--
-- Why: on a Redis Cluster a request whose keys live in several hash slots
-- is decided by one call of decide.lua per slot, each taking what an
-- allowed request takes. When the request as a whole is denied (or a
-- slot fails), what it took in the other slots must come back. The
-- consumption happened first, so until the refund runs those limits only
-- deny more: nothing is ever allowed over a limit.
--
-- A refund takes back exactly this request's share and never more: its own
-- log member, its own count in its own window, its own tokens less what
-- the bucket refilled since (which it might have wasted, full, had they
-- never been taken). It gives
-- back nothing when the state no longer holds them (the window rolled, the
-- member expired or is gone, the key expired), never goes past capacity or
-- below a fresh state, keeps every key's TTL and never creates a key.
--
-- Replays: removing a log member is idempotent when the member holds this
-- request alone; counters, buckets and GCRA are not (a second refund would
-- give back units of other requests). A refund must be sent at most once:
-- never retried after a timeout (only after NOSCRIPT, when it did not run).
-- A lost refund only denies more until the window passes.
--
-- KEYS[i]: the counter key of limit i, as decide.lua was given it
-- ARGV: the fields of REFUND_HEADER_FIELDS, then those of REFUND_FIELDS once
--       per limit, in the order of the tables below; the tables of the same
--       names in src/backends/redis/script.rs build them and say what each
--       holds (a test keeps both alike)
-- Returns: per limit, the units given back (in the receipt's units: scaled
--          tokens for token_bucket and gcra)
--
-- Runs after lua/common.lua (prepended when embedded): fmt, div,
-- refuse_layout, load_fields, wrap_sub, log_member, integer, named_args
-- and now_of are there. Defines `refund(keys, argv)`; the script calls it with KEYS and
-- ARGV, the function library registers it (src/backends/redis/script.rs).

local REFUND_HEADER_FIELDS = { 'now_us' }
local REFUND_FIELDS = { 'algorithm', 'window_us', 'capacity', 'per_us', 'scale', 'at_us', 'units' }

local function smaller(a, b)
  if a < b then
    return a
  end
  return b
end

-- Writes a smaller state over an existing key with the expiry it has: the
-- state needs no longer than the one it replaces (PTTL and SET PX rather
-- than KEEPTTL, which Redis 5 lacks).
local function rewrite_fields(key, s, fields)
  local out = {}
  for idx, name in ipairs(fields) do
    out[idx] = fmt(s[name])
  end
  local ttl = call('PTTL', key)
  if ttl > 0 then
    call('SET', key, concat(out, ':'), 'PX', fmt(ttl))
  else
    call('SET', key, concat(out, ':'))
  end
end

-- === fixed_window ===

-- A refund's read-only pass over a string state: refused (load_fields)
-- when in no layout it reads.
local function check_fields(r, key)
  load_fields(key, r.algorithm.fields)
end

local fixed = { fields = { 'window_start', 'count' } }

-- The count of the window the request was counted in; once that window is
-- over (rolled in the state, or only by the clock) its count no longer
-- matters and nothing comes back.
function fixed.refund(r, key, now)
  if now >= r.at_us + r.window_us then
    return 0
  end
  local s = load_fields(key, fixed.fields)
  if not s or s.window_start ~= r.at_us then
    return 0
  end
  local give = smaller(r.units, s.count)
  s.count = s.count - give
  if s.count == 0 then
    call('DEL', key)
  else
    rewrite_fields(key, s, fixed.fields)
  end
  return give
end

-- === sliding_window_counter ===

local counter = { fields = { 'window_start', 'current', 'previous' } }

-- The request's units are in `current` while its window is the stored one,
-- in `previous` once the next window began (they still weigh in there),
-- and nowhere after that.
function counter.refund(r, key, now)
  local s = load_fields(key, counter.fields)
  if not s then
    return 0
  end
  local slot
  if s.window_start == r.at_us then
    slot = 'current'
  elseif s.window_start == r.at_us + r.window_us then
    slot = 'previous'
  else
    return 0
  end
  local give = smaller(r.units, s[slot])
  s[slot] = s[slot] - give
  if s.current == 0 and s.previous == 0 then
    call('DEL', key)
  else
    rewrite_fields(key, s, counter.fields)
  end
  return give
end

-- === token_bucket and gcra ===
--
-- Had the request never come, its tokens would have stayed in the bucket
-- only until the bucket filled up: the refill since the decision may have
-- gone into the room the request left, where without it the bucket would
-- have been full and wasted it. That refill is at most `elapsed * per_us`,
-- whatever other requests (and refunds of them) did meanwhile, so giving
-- back `units - elapsed * per_us` never leaves more than "as if the
-- request never happened". For a token bucket `elapsed` runs to the
-- state's last update (the refill after it is applied later, to both
-- alike): exact when nobody touched the key in between. GCRA stores no
-- such time: `elapsed` runs to now, so a refund a few ms after its
-- decision gives back the cost less those ms of refill.
local function refund_less_refill(r, until_us)
  if until_us <= r.at_us or r.per_us == 0 then
    return r.units
  end
  local elapsed = until_us - r.at_us
  if elapsed >= div(r.units, r.per_us) + 1 then
    return 0
  end
  return r.units - elapsed * r.per_us
end

local bucket = { fields = { 'scaled', 'last_us', 'scale', signed = true } }

function bucket.refund(r, key, now)
  local s = load_fields(key, bucket.fields)
  if not s or s.scale ~= r.scale or s.last_us < r.at_us then
    return 0
  end
  local full = r.capacity * r.scale
  local give = smaller(refund_less_refill(r, s.last_us), full - s.scaled)
  if give <= 0 then
    return 0
  end
  s.scaled = s.scaled + give
  if s.scaled == full then
    -- A full bucket is a fresh one (decide.lua deletes it too).
    call('DEL', key)
  else
    rewrite_fields(key, s, bucket.fields)
  end
  return give
end

local gcra = { fields = { 'tat_us', 'frac', 'per_us' } }

-- Scaled units the arrival time is ahead of `now`.
local function gcra_debt(s, now)
  if s.tat_us < now then
    return 0
  end
  return (s.tat_us - now) * s.per_us + s.frac
end

-- The arrival time moves back by what is given (never behind now: a debt
-- of 0 is a fresh state, and the key goes).
function gcra.refund(r, key, now)
  local s = load_fields(key, gcra.fields)
  if not s or s.per_us ~= r.per_us or r.per_us == 0 then
    return 0
  end
  local debt = gcra_debt(s, now)
  local give = smaller(refund_less_refill(r, now), debt)
  if give <= 0 then
    return 0
  end
  debt = debt - give
  if debt == 0 then
    call('DEL', key)
    return give
  end
  local whole = div(debt, r.per_us)
  s.tat_us = now + whole
  s.frac = debt - whole * r.per_us
  rewrite_fields(key, s, gcra.fields)
  return give
end

-- === sliding_window_log ===

local log = {}

-- The member at the request's score holds its units (and those of other
-- requests in the same µs): take them out of it, removing it when they were
-- all of it, and lower the running totals of every later member by them,
-- so the window's sum (newest total minus the total before the oldest
-- entry) drops by exactly the request's cost. Later members are at most the
-- log's cap. A member out of the window counts for nothing: left alone.
-- What a refund of `r` rewrites: the request's member, its running total
-- and cost, and the later members; nil when nothing comes back. Every
-- later member is read, and refused unless of this layout, before
-- anything is written: a refused refund changes nothing.
local function log_find(r, key, now)
  local back = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
  if not back[1] then
    return nil
  end
  local at = tonumber(back[2])
  if now > at then
    at = now
  end
  if r.at_us <= at - r.window_us then
    return nil
  end
  local mine = call('ZRANGEBYSCORE', key, fmt(r.at_us), fmt(r.at_us))
  if not mine[1] then
    return nil
  end
  local e, cost = log_member(mine[1])
  if not e or cost < r.units then
    return nil
  end
  local later = call('ZRANGEBYSCORE', key, '(' .. fmt(r.at_us), '+inf', 'WITHSCORES')
  for idx = 1, #later, 2 do
    if not log_member(later[idx]) then
      refuse_layout(key, 'log member ' .. later[idx])
    end
  end
  return mine[1], e, cost, later
end

log.check = log_find

function log.refund(r, key, now)
  local mine, e, cost, later = log_find(r, key, now)
  if not mine then
    return 0
  end
  -- Each new member is added before the old one goes, so the key (and its
  -- TTL) never disappears half-way; ends stay distinct, as they all move
  -- down together.
  if cost > r.units then
    call('ZADD', key, fmt(r.at_us), fmt(wrap_sub(e, r.units)) .. ',' .. fmt(cost - r.units))
  end
  call('ZREM', key, mine)
  for idx = 1, #later, 2 do
    local le, lc = log_member(later[idx])
    call('ZADD', key, later[idx + 1], fmt(wrap_sub(le, r.units)) .. ',' .. fmt(lc))
    call('ZREM', key, later[idx])
  end
  return r.units
end

-- === the refund ===

local ALGORITHMS = {
  sliding_window_log = log,
  token_bucket = bucket,
  gcra = gcra,
  sliding_window_counter = counter,
  fixed_window = fixed,
}

-- Validates every argument before anything is read or written.
local function parse_receipts(keys, argv)
  local n = #keys
  local expected = #REFUND_HEADER_FIELDS + #REFUND_FIELDS * n
  if #argv ~= expected then
    return nil, 'ERR throttlegate: expected ' .. fmt(expected) .. ' arguments'
  end
  local out = {}
  for idx = 1, n do
    local arg = named_args(argv, REFUND_FIELDS, #REFUND_HEADER_FIELDS + #REFUND_FIELDS * (idx - 1) + 1)
    local r = { algorithm = ALGORITHMS[arg.algorithm] }
    for _, name in ipairs(REFUND_FIELDS) do
      if name ~= 'algorithm' then
        r[name] = integer(arg[name])
        if r[name] == nil then
          return nil, 'ERR throttlegate: bad receipt for limit ' .. fmt(idx)
        end
      end
    end
    if r.algorithm == nil or r.window_us == 0 or r.scale == 0 then
      return nil, 'ERR throttlegate: bad receipt for limit ' .. fmt(idx)
    end
    out[idx] = r
  end
  return out
end

-- The refund of one request: `keys` and `argv` as KEYS and ARGV.
local function refund(keys, argv)
  local receipts, problem = parse_receipts(keys, argv)
  if not receipts then
    return redis.error_reply(problem)
  end
  local header = named_args(argv, REFUND_HEADER_FIELDS, 1)
  local now = now_of(header.now_us)
  if now == nil then
    return redis.error_reply('ERR throttlegate: bad time')
  end

  -- Every key is read first, and a state in no layout it reads refused,
  -- before any refund is written: a refused refund changes no key.
  for idx, r in ipairs(receipts) do
    if r.units > 0 then
      (r.algorithm.check or check_fields)(r, keys[idx], now)
    end
  end
  local reply = {}
  for idx, r in ipairs(receipts) do
    local given = 0
    if r.units > 0 then
      given = r.algorithm.refund(r, keys[idx], now)
    end
    reply[idx] = given
  end
  return reply
end
