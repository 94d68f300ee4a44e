"""``python -m cupycomm.tools.flight DIR``: merge the flight recorder's files of every rank
(``CUPYCOMM_FLIGHT_RECORDER=DIR``) into one block saying where each rank was.

It runs outside the job, after it or beside it. The ranks write the files
(:mod:`cupycomm.faults.flight`); each group of ranks in one place is one line. Only this
user's files are read: a link, a FIFO or another user's file under a rank's name is refused,
named (exit status 2). Example::

    $ python -m cupycomm.tools.flight /tmp/flight --calls
    cupycomm flight recorder: 4 ranks, communicator world
      ranks 0-2 (nodeA) completed #41, wait in all_reduce #42
      rank 3 (nodeB) completed #41, waits in broadcast #42
      rank 0: #41 all_reduce mpi done; #42 all_reduce mpi not done
      ...
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .. import _private as private
from ..errors import SharedFileRefused
from ..faults.flight import outcome, summarize

__all__ = ["read", "main"]


def read(directory: str) -> List[Dict[str, Any]]:
    """The ranks' files in ``directory`` (``rank-<r>.json``), by rank; each only if it is
    this user's (SharedFileRefused: one another user planted or may have changed)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        states = [json.loads(private.read_own(fd, name, directory))
                  for name in sorted(os.listdir(fd))
                  if name.startswith("rank-") and name.endswith(".json")]
    finally:
        os.close(fd)
    return sorted(states, key=lambda s: s["rank"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cupycomm.tools.flight DIR [--calls]``: the one block from every rank's file."""
    parser = argparse.ArgumentParser(
        prog="python -m cupycomm.tools.flight",
        description="Merge the flight recorder's files (CUPYCOMM_FLIGHT_RECORDER=DIR) of "
                    "every rank into one block: where each rank was.")
    parser.add_argument("directory")
    parser.add_argument("--calls", action="store_true", help="also each rank's last calls")
    args = parser.parse_args(argv)
    try:
        states = read(args.directory)
    except (OSError, ValueError, SharedFileRefused) as error:
        print(f"python -m cupycomm.tools.flight: cannot read {args.directory}: {error}",
              file=sys.stderr)
        return 2
    if not states:
        print(f"python -m cupycomm.tools.flight: no rank-<r>.json in {args.directory}",
              file=sys.stderr)
        return 2
    print(f"cupycomm flight recorder: {len(states)} ranks, communicator "
          f"{states[0]['communicator']}")
    for line in summarize(states):
        print(f"  {line}")
    if args.calls:
        for state in states:
            calls = "; ".join(f"#{c['seq']} {c['call']} {c['backend']} {outcome(c)}"
                              for c in state["calls"])
            print(f"  rank {state['rank']}: {calls or 'no calls'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
