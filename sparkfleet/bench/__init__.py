"""Post-deploy checks and benches: run on every Spark, collected on the controller.

- ``onhost/``   the program that runs ON a host against its own server (stdlib +
                prometheus_client only; uploaded and run in the serving image): smoke,
                decode bank, albond e2e, Hermes agent turns, /metrics acceptance.
- ``deploy.py`` ``run_checks(names)``: the pyinfra ``@deploy`` that uploads, runs and
                collects per host, and writes the fleet report when all hosts are done.
- ``settings.py`` the one accessor of the checks' host data.
- ``results.py`` result files on the controller (``results/<run-id>/<host>.json``).

The report itself is ``sparkfleet.bench.report`` (``sparkfleet report results/<run-id>``).
"""
