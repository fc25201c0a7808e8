import pytest

from rlblocks.interfaces import Placement
from rlblocks.placement import Local


def test_local_builds_the_block_itself_in_process():
    made = []

    def factory(x, *, y):
        made.append((x, y))
        return {"x": x, "y": y}

    placement = Local()
    assert isinstance(placement, Placement)
    block = placement.build("actor", factory, 1, y=2)
    assert block == {"x": 1, "y": 2}
    assert made == [(1, 2)]


def test_local_rejects_unknown_roles():
    with pytest.raises(ValueError, match="unknown role 'policy'"):
        Local().build("policy", dict)


def test_local_shutdown_is_a_no_op_so_scripts_run_with_either_placement():
    with Local() as placement:
        assert placement.build("reward", dict, a=1) == {"a": 1}
    placement.shutdown()  # again: still nothing to do, no error
