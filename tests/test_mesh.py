"""MeshConfig parsing and resolution, and make_mesh on the 8 simulated CPU devices."""

import jax
import pytest
from jax.sharding import AxisType

from eqgpt.parallel import AXES, MeshConfig, make_mesh, mesh_config


def test_parse_names_axes_and_leaves_the_rest_at_one():
    cfg = MeshConfig.parse("data=2, fsdp=2,tensor=2")
    assert cfg == MeshConfig(data=2, fsdp=2, tensor=2)
    assert cfg.shape == (2, 2, 1, 1, 1, 2) and cfg.size == 8
    assert MeshConfig.parse("") == MeshConfig()
    assert str(cfg) == "data=2,fsdp=2,tensor=2"


def test_minus_one_fills_the_remaining_devices():
    assert MeshConfig.parse("tensor=2,data=-1").resolve(8) == MeshConfig(data=4, tensor=2)
    assert MeshConfig(fsdp=-1).resolve(8).fsdp == 8


@pytest.mark.parametrize(
    "text, match",
    [
        ("data=2,model=4", "axis=size"),
        ("data", "axis=size"),
        ("data=two", "not an integer"),
        ("data=2,data=4", "given twice"),
        ("data=-1,tensor=-1", "at most one"),
        ("data=0", "positive"),
    ],
)
def test_bad_mesh_text_raises_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        MeshConfig.parse(text)


def test_product_mismatch_names_both_counts():
    with pytest.raises(ValueError, match=r"has 6 devices but there are 8"):
        MeshConfig(data=3, tensor=2).resolve(8)
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide 8"):
        MeshConfig(data=3, tensor=-1).resolve(8)
    with pytest.raises(ValueError, match="6 devices but there are 8"):
        make_mesh("data=3,tensor=2")


def test_make_mesh_has_all_six_axes_in_order_with_auto_types():
    mesh = make_mesh("fsdp=4,tensor=2")
    assert tuple(mesh.axis_names) == AXES
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "pipeline": 1, "context": 1, "expert": 1, "tensor": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == jax.device_count() == 8
    assert mesh_config(mesh) == MeshConfig(fsdp=4, tensor=2)


def test_default_mesh_is_data_parallel_and_explicit_types_pass_through():
    assert mesh_config(make_mesh()) == MeshConfig(data=8)
    mesh = make_mesh(MeshConfig(data=2, tensor=4), axis_types=AxisType.Explicit)
    assert all(t == AxisType.Explicit for t in mesh.axis_types)


def test_a_subset_of_devices_and_inner_axes_are_consecutive_devices():
    mesh = make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    assert mesh.devices.size == 4
    ids = [[d.id for d in row] for row in mesh.devices.reshape(2, 2)]
    assert ids == [[0, 1], [2, 3]]  # tensor (innermost) groups neighbouring devices
