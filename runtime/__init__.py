"""Files that land on the serving hosts (as /opt/sparkfleet/runtime, mounted at /host).

Importable as the package ``runtime`` on the controller and in tests; inside the
container each program runs by path (``python3 /host/serve.py``) and imports its siblings.
"""
