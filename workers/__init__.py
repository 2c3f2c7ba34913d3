"""meshserve's worker pools: `meshserve worker --config pools.yaml` and `meshserve serve`.

    config.py     pools.yaml (models, pools: device slice, mesh sizes, batching, buckets = the sizes served)
    runner.py     the Runner interface (load, warm_up, run, shutdown) and the pipeline runner
    fake_runner.py  a model-free runner for tests and load benchmarks
    encoding.py   PNG / JPEG / WebP (Pillow), MP4 / animated WebP (PyAV) outputs
    batching.py   which claimed jobs share a device batch
    job_loop.py   claim -> start -> run (progress, cancel, lease) -> complete | fail, and SIGTERM draining
    pool.py       a device slice + mesh + runners + job loop, registered in the pool registry
    threads.py    the pool thread that runs blocking model calls
    metrics.py    `meshserve_worker_*` Prometheus metrics
    main.py       `run_worker`: the pools of one config in one process
    serve.py      `run_serve`: API + one worker (+ a private redis-server) in one command
    local_redis.py  the redis-server launcher (`serve`'s private Redis, and the tests')

Redis is reached only through `meshserve.service.store.Store` and the job types of `meshserve.service.contract`; models only through
the runner interface. JAX is imported only when a pool runs a real model.
"""
