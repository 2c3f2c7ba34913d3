"""Webhooks: a job's end POSTed to the URL its request named, signed per Standard Webhooks, at least once.

- `spec.py`: what a request asks for (`webhook: {url, events}`) and the event names.
- `signing.py`: the Standard Webhooks signature (`webhook-id`, `webhook-timestamp`, `webhook-signature`) and
  `whsec_` secrets.
- `queue.py`: the durable delivery queue in Redis. A job's end queues its delivery in the same script as the end
  (`finish` in service/store_lua.py); deliverers claim due ones with a lease, and settle them (delivered, retry
  later, gave up), the state recorded on the job.
- `deliverer.py`: the loop that claims, signs and POSTs (through service/ssrf.py's address rules), with
  exponential backoff and jitter; it also runs the deadline sweep. It runs as a background task of the API
  process, or alone as `meshserve webhooks` (`python -m meshserve.service.webhooks`).
"""
