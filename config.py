"""How a pyinfra run from this directory ends, and what it costs: pyinfra's own config file.

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

Two of pyinfra's own costs per operation and host, paid here once: the operation order
(the call chain's line numbers) read from the frames, not through ``inspect.stack()``,
and the global arguments' type hints evaluated once, not per operation. Together they
were 43% of the controller's CPU (38% and 5%, cProfile) on a converged 16-host run;
the answers are the same.

The sudo password reaches each host on sudo's stdin, never in a command line
(:mod:`sparkfleet.remote`): for every run from here, ``pyinfra INVENTORY exec`` too.

It holds for every deploy file run from here (deploy.py, checks/bench.py); of sparkfleet
it imports only that.
"""

import gc
import importlib
import os
import signal
import sys
import traceback

import click
import gevent
import greenlet
import pyinfra
from pyinfra import state
from pyinfra.api import arguments, facts
from pyinfra.api.util import PYINFRA_INSTALL_DIR

import sparkfleet.remote  # noqa: F401 - installs the sudo password on stdin

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


def _operation_order(state) -> list[int]:
    """pyinfra's ``get_operation_order_from_stack``, from the frames themselves: pyinfra's
    goes through ``inspect.stack()``, which reads every frame's source line and, for the
    deploy file (not a module), scans all of sys.modules, twice per operation and host."""
    frames = []
    frame = sys._getframe(1)  # the caller's, as pyinfra's skips its own (in pyinfra's tree)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    i = 0
    if state.current_deploy_filename:  # pyinfra's: from the deploy file's outermost frame on, else none
        i = next((n for n, f in enumerate(frames) if f.f_code.co_filename == state.current_deploy_filename),
                 len(frames))
    order = [state.current_op_file_number] if pyinfra.is_cli else []
    order += [f.f_lineno for f in frames[i:] if not f.f_code.co_filename.startswith(PYINFRA_INSTALL_DIR)]
    return order


importlib.import_module("pyinfra.api.operation").get_operation_order_from_stack = _operation_order
# A constant, evaluated by typing.get_type_hints in every operation and fact call.
_GLOBAL_ARGUMENTS = arguments.all_global_arguments()
arguments.all_global_arguments = facts.all_global_arguments = lambda: list(_GLOBAL_ARGUMENTS)
# Set here, after pyinfra's own handler: the whole run, connecting and planning included.
signal.signal(signal.SIGINT, _on_interrupt)
signal.signal(signal.SIGUSR1, _on_stacks)
_context = click.get_current_context(silent=True)
if _context is not None:  # the pyinfra command line; its context closes after the run
    _context.call_on_close(_end_of_run)
