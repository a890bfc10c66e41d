"""mmenc on Ray (needs `pip install 'mmenc[ray]'`): past one machine.

    serve.py    the HTTP encoder service as a Ray Serve deployment: replicas run the same
                EncodeService and FastAPI app as `mmenc serve` (mmenc.serving), one per GPU
    data.py     offline corpora: files -> CPU preprocessing tasks -> one Encoder actor per GPU ->
                sharded safetensors output that a rerun resumes
    cluster.py  joining a cluster, or starting a local one bound to loopback

docs/scaling.md describes the deployment, what runs where, and the throughput model.
Nothing here is imported by `import mmenc`; ray is imported inside these modules only.
"""
