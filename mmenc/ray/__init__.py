"""mmenc on Ray (needs `pip install 'mmenc[ray]'`): past one machine.

    serve.py    the HTTP encoder service as a Ray Serve deployment: replicas run the same
                EncodeService and FastAPI app as `mmenc serve` (mmenc.serving), one per GPU
    data.py     offline corpora: files -> CPU preprocessing tasks -> one Encoder actor per GPU ->
                sharded safetensors output that a rerun resumes
    stages.py   the two Ray Data stages (CPU preprocessing, the encoder actor)
    cluster.py  joining a cluster, or starting a local one bound to loopback
(`mmenc encode --ray` is mmenc/cli/encode_ray.py; `mmenc serve --ray` is mmenc/cli/serve.py.)

docs/scaling.md describes the deployment, what runs where, and the throughput model.
Nothing here is imported by `import mmenc`; ray is imported inside these modules only.
"""
