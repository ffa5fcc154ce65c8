"""Named meshes: coordinates, axis groups, strided layouts, validation."""

from __future__ import annotations

import pytest

from hybridflow_lab.controller import Mesh
from hybridflow_lab.controller.mesh import validate_meshes


def test_row_major_puts_tp_peers_on_consecutive_ranks():
    mesh = Mesh.of(dp=2, tp=2)
    assert [mesh.coords(r) for r in range(4)] == [
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert mesh.groups("tp") == [[0, 1], [2, 3]]
    assert mesh.groups("dp") == [[0, 2], [1, 3]]
    assert mesh.rank_at(dp=1, tp=0) == 2
    assert mesh.axis_size("pp") == 1 and mesh.coord(3, "pp") == 0


def test_three_axes():
    mesh = Mesh.of(pp=2, dp=2, tp=2)
    assert mesh.size == 8
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_explicit_rank_layout_gives_strided_groups():
    # the paper's Fig. 8 generation layout over 8 ranks: tg=2 TP groups on strided ranks
    mesh = Mesh((("dp", 2), ("micro_dp", 2), ("tp", 2)), ranks=(0, 2, 1, 3, 4, 6, 5, 7))
    assert mesh.groups("tp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("micro_dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_bad_meshes_name_the_problem():
    with pytest.raises(ValueError, match=r"not a permutation"):
        Mesh((("dp", 2),), ranks=(0, 0))
    with pytest.raises(ValueError, match=r"axis 'tp' has size 0"):
        Mesh.of(dp=2, tp=0)
    with pytest.raises(ValueError, match=r"repeat"):
        Mesh((("dp", 2), ("dp", 2)))
    with pytest.raises(ValueError, match=r"mesh 'train' \(dp=2 x tp=4\) covers 8 ranks but the group has 4"):
        validate_meshes({"train": Mesh.of(dp=2, tp=4)}, 4, "actor")
