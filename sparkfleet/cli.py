"""The `sparkfleet` command: `sparkfleet testbed ...`, `sparkfleet report ...`, `sparkfleet status ...`,
`sparkfleet unlock ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        # The report has its own argparse; imported lazily (matplotlib is heavy).
        from sparkfleet.bench import report

        return int(report.main(argv[1:]) or 0)
    if argv[:1] == ["status"]:
        from sparkfleet import status

        return int(status.main(argv[1:]) or 0)
    if argv[:1] == ["unlock"]:
        from sparkfleet import unlock

        return int(unlock.main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="sparkfleet", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    from sparkfleet.testbed import cli as testbed_cli

    testbed_cli.add_parser(sub)
    sub.add_parser("report", help="rebuild the fleet report from saved results (sparkfleet report -h)")
    sub.add_parser("status", help="the fleet at a glance: hosts, serving state, endpoint (sparkfleet status -h)")
    sub.add_parser("unlock", help="remove the operator lock a killed deploy left on the fleet (sparkfleet unlock -h)")
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
