-- decide.lua: decides one rate-limit request over all of its limits.
--
-- Why a script: the request must be decided atomically. Every limit is
-- read and checked first, and only then are costs consumed, all or
-- nothing; Redis runs a script without interleaving other commands, so no
-- other replica can consume between our check and our write, and no key can
-- expire half-way through. A denied request consumes nothing, except in
-- the limits charged always (LIMIT_FIELDS' charge): those take the cost
-- whatever the verdict, into debt up to one capacity.
--
-- This is src/algorithms/*.rs ported line for line; both backends must give
-- the same answers for the same clock. Lua numbers are IEEE doubles: every
-- value kept here is an integer below 2^53 (LimitParams::new guarantees the
-- ranges), divisions go through `div`, and integers are formatted with
-- `fmt` (concatenating a number would use %.14g and mangle µs timestamps).
--
-- KEYS[i]: the counter key of limit i (i = 1..n), all distinct within a
--          request
-- ARGV: the fields of HEADER_FIELDS, then one argument per limit: the
--          fields of LIMIT_FIELDS joined by ':', in the order of the tables
--          below; HEADER_FIELDS and LIMIT_FIELDS in
--          src/backends/redis/script.rs build them and say what each holds
--          (a test keeps both alike)
-- Returns: one string of signed 64-bit big-endian integers: allowed, then
--          per limit flags, remaining, reset_us. allowed is 0 or 1, flags is
--          has_room + 2 * consumed (each 0 or 1); remaining is below 0 when
--          the limit was charged past its room: minus the units past it
--          (nothing remains then); with the header's
--          receipts = 1 (a slot group of a request over several Cluster
--          slots, see `run`), each limit's three are followed by its
--          receipt: at_us, units (see `receipt` below and lua/refund.lua,
--          which takes them back), then the remaining and reset_us it
--          reports if the request is denied after all. One string rather than an array of integers: the
--          client reads it with one length instead of parsing every
--          integer, and Redis writes it as one bulk reply. A batch
--          (`decide_batch`) answers each request's section in turn; a
--          request it refuses (bad parameters, bad header) or fails on (a
--          Redis error on its keys) answers -1 and the reason instead (k
--          for its limit k, 0 for its header, -1 for an error while
--          deciding it; see REFUSED below), and the others are decided.
--
-- Nothing kept between calls is read before the call writes it: the
-- tables reused from call to call (`single`, the reply, `states`...) are
-- filled for the request's own n limits before any is read, and `run`
-- reads n from the request, so a call that failed half-way changes no
-- later call's answer.
--
-- The work per limit is a few reads and writes (for a log O(log n) each,
-- plus at most LOG_EXPIRE_MAX expired members removed): never a pass over
-- a log, whatever the cost.
--
-- State per key (a key that would equal a fresh state is deleted):
--   sliding_window_log      sorted set, one member "<end>,<cost>" per
--                           allowed request (requests in one µs share one),
--                           score = µs; <end> is the key's running total of
--                           units through that entry, modulo 2^53 (see the
--                           section below)
--   token_bucket, gcra, sliding_window_counter, fixed_window: a string of
--                           integers joined by ':', the algorithm's `fields`
--                           in order (bucket.fields and so on, below)
--
-- Runs after lua/common.lua (prepended when embedded): fmt, div,
-- refuse_layout, load_fields, wrap_sub, log_member, integer, named_args,
-- positions and now_of are there. Defines `decide(keys, argv)` and `decide_batch(keys,
-- argv)`; the scripts call one with KEYS and ARGV, the function library
-- registers both (src/backends/redis/script.rs).

-- The arguments, in order: the header's fields, then each limit's; a
-- batch starts with BATCH_FIELDS, and each of its requests with
-- REQUEST_FIELDS before its header.
local BATCH_FIELDS = { 'requests' }
local REQUEST_FIELDS = { 'limits' }
local HEADER_FIELDS = { 'now_us', 'grace_ms', 'receipts' }
local LIMIT_FIELDS = {
  'algorithm', 'limit', 'window_us', 'capacity', 'per_us', 'scale', 'cost', 'mode', 'charge',
}

-- Expired log members removed per limit and call (see log.advance).
local LOG_EXPIRE_MAX = 32
-- The header's grace_ms, read before any limit is looked at.
local grace_ms = 0

-- ceil(a / b), same ranges.
local function div_ceil(a, b)
  local q = div(a, b)
  if q * b < a then
    q = q + 1
  end
  return q
end

-- floor(a * b / c) for integers below 2^53 even when a * b is not: long
-- multiplication over the bits of b keeping the remainder below c. A result
-- of 2^53 or more is only guaranteed to come back as >= 2^53.
local function mul_div(a, b, c)
  local p = a * b
  if p < TWO53 then
    return div(p, c)
  end
  local q = div(a, c) * b
  local x = a - div(a, c) * c
  local bits = {}
  local rest = b
  while rest > 0 do
    local half = div(rest, 2)
    bits[#bits + 1] = rest - half * 2
    rest = half
  end
  local hi, r = 0, 0
  for idx = #bits, 1, -1 do
    -- (hi, r) = 2 * (hi, r), with r kept below c without forming 2r >= 2^53
    hi = hi * 2
    if r >= c - r then
      r = r - (c - r)
      hi = hi + 1
    else
      r = r + r
    end
    if bits[idx] == 1 then
      if r >= c - x then
        r = r - (c - x)
        hi = hi + 1
      else
        r = r + x
      end
    end
  end
  return q + hi
end

-- Each layout's text in one format: '%d:%d' and '%d:%d:%d'.
local STATE_FORMATS = { [2] = '%d:%d', [3] = '%d:%d:%d' }

local function store_fields(key, s, fields, ttl_ms)
  local value = format(STATE_FORMATS[#fields], s[fields[1]], s[fields[2]], s[fields[3]])
  call('SET', key, value, 'PX', fmt(ttl_ms))
end

-- max(a, b): effective times never move backwards.
local function later(a, b)
  if a > b then
    return a
  end
  return b
end

-- What is left of `limit` once `used` is taken, never below 0.
local function room_left(limit, used)
  if limit > used then
    return limit - used
  end
  return 0
end

-- The start of the window of length `window` that holds `now`.
local function window_start_of(now, window)
  return now - (now - div(now, window) * window)
end

-- === sliding_window_log ===
--
-- One member per allowed request, "<end>,<cost>" scored by its µs, where
-- <end> is a running total of the units this key has taken, through this
-- request, wrapping at 2^53. Requests in the same µs share one member (its
-- cost is their sum), as the memory backend keeps them. The units in the
-- window are the newest end minus the end before the oldest entry in the
-- window (its end minus its cost), so a request reads two members whatever
-- the log holds, and a request's cost is one member whatever its size. The
-- totals of the members present span at most one limit (< 2^53), so the
-- wrapped differences are exact and no two members share an end: members
-- are unique without math.random.
--
-- Why not a separate sum key or a counter member: each limit keeps its
-- whole state in its one key (a Cluster script may touch only its declared
-- keys), and a stored sum would have to be corrected for every expired
-- entry, reading each of them; the running totals make expiry a removal by
-- rank that reads nothing, and find the entry a denied request waits for by
-- binary search over ranks.

local log = {}

-- a + b and a - b modulo 2^53, for 0 <= a, b < 2^53, without forming a
-- value at or above 2^53.
local function wrap_add(a, b)
  if a >= TWO53 - b then
    return a - (TWO53 - b)
  end
  return a + b
end

-- The units of a member by its stored layout: layout 1 (this one,
-- "<end>,<cost>") holds its cost; layout 0 ("<µs>:<seq>", one member per
-- unit, written by versions before the running totals) holds one. nil for
-- a member of neither: no version wrote it, and it is never guessed at.
local function log_units(member)
  local _, cost = log_member(member)
  if cost then
    return cost
  end
  if match(member, '^%d+:%d+$') then
    return 1
  end
  return nil
end

-- The most members of a log holding layout 0 that are read to convert it
-- exactly (each is read once).
local LOG_CONVERT_MAX = 1024

-- Writes a log of layout 1 in place of `key`'s: one member per entry of
-- `scores` with the units of `costs`, the running totals starting over,
-- the expired members gone with the old key (UNLINK).
local function log_rewrite(c, key, at, scores, costs)
  call('UNLINK', key)
  local n = #scores
  if n == 0 then
    return
  end
  local args, running = {}, 0
  for idx = 1, n do
    running = running + costs[idx]
    args[2 * idx - 1] = fmt(scores[idx])
    args[2 * idx] = format('%d,%d', running, costs[idx])
  end
  call('ZADD', key, unpack(args))
  call('PEXPIRE', key, fmt(div_ceil(scores[n] + c.window_us - at, 1000) + grace_ms))
end

-- The units of one end of the window (a member and its score, as
-- ZRANGE WITHSCORES gives them); a member of neither layout is refused.
local function end_units(key, it)
  local units = log_units(it[1])
  if not units then
    refuse_layout(key, 'log member ' .. it[1])
  end
  return units
end

-- A log holding members of layout 0 (alone, or among members of layout 1
-- when versions of both layouts shared it) is rewritten in layout 1, before
-- the request writes anything. Up to LOG_CONVERT_MAX members in the
-- window: every member keeps its time and its units exactly (members of
-- one µs become one). More (counted first, with ZCOUNT, so that no more
-- are read): the window's units become one member at the newest score,
-- held until the newest leaves, never fewer than were there: every member
-- counts one unit, the two ends their own (a member of layout 1 hidden
-- among so many of layout 0 counts one). A member of neither layout is
-- refused.
local function log_convert(c, key, at)
  local from = '(' .. fmt(at - c.window_us)
  local count = call('ZCOUNT', key, from, '+inf')
  if count > LOG_CONVERT_MAX then
    local first = call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES', 'LIMIT', '0', '1')
    local back = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
    local units = count - 2 + end_units(key, first) + end_units(key, back)
    log_rewrite(c, key, at, { tonumber(back[2]) }, { units })
    return
  end
  local members = call('ZRANGEBYSCORE', key, from, '+inf', 'WITHSCORES')
  local scores, costs, total = {}, {}, 0
  for idx = 1, #members, 2 do
    local units = log_units(members[idx])
    if not units then
      refuse_layout(key, 'log member ' .. members[idx])
    end
    local score, last = tonumber(members[idx + 1]), #scores
    if last > 0 and scores[last] == score then
      costs[last] = costs[last] + units
    else
      scores[last + 1], costs[last + 1] = score, units
    end
    total = total + units
  end
  if total >= TWO53 then
    refuse_layout(key, 'more than 2^53 units in the window')
  end
  log_rewrite(c, key, at, scores, costs)
end

-- An empty log. Every field is in the constructor, false where unknown
-- yet: a field added later would grow the table. The log reads its state
-- in `advance`.
function log.fresh(c, now)
  return {
    total = 0, newest = false, newest_end = 0, newest_cost = 0, base = 0, stale = 0,
    oldest = 0, oldest_cost = 0, deferred = false, unwritten = false, written = false,
  }
end

-- Within a batch (`deferred`), the newest entry is written when it is
-- final rather than at each request: the batch's requests share one µs
-- under the server's clock, and each would otherwise replace the member
-- the one before wrote. `unwritten`: the newest entry of the state is not
-- in Redis yet; `written`: the member it replaces there (same score), or
-- false. Written before anything reads the log's members (`until_available`,
-- a new `advance`) and when the batch ends (`store`).
function log.sync(s, key)
  if not s.unwritten then
    return
  end
  if s.written then
    call('ZREM', key, s.written)
  end
  call('ZADD', key, fmt(s.newest), format('%d,%d', s.newest_end, s.newest_cost))
  s.unwritten, s.written = false, false
end

-- Reads the log's two ends in the window (after removing expired
-- members). A log holding members of layout 0 is converted first
-- (log_convert), then read again (`converted`: once), so that no member of
-- layout 0 is met once the request writes. One hides between two ends of
-- layout 1 when the window holds more members than its running totals
-- leave room for: the members between the ends hold the units between
-- them, one at least each. Exact with costs of one, the only costs a
-- version of layout 0 counts right; a member hidden among costs above one
-- counts for nothing, and `until_available` never needs to read it.
function log.advance(c, s, key, now, converted)
  local back = call('ZRANGE', key, '-1', '-1', 'WITHSCORES')
  if not back[1] then
    return now
  end
  local newest = tonumber(back[2])
  local at = later(now, newest)
  local newest_end, newest_cost = log_member(back[1])
  if newest_end == nil and not converted then
    -- Not layout 1: converted (layout 0) or refused; then read as such.
    end_units(key, back)
    log_convert(c, key, at)
    return log.advance(c, s, key, now, true)
  end
  -- An entry at `ts` counts while `ts > at - W`. Usually the oldest member
  -- still does: then nothing expired and it is the front, one read. Else at
  -- most LOG_EXPIRE_MAX expired members are removed per call, so a request
  -- meeting a whole expired log (or 64 of them) stays quick; the rest are
  -- skipped by rank here and removed by the next calls or with the key.
  local horizon = at - c.window_us
  local front = call('ZRANGE', key, '0', '0', 'WITHSCORES')
  local oldest = tonumber(front[2])
  local stale = 0
  if oldest <= horizon then
    stale = call('ZCOUNT', key, '-inf', fmt(horizon))
    local drop = stale
    if drop > LOG_EXPIRE_MAX then
      drop = LOG_EXPIRE_MAX
    end
    call('ZREMRANGEBYRANK', key, '0', fmt(drop - 1))
    stale = stale - drop
    front = call('ZRANGE', key, fmt(stale), fmt(stale), 'WITHSCORES')
    if not front[1] then
      s.stale = stale
      return at
    end
    oldest = tonumber(front[2])
  end
  s.stale = stale
  local oldest_end, oldest_cost = log_member(front[1])
  local total = oldest_end and newest_end and wrap_sub(newest_end, wrap_sub(oldest_end, oldest_cost))
  local count = total and call('ZCARD', key) - stale
  if not converted and (not total or count > 1 and count > 2 + total - oldest_cost - newest_cost) then
    -- Both layouts wrote the log: converted whole, then read again.
    log_convert(c, key, at)
    return log.advance(c, s, key, now, true)
  end
  if not total then
    -- Only after a conversion, which writes layout 1 alone.
    refuse_layout(key, 'log member ' .. (oldest_end and back[1] or front[1]))
  end
  s.oldest = oldest
  s.oldest_cost = oldest_cost
  s.base = wrap_sub(oldest_end, oldest_cost)
  s.total = total
  s.newest = newest
  s.newest_end = newest_end
  s.newest_cost = newest_cost
  return at
end

-- The state an earlier request of the same batch left, carried on without
-- reading the log again: its newest and oldest entries are known (consume
-- keeps them), so while the oldest is still in the window nothing has
-- expired and the state is what `advance` would read. nil when something
-- may have left the window, or expired members wait past LOG_EXPIRE_MAX:
-- then the caller reads the log (every member is written at once, only
-- the expiry waits for the batch's end).
function log.resume(c, s, now)
  if s.stale ~= 0 or not s.newest then
    return nil
  end
  local at = later(now, s.newest)
  if s.oldest <= at - c.window_us then
    return nil
  end
  return at
end

function log.available(c, s, at)
  return room_left(c.limit, s.total)
end

function log.debt_room(c, s, at)
  return room_left(c.limit + c.debt, s.total)
end

function log.consume(c, s, key, at, cost)
  if s.total == 0 then
    -- The entry written here becomes the window's oldest too.
    s.newest_end = 0
    s.base = 0
    s.oldest = at
    s.oldest_cost = 0
  end
  -- One member per timestamp: a request in the same µs as the newest entry
  -- joins it. Members of one score are ordered by their bytes, not by
  -- insertion, so distinct scores are what keeps ranks in running-total
  -- order (for the binary search) and the last rank the newest entry.
  local entry_cost = cost
  if s.newest == at then
    if not s.unwritten then
      s.written = format('%d,%d', s.newest_end, s.newest_cost)
    end
    entry_cost = s.newest_cost + cost
  else
    log.sync(s, key)
  end
  s.newest_end = wrap_add(s.newest_end, cost)
  s.newest_cost = entry_cost
  if s.oldest == at then
    -- The oldest entry is this one (grown, or new): its end and cost grow
    -- alike, so the base stays.
    s.oldest_cost = entry_cost
  end
  s.total = s.total + cost
  s.newest = at
  s.unwritten = true
  if not s.deferred then
    log.sync(s, key)
  end
end

function log.until_full(c, s, at)
  if not s.newest then
    return 0
  end
  return s.newest + c.window_us - at
end

function log.until_available(c, s, key, at, need)
  -- The oldest entries holding `expire` units must leave the window: the
  -- first entry whose running total (from the base) reaches it is the last
  -- to go. Binary search over ranks: O(log n) reads, never a scan.
  local expire = s.total + need - c.limit
  -- The usual cases need no search: one unit at a full log waits for the
  -- oldest entry, the whole limit for the newest.
  if expire <= s.oldest_cost then
    return s.oldest + c.window_us - at
  end
  if expire >= s.total then
    return s.newest + c.window_us - at
  end
  log.sync(s, key)
  local lo = s.stale + 1
  local hi = call('ZCARD', key) - 1
  while lo < hi do
    local mid = div(lo + hi, 2)
    local it = call('ZRANGE', key, fmt(mid), fmt(mid))
    local e = log_member(it[1])
    if e == nil then
      -- A member of layout 0 hidden among costs above one (see
      -- log.advance), met after this request may have written: never
      -- read as a total, never refused; every unit leaves with the newest.
      return s.newest + c.window_us - at
    end
    if wrap_sub(e, s.base) >= expire then
      hi = mid
    else
      lo = mid + 1
    end
  end
  local it = call('ZRANGE', key, fmt(lo), fmt(lo), 'WITHSCORES')
  return tonumber(it[2]) + c.window_us - at
end

-- This request's units: the member at its score (which it may share with
-- other requests of the same µs).
function log.receipt(c, s, at, cost)
  return at, cost
end

function log.store(s, key, ttl_ms)
  log.sync(s, key)
  call('PEXPIRE', key, fmt(ttl_ms))
end

-- === token_bucket ===

local bucket = {}

local function bucket_full(c)
  return c.capacity * c.scale
end

-- The level may be below 0: a debt (see load_fields).
bucket.fields = { 'scaled', 'last_us', 'scale', signed = true }

function bucket.fresh(c, now)
  return { scaled = bucket_full(c), last_us = now, scale = c.scale }
end

function bucket.advance(c, s, key, now)
  local at = later(now, s.last_us)
  local full = bucket_full(c)
  if s.scale ~= c.scale then
    -- A debt (a level below 0) is rescaled rounding toward 0, as a level.
    if s.scaled < 0 then
      s.scaled = -mul_div(-s.scaled, c.scale, s.scale)
    else
      s.scaled = mul_div(s.scaled, c.scale, s.scale)
    end
    s.scale = c.scale
  end
  -- Debt past what the limit may carry (c.debt: 0 unless charged always)
  -- is forgiven, so `missing` stays below 2^53.
  if s.scaled < -c.debt * c.scale then
    s.scaled = -c.debt * c.scale
  end
  -- min(scaled + elapsed * per_us, full) without forming a product that
  -- could exceed 2^53.
  local missing = full - s.scaled
  if missing <= 0 then
    s.scaled = full
  elseif c.per_us > 0 then
    local elapsed = at - s.last_us
    if elapsed >= div_ceil(missing, c.per_us) then
      s.scaled = full
    else
      s.scaled = s.scaled + elapsed * c.per_us
    end
  end
  s.last_us = at
  return at
end

function bucket.available(c, s, at)
  if s.scaled <= 0 then
    return 0
  end
  return div(s.scaled, c.scale)
end

-- Whole units that can still be taken before the debt reaches its floor.
function bucket.debt_room(c, s, at)
  local above = s.scaled + c.debt * c.scale
  if above <= 0 then
    return 0
  end
  return div(above, c.scale)
end

-- Past the level into debt only when charged always (within debt_room).
function bucket.consume(c, s, key, at, cost)
  s.scaled = s.scaled - cost * c.scale
end

-- When, and the scaled tokens taken: a refund gives back no more than
-- the bucket could still hold had they never been taken (lua/refund.lua).
function bucket.receipt(c, s, at, cost)
  return at, cost * c.scale
end

function bucket.until_full(c, s, at)
  local missing = bucket_full(c) - s.scaled
  if missing == 0 then
    return 0
  end
  return div_ceil(missing, c.per_us)
end

function bucket.until_available(c, s, key, at, need)
  return div_ceil(need * c.scale - s.scaled, c.per_us)
end

-- === gcra ===

local gcra = {}

-- How far the arrival time is ahead of `at`, in scaled token units.
local function gcra_debt(c, s, at)
  if s.tat_us < at then
    return 0
  end
  return (s.tat_us - at) * c.per_us + s.frac
end

gcra.fields = { 'tat_us', 'frac', 'per_us' }

function gcra.fresh(c, now)
  return { tat_us = 0, frac = 0, per_us = 0 }
end

function gcra.advance(c, s, key, now)
  if s.per_us ~= c.per_us then
    if s.per_us == 0 then
      s.frac = 0
    else
      s.frac = mul_div(s.frac, c.per_us, s.per_us)
    end
    s.per_us = c.per_us
  end
  if gcra_debt(c, s, now) == 0 then
    s.tat_us = 0
    s.frac = 0
  end
  return now
end

function gcra.available(c, s, at)
  local room = c.capacity * c.scale - gcra_debt(c, s, at)
  if room <= 0 then
    -- Only after a reload lowered the burst below the debt.
    return 0
  end
  return div(room, c.scale)
end

-- Whole units that can still be taken before the debt reaches the
-- capacity plus c.debt; (capacity + debt) * scale < 2^53 (LimitParams).
function gcra.debt_room(c, s, at)
  local room = (c.capacity + c.debt) * c.scale - gcra_debt(c, s, at)
  if room <= 0 then
    return 0
  end
  return div(room, c.scale)
end

function gcra.consume(c, s, key, at, cost)
  local debt = gcra_debt(c, s, at) + cost * c.scale
  local whole = div(debt, c.per_us)
  s.tat_us = at + whole
  s.frac = debt - whole * c.per_us
end

-- When, and the scaled units added to the debt.
function gcra.receipt(c, s, at, cost)
  return at, cost * c.scale
end

function gcra.until_full(c, s, at)
  local debt = gcra_debt(c, s, at)
  if debt == 0 then
    return 0
  end
  return div_ceil(debt, c.per_us)
end

function gcra.until_available(c, s, key, at, need)
  -- debt + need * scale - capacity * scale, ordered so that no step
  -- leaves 53 bits (need <= capacity here).
  local over = gcra_debt(c, s, at) - (c.capacity - need) * c.scale
  return div_ceil(over, c.per_us)
end

-- === sliding_window_counter ===

local counter = {}

-- floor(count * part / whole); count * part < 2^53 by LimitParams::new.
local function weighted(count, part, whole)
  return mul_div(count, part, whole)
end

-- Smallest elapsed ms e in [0, W] with floor(count * (W - e) / W) <= room.
local function first_elapsed_ms(count, room, window_ms)
  if count == 0 then
    return 0
  end
  local max_part = div((room + 1) * window_ms - 1, count)
  if max_part > window_ms then
    max_part = window_ms
  end
  return window_ms - max_part
end

counter.fields = { 'window_start', 'current', 'previous' }

function counter.fresh(c, now)
  return { window_start = 0, current = 0, previous = 0 }
end

function counter.advance(c, s, key, now)
  local window = c.window_us
  local start = window_start_of(now, window)
  if start > s.window_start then
    if start == s.window_start + window then
      s.previous = s.current
    else
      s.previous = 0
    end
    s.current = 0
    s.window_start = start
  end
  return later(now, s.window_start)
end

local function counter_estimate(c, s, at)
  local window_ms = div(c.window_us, 1000)
  local elapsed_ms = div(at - s.window_start, 1000)
  return s.current + weighted(s.previous, window_ms - elapsed_ms, window_ms)
end

function counter.available(c, s, at)
  return room_left(c.limit, counter_estimate(c, s, at))
end

function counter.debt_room(c, s, at)
  return room_left(c.limit + c.debt, counter_estimate(c, s, at))
end

function counter.consume(c, s, key, at, cost)
  s.current = s.current + cost
end

function counter.receipt(c, s, at, cost)
  return s.window_start, cost
end

-- Until the estimate is 0 for good: this window's count stops weighing in
-- the next window once floor(current * (W - e) / W) is 0; the previous
-- window's count stops weighing in this one likewise.
function counter.until_full(c, s, at)
  local window = c.window_us
  local window_ms = div(window, 1000)
  local target
  if s.current > 0 then
    target = s.window_start + window + first_elapsed_ms(s.current, 0, window_ms) * 1000
  elseif s.previous > 0 then
    target = s.window_start + first_elapsed_ms(s.previous, 0, window_ms) * 1000
  else
    return 0
  end
  if target > at then
    return target - at
  end
  return 0
end

-- Until the next window boundary after which neither count can weigh in,
-- however the clock moves (State::lifetime).
function counter.lifetime(c, s, at)
  local window = c.window_us
  if s.current > 0 then
    return s.window_start + 2 * window - at
  elseif s.previous > 0 then
    return s.window_start + window - at
  end
  return 0
end

function counter.until_available(c, s, key, at, need)
  local window = c.window_us
  local window_ms = div(window, 1000)
  local limit = c.limit
  -- Within this window the estimate only falls as the previous window's
  -- weight shrinks; otherwise wait for the next window, where this
  -- window's count becomes the weighted one.
  local start, weighed, room
  if s.current + need <= limit then
    start, weighed, room = s.window_start, s.previous, limit - need - s.current
  else
    start, weighed, room = s.window_start + window, s.current, limit - need
  end
  local target = start + first_elapsed_ms(weighed, room, window_ms) * 1000
  if target > at then
    return target - at
  end
  return 0
end

-- === fixed_window ===

local fixed = {}

fixed.fields = { 'window_start', 'count' }

function fixed.fresh(c, now)
  return { window_start = 0, count = 0 }
end

function fixed.advance(c, s, key, now)
  local start = window_start_of(now, c.window_us)
  if start > s.window_start then
    s.window_start = start
    s.count = 0
  end
  return later(now, s.window_start)
end

function fixed.available(c, s, at)
  return room_left(c.limit, s.count)
end

function fixed.debt_room(c, s, at)
  return room_left(c.limit + c.debt, s.count)
end

function fixed.consume(c, s, key, at, cost)
  s.count = s.count + cost
end

function fixed.receipt(c, s, at, cost)
  return s.window_start, cost
end

function fixed.until_full(c, s, at)
  if s.count == 0 then
    return 0
  end
  return s.window_start + c.window_us - at
end

function fixed.until_available(c, s, key, at, need)
  -- need <= limit, so the next window always has room.
  return s.window_start + c.window_us - at
end

-- === the request ===

local ALGORITHMS = {
  sliding_window_log = log,
  token_bucket = bucket,
  gcra = gcra,
  sliding_window_counter = counter,
  fixed_window = fixed,
}
local MODES = { enforce = true, shadow = true, quota = true }
-- Whether a limit takes its cost whatever the verdict (`Charge`).
local CHARGES = { if_allowed = false, always = true }

local function store(impl, s, key, ttl_ms)
  if impl.store then
    impl.store(s, key, ttl_ms)
  else
    store_fields(key, s, impl.fields, ttl_ms)
  end
end

-- What a batch's requests have left in each key they decided on, so that
-- a later request of the batch on the same key (a hot key: concurrent
-- requests with the same descriptor) neither reads the key again nor
-- writes it again: per key, the algorithm and the state as the last
-- request left it (false once the key was deleted), and the expiry
-- its store waits for (false when nothing waits). Only the last store of a
-- key is written, when the batch ends (`flush`); a deletion is written at
-- once. Nothing else runs while a script does, so what the batch writes at
-- its end is what writing after every request would have left.
local function flush_key(key, kept)
  if kept.ttl_ms then
    store(kept.impl, kept.state, key, kept.ttl_ms)
    kept.ttl_ms = false
  end
end

local function flush(seen)
  for idx = 1, #seen do
    local key = seen[idx]
    flush_key(key, seen[key])
  end
end

-- A key's state and the request's effective time. A string state is read
-- with one GET (`fresh` when the key is absent), a log reads its own in
-- `advance`; within a batch (`seen`), a key decided on before is carried
-- on from what that request left.
local function open(impl, c, key, now, seen)
  local kept = seen and seen[key]
  if kept then
    if kept.impl == impl then
      local s = kept.state
      if not s then
        -- Deleted: absent, as `advance` would find it.
        s = impl.fresh(c, now)
        if impl.resume then
          s.deferred = true
          return s, now
        end
        return s, impl.advance(c, s, key, now)
      end
      if not impl.resume then
        return s, impl.advance(c, s, key, now)
      end
      local at = impl.resume(c, s, now)
      if at then
        return s, at
      end
      impl.sync(s, key)
    else
      -- Another algorithm on the same key: what waits is written first, so
      -- the read below meets what the earlier request left.
      flush_key(key, kept)
    end
  end
  local s
  if impl.fields then
    s = load_fields(key, impl.fields) or impl.fresh(c, now)
  else
    s = impl.fresh(c, now)
    s.deferred = seen ~= nil
  end
  return s, impl.advance(c, s, key, now)
end

-- Writes a key's new state with its expiry, or deletes the key: at once
-- outside a batch; within one, a store waits for the batch's end.
local function keep(impl, s, key, ttl_ms, seen)
  if not seen then
    if ttl_ms then
      store(impl, s, key, ttl_ms)
    else
      call('DEL', key)
    end
    return
  end
  local kept = seen[key]
  if not kept then
    kept = { impl = impl, state = false, ttl_ms = false }
    seen[key] = kept
    seen[#seen + 1] = key
  end
  kept.impl = impl
  if ttl_ms then
    kept.state, kept.ttl_ms = s, ttl_ms
  else
    call('DEL', key)
    kept.state, kept.ttl_ms = false, false
  end
end

-- Units a check needs room for: a cost-0 check needs room for 1.
local function need_of(c)
  if c.cost < 1 then
    return 1
  end
  return c.cost
end

-- A cost is any non-negative integer (a uint64 from the wire arrives
-- rounded to a double). Costs above the capacity can never pass, and a
-- limit charged always records at most capacity + debt units: costs above
-- `most` are all alike and become most + 1 (< 2^53, exact, LimitParams),
-- so no arithmetic ever sees a larger one.
local function cost_of(raw, most)
  local n = tonumber(raw)
  if n == nil or n < 0 or n ~= floor(n) then
    return nil
  end
  if n > most then
    return most + 1
  end
  return n
end

-- Where each field sits in its layout, read once: arguments are taken by
-- position, with no table of names built per call. A limit is one
-- argument (N_LIMIT): its fields joined by ':' (no field of a valid limit
-- holds one: integers and names), split by LIMIT_PATTERN.
local N_BATCH, N_REQUEST = #BATCH_FIELDS, #REQUEST_FIELDS
local N_HEADER, N_LIMIT = #HEADER_FIELDS, 1
local H, L = positions(HEADER_FIELDS), positions(LIMIT_FIELDS)
local B, R = positions(BATCH_FIELDS), positions(REQUEST_FIELDS)
local LIMIT_PATTERN = '^([^:]*)' .. string.rep(':([^:]*)', #LIMIT_FIELDS - 1) .. '$'

-- One limit's fields, from its argument; nil when one is bad, or when
-- there are not exactly as many as LIMIT_FIELDS names.
local function parse_limit_fields(text)
  local f = { match(text, LIMIT_PATTERN) }
  if f[1] == nil then
    return nil
  end
  local capacity = integer(f[L.capacity])
  local always = CHARGES[f[L.charge]]
  -- The debt a limit may carry: a whole capacity when charged always.
  local debt = always and capacity or 0
  local c = {
    algorithm = ALGORITHMS[f[L.algorithm]],
    limit = integer(f[L.limit]),
    window_us = integer(f[L.window_us]),
    capacity = capacity,
    per_us = integer(f[L.per_us]),
    scale = integer(f[L.scale]),
    cost = capacity and cost_of(f[L.cost], capacity + debt),
    mode = f[L.mode],
    always = always,
    debt = debt,
  }
  if c.algorithm == nil or c.limit == nil or c.window_us == nil or not c.capacity
    or c.per_us == nil or c.scale == nil or not c.cost or not MODES[c.mode]
    or always == nil or c.window_us == 0 or c.scale == 0
    or c.capacity + debt >= TWO53 then
    return nil
  end
  return c
end

-- Limits already parsed, by their argument. The same few limits come
-- with nearly every call: in the function library, which lives as long as
-- the server, a limit seen before is neither split, converted nor
-- validated again (tonumber of each field was a good part of a call's
-- cost); as a script the table starts empty at each call. Only valid
-- limits are kept. Entries are shared, never written to, and the table is
-- emptied when it holds PARSED_MAX (costs vary from call to call).
local PARSED_MAX = 256
local parsed, n_parsed = {}, 0

local function parse_limit(argv, at)
  local text = argv[at + 1]
  local c = parsed[text]
  if c then
    return c
  end
  c = parse_limit_fields(text)
  if c then
    if n_parsed >= PARSED_MAX then
      parsed, n_parsed = {}, 0
    end
    parsed[text], n_parsed = c, n_parsed + 1
  end
  return c
end

-- One request's header and its `n` limits, argv[at + 1] on, validated
-- before anything is read or written: the header (its time, nil for the
-- server's; `n`, the one count of its checks that `run` reads) and the
-- checks, or nil, the error and its reason (REFUSED: k for limit k, 0 for
-- the header). Written into `into` when given, else a new table: the
-- whole header, n included, is written before it is returned, so what an
-- earlier call left (a failed one included) is never read; checks past
-- n may hold an earlier call's and are never looked at.
local function parse_request(argv, at, n, into)
  local checks = into and into.checks or {}
  for idx = 1, n do
    checks[idx] = parse_limit(argv, at + N_HEADER + N_LIMIT * (idx - 1))
    if not checks[idx] then
      return nil, 'ERR throttlegate: bad parameters for limit ' .. fmt(idx), idx
    end
  end
  local grace = integer(argv[at + H.grace_ms])
  if grace == nil then
    return nil, 'ERR throttlegate: bad expiry grace', 0
  end
  local flag = argv[at + H.receipts]
  if flag ~= '0' and flag ~= '1' then
    return nil, 'ERR throttlegate: bad receipts flag', 0
  end
  local now_us, now = argv[at + H.now_us], false
  if now_us ~= '' then
    now = integer(now_us)
    if now == nil then
      return nil, 'ERR throttlegate: bad time', 0
    end
  end
  if not into then
    return { grace_ms = grace, checks = checks, n = n, receipts = flag == '1', now = now, first = 0 }
  end
  into.grace_ms, into.n, into.receipts, into.now, into.first = grace, n, flag == '1', now, 0
  return into
end

-- The request of `decide` and its reply's sections: one call at a time on
-- a server, so in the library they are kept from call to call instead of
-- three tables per call (a call writes every field it reads, and the
-- reply is joined up to the call's own last section).
local single, single_reply = { checks = {}, n = 0 }, {}

-- The reply's integers by section: a request's first limit carries the
-- request's `allowed` in front, so every limit is one `pack` (each call
-- parses its format; two per limit cost a third more). struct.pack
-- ignores the values past its format: those of the receipt without one.
local REPLY_FORMATS = {
  [false] = { first = '>i8i8i8i8', next = '>i8i8i8' },
  [true] = { first = '>i8i8i8i8i8i8i8i8', next = '>i8i8i8i8i8i8i8' },
}

-- What `run` learns of limit idx between its check and its answer: its
-- state, effective time, whether it has room and the units it had. Kept
-- from call to call in the library (a run only reads entries it wrote
-- first), rather than four tables per call.
local states, effective_now, has_room, available = {}, {}, {}, {}

-- Decides one parsed request on keys[first + 1 .. first + n] at `now`,
-- writing its section into `reply` after its first `out` entries (one
-- packed string per limit): allowed, then per limit its flags, remaining
-- and reset_us (and the receipt when asked for); returns the new count.
-- `seen`: the batch's keys (see `open`), nil outside a batch.
local function run(keys, first, header, now, reply, seen, out)
  local checks = header.checks
  -- The request's own count: never #checks (a border of a table that
  -- may hold more), so nothing an earlier call left is ever decided.
  local n = header.n
  grace_ms = header.grace_ms
  -- Check every limit first.
  local enforced_ok, quota_seen, quota_ok = true, false, false
  for idx = 1, n do
    local c = checks[idx]
    local key = keys[first + idx]
    local s, at = open(c.algorithm, c, key, now, seen)
    local units = c.algorithm.available(c, s, at)
    local room = need_of(c) <= units
    states[idx], effective_now[idx], has_room[idx], available[idx] = s, at, room, units
    if c.mode == 'enforce' then
      enforced_ok = enforced_ok and room
    elseif c.mode == 'quota' then
      quota_seen = true
      quota_ok = quota_ok or room
    end
  end
  -- With receipts (one slot group of a request over several Cluster
  -- slots) the group does not rule on the request, whose quota limits
  -- may lie in other groups: it takes what an allowed request takes
  -- unless an enforcing limit here has no room (then the request is
  -- denied whatever the others say), and tells for each limit what it
  -- reports either way. The service rules on the whole request
  -- (src/algorithms/verdict.rs) and refunds the groups if it is denied.
  local allowed = enforced_ok and (header.receipts or quota_ok or not quota_seen)

  -- Then consume all or nothing (a limit charged always takes its cost
  -- whatever the verdict, into debt up to debt_room), and answer.
  local formats = REPLY_FORMATS[header.receipts]
  for idx = 1, n do
    local c = checks[idx]
    local key, s, at, room = keys[first + idx], states[idx], effective_now[idx], has_room[idx]
    local impl = c.algorithm
    local consumed = allowed and room and c.cost > 0
    local charged = 0
    if consumed then
      charged = c.cost
    elseif c.always then
      charged = impl.debt_room(c, s, at)
      if c.cost < charged then
        charged = c.cost
      end
    end
    -- What a refund may take back, and what the limit reports if it
    -- does: only what a limit charged if allowed consumed (a cost of 0
    -- takes nothing; a charge that stands whatever the verdict is never
    -- given back), and as if it had never been taken.
    local refundable = header.receipts and consumed and not c.always
    local denied_remaining, denied_reset
    if refundable then
      denied_remaining = available[idx]
      denied_reset = impl.until_full(c, s, at) + (at - now)
    end
    if charged > 0 then
      impl.consume(c, s, key, at, charged)
    end
    local need = need_of(c)
    -- Durations count from the effective time; a request whose clock lags
    -- the stored state waits that much longer.
    local reset_us
    if room then
      reset_us = impl.until_full(c, s, at)
    elseif need > c.capacity then
      -- It can never pass. A limit charged always left without room (in
      -- debt) says when room for one unit comes back; otherwise (or at a
      -- limit of 0, never any room) the window.
      if c.always and c.capacity > 0 and impl.available(c, s, at) == 0 then
        reset_us = impl.until_available(c, s, key, at, 1)
      else
        reset_us = c.window_us
      end
    else
      reset_us = impl.until_available(c, s, key, at, need)
    end
    reset_us = reset_us + (at - now)
    local remaining = impl.available(c, s, at)
    if charged > available[idx] then
      -- Charged past the room: nothing remains, and the reply carries the
      -- overdraft negated in its place (script.rs reads it back).
      remaining = available[idx] - charged
    end
    local keep_for = (impl.lifetime or impl.until_full)(c, s, at)
    -- Equal to a fresh state, whatever the algorithm: no key at all (DEL of
    -- an absent key changes nothing and is not replicated, so a limit never
    -- used writes nothing, whatever the cost asked).
    keep(impl, s, key, keep_for > 0 and div_ceil(keep_for, 1000) + grace_ms, seen)
    local flags = (room and 1 or 0) + (consumed and 2 or 0)
    local at_us, units = 0, 0
    if refundable then
      at_us, units = impl.receipt(c, s, at, c.cost)
    else
      denied_remaining, denied_reset = remaining, reset_us
    end
    out = out + 1
    if idx == 1 then
      reply[out] = pack(formats.first, allowed and 1 or 0, flags, remaining, reset_us, at_us, units,
        denied_remaining, denied_reset)
    else
      reply[out] = pack(formats.next, flags, remaining, reset_us, at_us, units, denied_remaining,
        denied_reset)
    end
  end
  return out
end

-- One request: `keys` and `argv` as KEYS and ARGV (HEADER_FIELDS, then
-- LIMIT_FIELDS per key).
local function decide(keys, argv)
  local n = #keys
  local expected = N_HEADER + N_LIMIT * n
  if #argv ~= expected then
    return redis.error_reply('ERR throttlegate: expected ' .. fmt(expected) .. ' arguments')
  end
  local header, problem = parse_request(argv, 0, n, single)
  if not header then
    return redis.error_reply(problem)
  end
  local reply = single_reply
  local last = run(keys, 0, header, header.now or now_of(''), reply, nil, 0)
  return concat(reply, '', 1, last)
end

-- A refused request's section in a batch's reply: REFUSED, then why: k
-- (>= 1) when its limit k's parameters are refused, 0 when its header is,
-- FAILED when deciding it raised an error (a Redis error on one of its
-- keys), FAILED - k when limit k's key holds a stored layout this version
-- refuses (see refuse_layout). Two integers in place of its decision; the
-- other requests are decided as if it had not been sent.
local REFUSED, FAILED = -1, -1
local REFUSED_FORMAT = '>i8i8'

-- Why a run of `header`'s request raised `problem`: FAILED - k when it is
-- refuse_layout's at limit k's key, else FAILED.
local function failure_reason(keys, header, problem)
  if type(problem) ~= 'string' or not string.find(problem, LAYOUT_REFUSED, 1, true) then
    return FAILED
  end
  for idx = 1, header.n do
    if string.find(problem, ' at ' .. keys[header.first + idx] .. ': ', 1, true) then
      return FAILED - idx
    end
  end
  return FAILED
end

-- Several requests, each decided on its own, in order: ARGV is
-- BATCH_FIELDS, then per request REQUEST_FIELDS, HEADER_FIELDS and
-- LIMIT_FIELDS per key; KEYS are the requests' keys one after the other;
-- the reply is their sections one after the other. Every request is
-- validated before any runs; the server's TIME is read once. A request
-- refused or failing answers its own REFUSED section and the others are
-- decided all the same: one request's failure is its own. Only a batch
-- whose layout is wrong (counts that do not add up) is an error reply.
local function decide_batch(keys, argv)
  local n_requests = integer(argv[B.requests])
  if n_requests == nil or n_requests < 1 then
    return redis.error_reply('ERR throttlegate: bad batch size')
  end
  local requests, at, first = {}, N_BATCH, 0
  for idx = 1, n_requests do
    local n = integer(argv[at + R.limits])
    local size = N_REQUEST + N_HEADER + N_LIMIT * (n or 0)
    if n == nil or n < 1 or first + n > #keys or at + size > #argv then
      return redis.error_reply('ERR throttlegate: bad layout of request ' .. fmt(idx))
    end
    local header, _, reason = parse_request(argv, at + N_REQUEST, n)
    if not header then
      header = { refused = reason }
    end
    header.first = first
    requests[idx] = header
    at, first = at + size, first + n
  end
  if at ~= #argv or first ~= #keys then
    return redis.error_reply('ERR throttlegate: arguments past the last request')
  end
  local reply, server_now, seen, out = {}, nil, {}, 0
  for idx = 1, n_requests do
    local header = requests[idx]
    local ok, last = false, FAILED
    if header.refused then
      last = header.refused
    else
      local now = header.now
      if not now then
        server_now = server_now or now_of('')
        now = server_now
      end
      ok, last = pcall(run, keys, header.first, header, now, reply, seen, out)
      if not ok then
        last = failure_reason(keys, header, last)
      end
    end
    if ok then
      out = last
    else
      -- Whatever section a failing run began is overwritten: the reply is
      -- joined up to `out` only.
      out = out + 1
      reply[out] = pack(REFUSED_FORMAT, REFUSED, last)
    end
  end
  flush(seen)
  return concat(reply, '', 1, out)
end
