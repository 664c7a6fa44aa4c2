"""The bench program that runs ON a Spark, against its own server.

It is uploaded to the host and run with the serving image's Python (python3, requests,
prometheus_client; not sparkfleet, not pyinfra), so everything in this package uses the
standard library and prometheus_client only, and imports its siblings relatively: the
directory is importable as ``sparkfleet.bench.onhost`` on the controller and under any
name on the host.

    python3 -m <pkg> --settings '{"base_url": "http://127.0.0.1:8000", "checks": ["smoke"], ...}'

The settings document and the result file are defined in ``schema.py``.
"""
