"""An OpenAI-compatible HTTP server on the compiled decode loop (`prove-jax serve`).

`engine.py` runs the open-ended stream on its own thread (requests join the running batch
between chunks), `protocol.py` maps OpenAI request bodies onto the engine and its results back,
`metrics.py` keeps the Prometheus counters, `app.py` is the ASGI application. Nothing here is
imported by `import prove_jax.decoding`: the HTTP stack loads only for the server.
"""
