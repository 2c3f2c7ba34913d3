"""The Lua scripts behind `meshserve.service.store.Store`: every state change of a job that must be atomic.

Why Lua and not MULTI: each transition first reads the job (its status and attempt number) and then decides what
to write; a script does the read and the writes as one step, so a stale worker can never slip a write in between
(the "fence"). The scripts run with Redis 7's default effects replication, which allows `XADD *` and XINFO here.

Conventions: ARGV[1] is always the key prefix, keys of one job are built from it in the scripts (single Redis
node; the key layout is the one in `service/store.py`'s docstring). A job's status, attempt, cancel flag, stream and
message id live in its hash; JSON blobs (outputs, error, timings) are built in Python.
"""

# Helpers shared by the scripts (prepended to each).
_COMMON = r"""
local P = ARGV[1]

-- Undelivered entries of a stream for group `pools` (XINFO's lag; counted by XRANGE when Redis cannot know it).
local function group_info(stream)
  if redis.call('EXISTS', stream) == 0 then return nil end
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == 'pools' then return f end
  end
  return nil
end

-- Undelivered entries whose job already ended (canceled or expired while queued), per stream: left out of the
-- depth until a pool reads them, so a tenant that submits and cancels in a loop cannot fill the queue. Not XDEL:
-- once a stream is empty, Redis 7.0 computes a group's lag from counters that still include deleted entries (an
-- audit's queue stayed "full" at 1005 with 9 entries, 2026-11-28).
local function void_key(stream)
  return (string.gsub(stream, ':stream:', ':void:', 1))
end

-- Stream ids "ms-seq": whether a comes after b.
local function id_after(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am > bm or (am == bm and as > bs)
end

-- Entries a pool read and gave back (GIVE_BACK, RELEASE: made idle for 10^12 ms), oldest first: waiting again,
-- at their old place. The pending list holds only what pools hold now, so the scan is short.
local function given_back(stream, count)
  local r = redis.pcall('XPENDING', stream, 'pools', 'IDLE', 100000000000, '-', '+', count)
  if type(r) ~= 'table' or r.err then return {} end
  return r
end

-- Jobs waiting in a stream: undelivered entries whose job has not ended, and entries given back.
local function lag(stream)
  local g = group_info(stream)
  if not g then
    if redis.call('EXISTS', stream) == 1 then return redis.call('XLEN', stream) end
    return 0
  end
  local n
  if g['lag'] then
    n = tonumber(g['lag'])
  else
    n = #redis.call('XRANGE', stream, '(' .. g['last-delivered-id'], '+')
  end
  return math.max(0, n - redis.call('SCARD', void_key(stream))) + #given_back(stream, 1000)
end

-- A queued job ended: if no pool has read its entry yet, it stops counting in the depth (void_key).
local function void_if_undelivered(stream, msg_id)
  if not stream or stream == '' then return end
  local g = group_info(stream)
  if not g or id_after(msg_id, g['last-delivered-id']) then redis.call('SADD', void_key(stream), msg_id) end
end

local function event(job_id, etype, data, maxlen)
  return redis.call('XADD', P .. ':events:' .. job_id, 'MAXLEN', '~', maxlen, '*', 'type', etype, 'data', data)
end

local function bump(model, name)
  redis.call('HINCRBY', P .. ':stats', model .. '|' .. name, 1)
end

-- End a job: status, finish time, terminal event, TTLs on its hash and events, ack its stream entry, drop lease.
-- Every end of a job passes here, so its webhook is queued here too, in the same script as the transition: a
-- crash cannot end a job and lose its webhook (service/webhooks/). `webhook_on` lists the statuses the request
-- subscribed to, space-separated and padded (" succeeded failed ... "); the delivery is due at once.
local function finish(job_id, model, status, now, ttl, maxlen, stream, msg_id, fields, data)
  local jk = P .. ':job:' .. job_id
  redis.call('HSET', jk, 'status', status, 'finished_at', now, unpack(fields))
  event(job_id, status, data, maxlen)
  redis.call('EXPIRE', jk, ttl)
  redis.call('EXPIRE', P .. ':events:' .. job_id, ttl)
  redis.call('DEL', P .. ':lease:' .. job_id)
  if stream and stream ~= '' then redis.call('XACK', stream, 'pools', msg_id) end
  bump(model, 'finished|' .. status)
  redis.call('ZREM', P .. ':deadlines', job_id)
  local on = redis.call('HGET', jk, 'webhook_on')
  if on and string.find(on, ' ' .. status .. ' ', 1, true) then
    redis.call('HSET', jk, 'wh_status', 'pending', 'wh_attempts', 0, 'wh_first', now)
    redis.call('ZADD', P .. ':webhooks:due', now, job_id)
  end
end

-- The error of a job that reached its deadline (`deadline` in its hash, unix seconds).
local function deadline_error(started)
  local msg = 'the job had not started by its deadline'
  if started then msg = 'the job was still running at its deadline' end
  return cjson.encode({code = 'deadline_exceeded', message = msg})
end

-- End a job past its deadline that a pool met (claim, start): never started -> expired, started -> canceled.
-- Returns true when it ended the job.
local function past_deadline(job_id, model, now, ttl, maxlen, stream, msg_id)
  local deadline = tonumber(redis.call('HGET', P .. ':job:' .. job_id, 'deadline') or '')
  if not deadline or tonumber(now) < deadline then return false end
  local started = redis.call('HEXISTS', P .. ':job:' .. job_id, 'started_at') == 1
  local err = deadline_error(started)
  local ending = 'expired'
  if started then ending = 'canceled' end
  finish(job_id, model, ending, now, ttl, maxlen, stream, msg_id, {'error', err},
    '{"status":"' .. ending .. '","error":' .. err .. '}')
  return true
end

-- Take one delivered stream entry for `consumer`: skip ended/canceled/missing jobs (acked), dead-letter a job
-- delivered more than `max_deliv` times, else bump the attempt (the fence) and set the lease.
-- Returns {'ok', attempt, hash...} or {'skip'|'missing'|'canceled'|'dlq'}.
local function accept(stream, msg_id, job_id, count, consumer, lease_ms, max_deliv, now, ttl, maxlen)
  redis.call('SREM', void_key(stream), msg_id)  -- read now: no longer counted either way
  local jk = P .. ':job:' .. job_id
  local st = redis.call('HMGET', jk, 'status', 'cancel', 'model')
  if not st[1] then
    redis.call('XACK', stream, 'pools', msg_id)
    return {'missing'}
  end
  if st[1] ~= 'queued' and st[1] ~= 'running' then
    redis.call('XACK', stream, 'pools', msg_id)
    return {'skip'}
  end
  if st[2] == '1' then
    finish(job_id, st[3], 'canceled', now, ttl, maxlen, stream, msg_id, {}, '{"status":"canceled"}')
    return {'canceled'}
  end
  if past_deadline(job_id, st[3], now, ttl, maxlen, stream, msg_id) then return {'expired'} end
  if count > max_deliv then
    local msg = 'job was delivered ' .. count .. ' times (limit ' .. max_deliv .. ') without finishing'
    local last = redis.call('HGET', jk, 'last_error')
    if last then msg = msg .. '; the last attempt failed with ' .. last end
    redis.call('XADD', P .. ':dlq:' .. st[3], 'MAXLEN', '~', 10000, '*', 'job', job_id, 'stream', stream,
      'message_id', msg_id, 'deliveries', count, 'reason', 'too_many_deliveries', 'at', now)
    local err = cjson.encode({code = 'too_many_deliveries', message = msg})
    finish(job_id, st[3], 'failed', now, ttl, maxlen, stream, msg_id, {'error', err},
      cjson.encode({status = 'failed', error = {code = 'too_many_deliveries', message = msg}}))
    bump(st[3], 'dead_lettered')
    return {'dlq'}
  end
  local attempt = redis.call('HINCRBY', jk, 'attempt', 1)
  redis.call('HSET', jk, 'worker', consumer, 'stream', stream, 'msg_id', msg_id)
  redis.call('SET', P .. ':lease:' .. job_id, attempt, 'PX', lease_ms)
  local out = {'ok', attempt}
  for _, v in ipairs(redis.call('HGETALL', jk)) do table.insert(out, v) end
  return out
end

-- The fence: the job exists, is not ended, and its attempt is still ours.
local function owned(jk, attempt)
  local st = redis.call('HMGET', jk, 'status', 'attempt', 'model', 'cancel')
  if not st[1] or tonumber(st[2]) ~= tonumber(attempt) then return nil end
  if st[1] ~= 'queued' and st[1] ~= 'running' then return nil end
  return st
end
"""

# KEYS: job, idem (or ''), stream high, normal, low, the tenant's active set (or ''), the tenant's job index. ARGV:
# P, job id, target priority index (1-3), queue limit, idem value, idem ttl, events maxlen, model, priority, params
# JSON, created_at, tenant, the tenant's active-job limit (0: none), the active set's ttl, the output token, the
# deadline (unix seconds, '' for none), the webhook (JSON, '' for none) and the statuses it fires on (' succeeded
# failed '), the job index's ttl. (Few arguments: redis-py packs each one in Python, a measurable share of a submit.)
#
# The tenant's job index (KEYS[7], `GET /v1/jobs`): job id by created_at. Ids of jobs that expired are dropped by the
# listing that meets them, and here: two members drawn at random per submit, dropped if their job is gone. Drawn, not
# the oldest: one job that lives long (a week's deadline) would stop an oldest-first prune behind it (an audit: 1,000
# expired ids kept behind 2 live ones). With every submit adding one id and dropping two in expectation once half the
# index has expired, a tenant's index holds at most about twice its jobs that still exist.
#
# Active jobs: the set holds the ids of the tenant's jobs submitted while it had a limit; members that are no
# longer queued or running (succeeded, failed, canceled, dead-lettered, expired) are pruned here, when the set is
# at the limit, so no terminal transition (worker, reaper, TTL) has to remember to decrement a counter, and a
# lost update can never lock a tenant out. The prune reads at most `limit` job statuses.
SUBMIT = (
    _COMMON
    + r"""
if KEYS[2] ~= '' then
  local prev = redis.call('GET', KEYS[2])
  if prev then return {'idem', prev} end
end
local pidx = tonumber(ARGV[3])
local depth, ahead = 0, 0
for i = 1, 3 do
  local l = lag(KEYS[2 + i])
  depth = depth + l
  if i <= pidx then ahead = ahead + l end
end
if depth >= tonumber(ARGV[4]) then return {'full', tostring(depth)} end
local max_active = tonumber(ARGV[13])
if KEYS[6] ~= '' and max_active > 0 and redis.call('SCARD', KEYS[6]) >= max_active then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[6])) do
    local st = redis.call('HGET', P .. ':job:' .. id, 'status')
    if st ~= 'queued' and st ~= 'running' then redis.call('SREM', KEYS[6], id) end
  end
  local active = redis.call('SCARD', KEYS[6])
  if active >= max_active then return {'busy', tostring(active)} end
end
local stream = KEYS[2 + pidx]
redis.pcall('XGROUP', 'CREATE', stream, 'pools', '0', 'MKSTREAM')
local msg_id = redis.call('XADD', stream, '*', 'job', ARGV[2])
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'model', ARGV[8], 'priority', ARGV[9], 'status', 'queued',
  'params', ARGV[10], 'created_at', ARGV[11], 'attempt', 0, 'stream', stream, 'msg_id', msg_id, 'tenant', ARGV[12],
  'out_token', ARGV[15])
if ARGV[16] and ARGV[16] ~= '' then
  redis.call('HSET', KEYS[1], 'deadline', ARGV[16])
  redis.call('ZADD', P .. ':deadlines', ARGV[16], ARGV[2])
end
if ARGV[17] and ARGV[17] ~= '' then redis.call('HSET', KEYS[1], 'webhook', ARGV[17], 'webhook_on', ARGV[18]) end
if KEYS[6] ~= '' and max_active > 0 then
  redis.call('SADD', KEYS[6], ARGV[2])
  redis.call('EXPIRE', KEYS[6], ARGV[14])
end
for _, id in ipairs(redis.call('ZRANDMEMBER', KEYS[7], 2)) do
  if redis.call('EXISTS', P .. ':job:' .. id) == 0 then redis.call('ZREM', KEYS[7], id) end
end
redis.call('ZADD', KEYS[7], ARGV[11], ARGV[2])
redis.call('EXPIRE', KEYS[7], ARGV[19])
event(ARGV[2], 'queued', '{"status":"queued"}', ARGV[7])
if KEYS[2] ~= '' then redis.call('SET', KEYS[2], ARGV[5], 'EX', ARGV[6]) end
redis.call('SADD', P .. ':models', ARGV[8])
return {'ok', msg_id, tostring(ahead)}
"""
)

# ARGV: P, consumer, lease ms, max deliveries, now, ttl, events maxlen, then (stream, msg id, job id) triples.
ACCEPT = (
    _COMMON
    + r"""
local out = {}
for i = 8, #ARGV, 3 do
  table.insert(out, accept(ARGV[i], ARGV[i + 1], ARGV[i + 2], 1, ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5],
    ARGV[6], ARGV[7]))
end
return out
"""
)

# Take over entries of one stream idle longer than the lease whose lease key has expired (the holder is gone).
# An entry still leased is re-claimed for its holder with JUSTID, which resets its idle time without counting a
# delivery, so the next scan skips it. Then the undelivered entries at the stream's head whose jobs ended are
# passed. KEYS: stream. ARGV: P, consumer, lease ms, max deliveries, now, ttl, events maxlen, max jobs. Returns a
# list of {msg id, job id, delivery count, accept result..., 1 if taken over from a worker that is gone}.
RECLAIM = (
    _COMMON
    + r"""
local stream = KEYS[1]
local pend = redis.pcall('XPENDING', stream, 'pools', 'IDLE', ARGV[3], '-', '+', 64)
if type(pend) ~= 'table' or pend.err then return {} end
local out, taken = {}, 0
for _, e in ipairs(pend) do
  if taken >= tonumber(ARGV[8]) then break end
  local msg_id, holder, count = e[1], e[2], tonumber(e[4])
  -- Given back (GIVE_BACK, RELEASE: idle set to 10^12 ms), not taken over from a worker that is gone.
  local was_given_back = tonumber(e[3]) >= 100000000000
  local entry = redis.call('XRANGE', stream, msg_id, msg_id)
  if #entry == 0 then
    redis.call('XACK', stream, 'pools', msg_id)
  else
    local fields, job_id = entry[1][2], nil
    for i = 1, #fields, 2 do if fields[i] == 'job' then job_id = fields[i + 1] end end
    if job_id and redis.call('EXISTS', P .. ':lease:' .. job_id) == 1 then
      redis.call('XCLAIM', stream, 'pools', holder, 0, msg_id, 'JUSTID')
    elseif not job_id then
      redis.call('XACK', stream, 'pools', msg_id)
    else
      local c = redis.call('XCLAIM', stream, 'pools', ARGV[2], ARGV[3], msg_id)
      if #c > 0 and not was_given_back then
        -- Its worker is gone mid-run: back to queued, and its client hears so before the next `started` (the
        -- events went progress 5, started, progress 1: an audit, 2026-11-29).
        local jk = P .. ':job:' .. job_id
        if redis.call('HGET', jk, 'status') == 'running' then
          redis.call('HSET', jk, 'status', 'queued', 'step', 0)
          event(job_id, 'queued', '{"status":"queued","reason":"worker_lost"}', ARGV[7])
        end
      end
      if #c > 0 then
        local r = accept(stream, msg_id, job_id, count + 1, ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5],
          ARGV[6], ARGV[7])
        if r[1] == 'ok' then
          if not was_given_back then
            bump(redis.call('HGET', P .. ':job:' .. job_id, 'model'), 'reclaimed')
          end
          taken = taken + 1
        end
        local takeover = 1
        if was_given_back then takeover = 0 end
        table.insert(out, {msg_id, job_id, count + 1, r, takeover})
      end
    end
  end
end
-- Undelivered entries at the head whose job already ended (void_key): read and acked here, so that the claim's
-- read that follows starts at a live one (3,000 canceled entries ahead took claims of 16 reads each 1.8 s to pass).
local void = void_key(stream)
local nvoid = redis.call('SCARD', void)
if nvoid > 0 then
  local g = group_info(stream)
  if g then
    local n = 0
    local head = redis.call('XRANGE', stream, '(' .. g['last-delivered-id'], '+', 'COUNT', math.min(nvoid, 1000))
    for _, e in ipairs(head) do
      if redis.call('SISMEMBER', void, e[1]) == 0 then break end
      n = n + 1
    end
    if n > 0 then
      local read = redis.call('XREADGROUP', 'GROUP', 'pools', ARGV[2], 'COUNT', n, 'STREAMS', stream, '>')
      for _, e in ipairs(read[1][2]) do
        redis.call('XACK', stream, 'pools', e[1])
        redis.call('SREM', void, e[1])
      end
    end
  end
end
return out
"""
)

# Entries delivered to this consumer that it will not run (it read more than it can take): make them idle for
# ever and reset their delivery count, so the next reclaim by any consumer takes them as a first delivery.
# KEYS: stream. ARGV: P, consumer, msg ids...
GIVE_BACK = (
    _COMMON
    + r"""
for i = 3, #ARGV do
  redis.call('XCLAIM', KEYS[1], 'pools', ARGV[2], 0, ARGV[i], 'IDLE', 1000000000000, 'RETRYCOUNT', 0, 'JUSTID')
  redis.call('SREM', void_key(KEYS[1]), ARGV[i])
end
return #ARGV - 2
"""
)

# ARGV: P, job id, attempt, consumer, now, lease ms, events maxlen, ttl, event data.
START = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = redis.call('HMGET', jk, 'status', 'attempt', 'model', 'cancel', 'stream', 'msg_id')
if not st[1] or tonumber(st[2]) ~= tonumber(ARGV[3]) then return 0 end
if st[1] ~= 'queued' and st[1] ~= 'running' then
  redis.call('XACK', st[5], 'pools', st[6])
  return 0
end
if st[4] == '1' then
  finish(ARGV[2], st[3], 'canceled', ARGV[5], ARGV[8], ARGV[7], st[5], st[6], {}, '{"status":"canceled"}')
  return 0
end
if past_deadline(ARGV[2], st[3], ARGV[5], ARGV[8], ARGV[7], st[5], st[6]) then return 0 end
redis.call('HSET', jk, 'status', 'running', 'started_at', ARGV[5], 'worker', ARGV[4], 'step', 0)
redis.call('SET', P .. ':lease:' .. ARGV[2], ARGV[3], 'PX', ARGV[6])
event(ARGV[2], 'started', ARGV[9], ARGV[7])
return 1
"""
)

# ARGV: P, job id, attempt, consumer, lease ms.
HEARTBEAT = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
if not owned(jk, ARGV[3]) then return 0 end
redis.call('SET', P .. ':lease:' .. ARGV[2], ARGV[3], 'PX', ARGV[5])
local s = redis.call('HMGET', jk, 'stream', 'msg_id')
redis.pcall('XCLAIM', s[1], 'pools', ARGV[4], 0, s[2], 'JUSTID')
return 1
"""
)

# What an attempt that failed in the engine raised (the job is left to its lease and retried): kept on the job,
# so that a dead letter says why. Fenced. ARGV: P, job id, attempt, message.
NOTE_ERROR = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
if not owned(jk, ARGV[3]) then return 0 end
redis.call('HSET', jk, 'last_error', ARGV[4])
return 1
"""
)

# ARGV: P, job id, attempt, step, total, events maxlen, event data.
PROGRESS = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = owned(jk, ARGV[3])
if not st or st[1] ~= 'running' then return 0 end
redis.call('HSET', jk, 'step', ARGV[4], 'total_steps', ARGV[5])
event(ARGV[2], 'progress', ARGV[7], ARGV[6])
return 1
"""
)

# End a running job (succeeded | failed | canceled) under the fence. Output bytes never pass through here (a script
# blocks Redis for as long as it runs, and copying multi-MB outputs would): the worker SETs them first under keys of
# its own attempt (`P:staged:{id}:{attempt}:{i}`, which no reader looks at), and this script only RENAMEs them to
# `P:out:{id}:{i}` once the fence holds - O(1) per output, and a stale attempt's bytes never become visible.
# ARGV: P, job id, attempt, status, now, ttl, events maxlen, event data, n hash pairs, hash field/value pairs...,
# then (staged key, output key) pairs. Returns 1 done, 0 fenced, -1 a staged output is missing (Redis lost it:
# nothing is written, the job stays leased and is redelivered).
END = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = owned(jk, ARGV[3])
if not st then return 0 end
if ARGV[4] == 'succeeded' and st[1] ~= 'running' then return 0 end
local npairs = tonumber(ARGV[9])
local fields = {}
for i = 10, 9 + 2 * npairs do table.insert(fields, ARGV[i]) end
local first_output = 10 + 2 * npairs
for i = first_output, #ARGV, 2 do
  if redis.call('EXISTS', ARGV[i]) == 0 then return -1 end
end
for i = first_output, #ARGV, 2 do redis.call('RENAME', ARGV[i], ARGV[i + 1]) end
local s = redis.call('HMGET', jk, 'stream', 'msg_id')
finish(ARGV[2], st[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], s[1], s[2], fields, ARGV[8])
return 1
"""
)

# Give a job back (SIGTERM, or claimed by a pool that could not fit it in its batch): it stays in the stream's
# pending list at its place, made idle for ever with its delivery count lowered by one, so the next claim by any
# pool reclaims it without spending a delivery. The attempt is bumped: the releasing worker's later writes are
# refused. ARGV: P, job id, attempt, consumer, events maxlen,
# event data.
RELEASE = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = owned(jk, ARGV[3])
if not st then return 0 end
local s = redis.call('HMGET', jk, 'stream', 'msg_id')
local pend = redis.call('XPENDING', s[1], 'pools', s[2], s[2], 1)
local count = 1
if #pend > 0 then count = tonumber(pend[1][4]) end
redis.call('XCLAIM', s[1], 'pools', ARGV[4], 0, s[2], 'IDLE', 1000000000000, 'RETRYCOUNT', math.max(count - 1, 0),
  'JUSTID')
redis.call('HINCRBY', jk, 'attempt', 1)
redis.call('HSET', jk, 'status', 'queued', 'worker', '', 'step', 0)
redis.call('DEL', P .. ':lease:' .. ARGV[2])
-- A job given back before it started never left `queued`: its client hears nothing.
if st[1] == 'running' then event(ARGV[2], 'queued', ARGV[6], ARGV[5]) end
return 1
"""
)

# API cancel. A queued job ends canceled at once; an entry no pool has read yet stops counting in the depth at once
# (void_key: otherwise it held queue room until a pool read past it, and a tenant submitting and canceling in a loop
# filled the queue for everyone: an audit's 1,000 canceled entries refused other tenants with queue_full,
# 2026-11-28); one a pool read and gave back is acked. The entry is skipped when a pool reads it. A running one gets
# the cancel flag, which its worker polls between steps, unless its lease has expired: its worker is gone (killed,
# or cut off from Redis for longer than the lease, when its later writes are fenced anyway), and waiting for
# another pool to reclaim it could be for ever. ARGV: P, job id, now, ttl, events maxlen.
CANCEL = (
    _COMMON
    + r"""
local jk = P .. ':job:' .. ARGV[2]
local st = redis.call('HMGET', jk, 'status', 'model', 'stream', 'msg_id')
if not st[1] then return {'missing'} end
if st[1] == 'queued' then
  redis.call('HSET', jk, 'cancel', '1')
  void_if_undelivered(st[3], st[4])
  finish(ARGV[2], st[2], 'canceled', ARGV[3], ARGV[4], ARGV[5], st[3], st[4], {}, '{"status":"canceled"}')
  return {'canceled'}
end
if st[1] == 'running' then
  redis.call('HSET', jk, 'cancel', '1')
  if redis.call('EXISTS', P .. ':lease:' .. ARGV[2]) == 0 then
    finish(ARGV[2], st[2], 'canceled', ARGV[3], ARGV[4], ARGV[5], st[3], st[4], {}, '{"status":"canceled"}')
    return {'canceled'}
  end
  return {'requested'}
end
return {'ended', st[1]}
"""
)

# API delete of an ended job's record (`DELETE /v1/jobs/{id}`; its outputs and inputs are deleted before, by the
# caller): the hash, its events, its entry in the tenant's index and any webhook or deadline entry. A webhook not
# yet delivered is dropped with it (the deliverer passes a job without a record). A queued or running job is left
# alone: its worker still writes to it. ARGV: P, job id, the default tenant. Returns {'deleted'}, {'missing'} or
# {'active', status}.
DELETE_ENDED = r"""
local P = ARGV[1]
local jk = P .. ':job:' .. ARGV[2]
local st = redis.call('HMGET', jk, 'status', 'tenant')
if not st[1] then return {'missing'} end
if st[1] == 'queued' or st[1] == 'running' then return {'active', st[1]} end
redis.call('DEL', jk, P .. ':events:' .. ARGV[2])
redis.call('ZREM', P .. ':jobs_of:' .. (st[2] or ARGV[3]), ARGV[2])
redis.call('ZREM', P .. ':webhooks:due', ARGV[2])
redis.call('ZREM', P .. ':deadlines', ARGV[2])
return {'deleted'}
"""

# Jobs ahead of one queued job: undelivered entries of higher-priority streams plus those before it in its own.
# KEYS: stream high, normal, low. ARGV: P, priority index, msg id.
POSITION = (
    _COMMON
    + r"""
local pidx = tonumber(ARGV[2])
local stream, msg = KEYS[pidx], ARGV[3]
local pos = 0
for i = 1, pidx - 1 do pos = pos + lag(KEYS[i]) end
-- In its own stream: the entries given back before it, then the undelivered ones before it whose job has not ended.
for _, e in ipairs(given_back(stream, 1000)) do
  if id_after(msg, e[1]) then pos = pos + 1 end
end
local g = group_info(stream)
local last = '0-0'
if g then last = g['last-delivered-id'] end
if id_after(msg, last) then
  pos = pos + #redis.call('XRANGE', stream, '(' .. last, '(' .. msg)
  for _, id in ipairs(redis.call('SMEMBERS', void_key(stream))) do
    if id_after(id, last) and id_after(msg, id) then pos = pos - 1 end
  end
end
return math.max(0, pos)
"""
)

# Per stream: {waiting (lag), id of the oldest waiting entry or '', delivered-but-unacked}. KEYS: streams.
QUEUE_STATS = (
    _COMMON
    + r"""
local out = {}
for _, stream in ipairs(KEYS) do
  local g = group_info(stream)
  local depth, oldest, pending = 0, '', 0
  if g then
    depth = lag(stream)
    pending = tonumber(g['pending'])
    local back = given_back(stream, 1)
    if #back > 0 then
      oldest = back[1][1]
    elseif depth > 0 then  -- the first undelivered entry whose job has not ended (at most |void| come before it)
      local void = void_key(stream)
      local count = math.min(redis.call('SCARD', void), 10000) + 1
      for _, e in ipairs(redis.call('XRANGE', stream, '(' .. g['last-delivered-id'], '+', 'COUNT', count)) do
        if redis.call('SISMEMBER', void, e[1]) == 0 then
          oldest = e[1]
          break
        end
      end
    end
  end
  table.insert(out, {depth, oldest, pending})
end
return out
"""
)

# Drop entries every consumer is done with: those before the oldest pending one and at most the last delivered.
# KEYS: stream. ARGV: P.
TRIM = (
    _COMMON
    + r"""
local g = group_info(KEYS[1])
if not g then return 0 end
-- Void members a pool has read past (a path that read one without removing it): no longer undelivered.
local last = g['last-delivered-id']
for _, id in ipairs(redis.call('SMEMBERS', void_key(KEYS[1]))) do
  if not id_after(id, last) then redis.call('SREM', void_key(KEYS[1]), id) end
end
local summary = redis.call('XPENDING', KEYS[1], 'pools')
local minid
if tonumber(summary[1]) > 0 then
  minid = summary[2]
else
  local last = g['last-delivered-id']
  local dash = string.find(last, '-')
  minid = string.sub(last, 1, dash - 1) .. '-' .. (tonumber(string.sub(last, dash + 1)) + 1)
end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""
)

# The deadline sweep (service/webhooks/deliverer.py runs it every `webhook_poll_s`): jobs whose deadline passed
# end now, not when a pool next reads their stream: a queued one `expired`, a running one whose lease expired (its
# worker is gone) `canceled` with the deadline's error. A job a live pool holds (a lease: claimed and waiting for
# its batch, or running) is left to that pool (`start`, `poll_running` between steps) and looked at again one lease
# later, in case that pool dies too. ARGV: P, now, ttl, events maxlen, max jobs, lease seconds. Returns the ids
# ended.
EXPIRE_DUE = (
    _COMMON
    + r"""
local out = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', P .. ':deadlines', '-inf', ARGV[2], 'LIMIT', 0, ARGV[5])) do
  local jk = P .. ':job:' .. id
  local st = redis.call('HMGET', jk, 'status', 'model', 'stream', 'msg_id')
  if st[1] ~= 'queued' and st[1] ~= 'running' then
    redis.call('ZREM', P .. ':deadlines', id)
  elseif redis.call('EXISTS', P .. ':lease:' .. id) == 1 then
    redis.call('ZADD', P .. ':deadlines', tonumber(ARGV[2]) + tonumber(ARGV[6]), id)
  elseif past_deadline(id, st[2], ARGV[2], ARGV[3], ARGV[4], st[3], st[4]) then
    if st[1] == 'queued' then void_if_undelivered(st[3], st[4]) end  -- (as CANCEL: frees queue room)
    table.insert(out, id)
  else
    redis.call('ZREM', P .. ':deadlines', id)
  end
end
return out
"""
)


# A model no pool has served for `unserved_timeout_s` (service/webhooks/deliverer.py decides): its jobs would wait
# for ever. Fail, with code `no_pool`, the entries of one of its streams that nobody holds: undelivered ones (read
# here as consumer `unserved`, then acked) and delivered ones whose lease expired (their worker is gone). KEYS:
# stream. ARGV: P, now, ttl, events maxlen, lease ms, message, max entries. Returns the ids failed.
FAIL_UNSERVED = (
    _COMMON
    + r"""
local stream = KEYS[1]
if not group_info(stream) then return {} end
local out = {}
local err = cjson.encode({code = 'no_pool', message = ARGV[6]})
local data = cjson.encode({status = 'failed', error = {code = 'no_pool', message = ARGV[6]}})
local function fail(msg_id, fields)
  redis.call('SREM', void_key(stream), msg_id)
  local job_id
  for i = 1, #fields, 2 do if fields[i] == 'job' then job_id = fields[i + 1] end end
  local st = job_id and redis.call('HMGET', P .. ':job:' .. job_id, 'status', 'model')
  if st and (st[1] == 'queued' or st[1] == 'running') and redis.call('EXISTS', P .. ':lease:' .. job_id) == 0 then
    finish(job_id, st[2], 'failed', ARGV[2], ARGV[3], ARGV[4], stream, msg_id, {'error', err}, data)
    table.insert(out, job_id)
  elseif not st or not st[1] or (st[1] ~= 'queued' and st[1] ~= 'running') then
    redis.call('XACK', stream, 'pools', msg_id)
  end
end
local pend = redis.call('XPENDING', stream, 'pools', 'IDLE', ARGV[5], '-', '+', ARGV[7])
for _, e in ipairs(pend) do
  local entry = redis.call('XRANGE', stream, e[1], e[1])
  if #entry == 0 then redis.call('XACK', stream, 'pools', e[1]) else fail(e[1], entry[1][2]) end
end
local new = redis.call('XREADGROUP', 'GROUP', 'pools', 'unserved', 'COUNT', ARGV[7], 'STREAMS', stream, '>')
if new then
  for _, entry in ipairs(new[1][2]) do fail(entry[1], entry[2]) end
end
return out
"""
)


# Housekeeping (service/registry_sweep.py). Registry entries of pools last seen before a cutoff: a pool that crashed
# never removes its own. One script, so a pool's heartbeat cannot land between the read and the delete (a live pool
# whose entry was dropped registers again at its next heartbeat anyway). KEYS: the pools hash. ARGV: P, cutoff (unix
# seconds). Returns the names dropped.
FORGET_POOLS = r"""
local out = {}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local ok, info = pcall(cjson.decode, all[i + 1])
  local seen = ok and type(info) == 'table' and tonumber(info['last_seen'])
  if seen and seen < tonumber(ARGV[2]) then
    redis.call('HDEL', KEYS[1], all[i])
    table.insert(out, all[i])
  end
end
return out
"""

# Consumers of group `pools` with nothing pending and idle past a bound: every process that ever read a stream left
# one (XREADGROUP creates it; a crash never deletes it). Deleting a consumer drops its pending entries, so only
# empty ones go, in one script (no read can slip in between). A live pool idle that long reads again and is
# recreated. KEYS: streams. ARGV: P, idle ms. Returns how many were deleted.
FORGET_CONSUMERS = r"""
local n = 0
for _, stream in ipairs(KEYS) do
  local consumers = redis.pcall('XINFO', 'CONSUMERS', stream, 'pools')
  if type(consumers) == 'table' and not consumers.err then
    for _, c in ipairs(consumers) do
      local f = {}
      for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
      if tonumber(f['pending']) == 0 and tonumber(f['idle']) > tonumber(ARGV[2]) then
        redis.call('XGROUP', 'DELCONSUMER', stream, 'pools', f['name'])
        n = n + 1
      end
    end
  end
end
return n
"""
