"""`mmenc serve --frontends N`: the HTTP side of the service in N processes, the tower in one.

    engine process (engine.py)              front-end processes (process.py), N of them
    LocalEngine: Encoder, Batcher, cache    uvicorn + the FastAPI app on the engine's socket
    EngineHub (hub.py) <--- Channel --->    EncodeService over ProcessEngineClient (remote.py)

Modules: client (the EngineClient interface every tower side implements, EngineInfo, Encoded),
mmenc.shm (Channel: pickled headers + tensors in shared memory over a Unix socket), hub (engine
side), remote (front-end side), process (front-end entry), engine (the engine's main: socket,
spawn, restarts, shutdown), metrics_dir (prometheus_client's multiprocess folder).
See docs/serving.md, "Front ends"."""
