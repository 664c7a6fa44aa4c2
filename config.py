"""How a pyinfra run from this directory ends: pyinfra's own config file.

pyinfra executes ``config.py`` of its working directory (``--config``) before it loads the
inventory, in every run: also in one whose ``--limit`` selects no host, where deploy.py
never runs (pyinfra loads a deploy file once per selected host). So the exit status is
decided here, where pyinfra 3 reports two failures as success:

* Ctrl-C: pyinfra prints "Exiting upon user request!" and exits 0, so a script or CI takes
  an interrupted rollout for a finished one. Here it exits 130 (128 + SIGINT, as a shell).
* ``--limit``/``--exclude`` that leave no host of the inventory, or an inventory with no
  host (a mistyped path): pyinfra warns, runs nothing and exits 0. Here it exits 2,
  naming the patterns and the inventory's hosts, or the inventory.

A run that seems stuck says what it waits on: ``kill -USR1 <pid of pyinfra>`` prints the
stack of every greenlet (one per host) to stderr, and the run goes on.

pyinfra writes the traceback of an internal error into ./pyinfra-debug.log once the run
has ended, with the process umask (0644 in a checkout others may read), and a traceback
quotes data and paths: the run ends under umask 077, so that file is 0600.

It holds for every deploy file run from here (deploy.py, checks/bench.py) and imports
nothing of sparkfleet.
"""

import gc
import os
import signal
import sys
import traceback

import click
import gevent
import greenlet
from pyinfra import state

#: What pyinfra names its traceback file, in its working directory.
DEBUG_LOG = "pyinfra-debug.log"
_interrupted: list[int] = []


def _on_interrupt(signum, frame):
    # Only noted here: a Python handler runs between any two bytecodes, and an exit raised
    # there once landed in logging's lock release, left that lock held, and the next
    # greenlet to log waited forever. gevent's loop runs the exit at a switch instead.
    _interrupted.append(signum)
    gevent.get_hub().loop.run_callback_threadsafe(_exit_interrupted)


def _exit_interrupted():
    # Raised in the hub, gevent throws it into the main greenlet: pyinfra's run ends there.
    click.secho("Interrupted (Ctrl-C): the run stopped part-way and a host may be mid-change; "
                "deploy again to converge.", fg="red", err=True)
    sys.exit(128 + _interrupted[0])


def _on_stacks(signum, frame):
    gevent.get_hub().loop.run_callback_threadsafe(_print_stacks)


def _print_stacks():
    # Where each greenlet is (its repr names the host it runs for), innermost frames last;
    # code, never values: no secret is printed. Not gevent.util.print_run_info: its "spawned
    # at" stacks and greenlet locals bury the 3 host frames under a few hundred lines.
    print("* Greenlets", file=sys.stderr)
    for g in gc.get_objects():
        if isinstance(g, greenlet.greenlet) and g.gr_frame is not None:
            stack = "".join(traceback.format_stack(g.gr_frame)[-15:])
            print(f"--- {repr(g)[:300]}\n{stack}", file=sys.stderr, flush=True)


def _end_of_run():
    os.umask(0o077)  # pyinfra-debug.log is written after this, when there is one
    if os.path.isfile(DEBUG_LOG):  # an old one keeps its mode when pyinfra rewrites it
        os.chmod(DEBUG_LOG, 0o600)
    if _interrupted:  # also when the handler's exit was swallowed (it landed in a cleanup that ignores errors)
        sys.exit(128 + _interrupted[0])
    if not state.initialised or any(state.is_host_in_limit(host) for host in state.inventory):
        return
    params = click.get_current_context().params
    hosts = ", ".join(host.name for host in state.inventory)
    if not hosts:  # a mistyped inventory path: pyinfra warned and ran on nothing
        click.secho(f"the inventory {params.get('inventory')} holds no host, so nothing ran. Fix: give an "
                    "inventory file (e.g. inventory/sparks.py) or host names", fg="red", err=True)
        sys.exit(2)
    patterns = " ".join(f"--{option} {','.join(params.get(option) or ())}" for option in ("limit", "exclude")
                        if params.get(option))
    click.secho(f"{patterns} leaves no host of the inventory, so nothing ran. Fix: name hosts or groups of the "
                f"inventory (its hosts: {hosts})", fg="red", err=True)
    sys.exit(2)


# Set here, after pyinfra's own handler: the whole run, connecting and planning included.
signal.signal(signal.SIGINT, _on_interrupt)
signal.signal(signal.SIGUSR1, _on_stacks)
_context = click.get_current_context(silent=True)
if _context is not None:  # the pyinfra command line; its context closes after the run
    _context.call_on_close(_end_of_run)
