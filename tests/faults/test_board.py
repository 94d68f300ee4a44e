"""The node board (cupycomm/faults/board.py): each node's shared-memory board holds the ranks
of that node and no other (test_nodes.py runs this on two simulated nodes too). The
watchdog's reading of the board is tests/faults/test_watchdog.py's; its files' privacy,
tests/test_private.py's.
"""
import cupycomm
from cupycomm.faults.board import RANK
from fault_jobs import nodes_of


def test_the_node_board_holds_the_ranks_of_this_node_only():
    comm = cupycomm.init()
    if comm.size == 1:
        assert comm.parts.tracker.board is None
        return
    nodes = nodes_of(comm)
    here = [rank for rank, node in enumerate(nodes) if node == nodes[comm.rank]]
    assert sorted(int(row[RANK]) for row in comm.parts.tracker.board.rows) == here
