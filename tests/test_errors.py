"""Every bad input gets a UnimeshError subclass whose message names the value and the fix."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import unimesh
from unimesh import (
    Layout,
    Mesh,
    P,
    UnimeshError,
)

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

from .support.error_cases import CASES


@pytest.mark.parametrize("call, cls, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call: Callable[[], Any], cls: type[Exception], fragment: str) -> None:
    with pytest.raises(cls, match=re.escape(fragment)) as info:
        call()
    assert isinstance(info.value, UnimeshError)


def test_catalogue_is_large_and_distinct() -> None:
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


def test_errors_are_builtin_subclasses() -> None:
    assert issubclass(unimesh.MeshSpecError, ValueError)
    assert issubclass(unimesh.LayoutError, ValueError)
    assert issubclass(unimesh.BackendNotFoundError, LookupError)
    assert issubclass(unimesh.BackendUnavailableError, ImportError)
    assert issubclass(unimesh.UnsupportedError, NotImplementedError)
    assert issubclass(unimesh.MeshMismatchError, RuntimeError)
    for cls in (
        unimesh.MeshSpecError,
        unimesh.LayoutError,
        unimesh.BackendNotFoundError,
        unimesh.BackendUnavailableError,
        unimesh.UnsupportedError,
        unimesh.MeshMismatchError,
        unimesh.ConversionError,
    ):
        assert issubclass(cls, UnimeshError)


def test_numpy_ints_are_accepted() -> None:
    m = Mesh(np.array([2, 2]), ("a", "b"), np.array([[1, 0], [3, 2]], dtype=np.int32))
    assert m.coords(np.int64(0)) == {"a": 0, "b": 1}


def test_a_misspelt_axis_gets_the_close_match():
    """A typo in an axis name is answered with the axis meant, in the mesh and in a layout;
    a name close to none gets no guess."""
    import pytest

    import unimesh

    mesh = unimesh.make_mesh({"data": 2, "model": 4})
    with pytest.raises(
        unimesh.MeshSpecError, match=r"unknown axis 'modle' \(did you mean 'model'\?\)"
    ):
        mesh.groups("modle")
    with pytest.raises(unimesh.LayoutError, match=r"names axis 'dta' \(did you mean 'data'\?\)"):
        Layout(mesh, P("dta", None))
    with pytest.raises(unimesh.MeshSpecError) as caught:
        mesh.groups("pipeline")
    assert "did you mean" not in str(caught.value)


def test_close_match_guesses_only_for_a_plain_name():
    """messages.close_match answers any input without raising: a guess for a near string,
    nothing for non-strings, huge names or choices that are not a list of names."""
    from unimesh.messages import close_match

    assert close_match("tpp", ("dp", "tp")) == " (did you mean 'tp'?)"
    assert close_match("tpp", ["dp", 3, None, "tp"]) == " (did you mean 'tp'?)"
    for name, choices in [
        (5, ("dp",)),
        (None, ("dp",)),
        ("d" * 10**6, ("d" * 10**6,)),
        ("dp", "dp"),
        ("dp", iter(["dp"])),
        ("zzz", ("dp", "tp")),
    ]:
        assert close_match(name, choices) == ""


def test_stop_gradient_refuses_what_no_backend_differentiates() -> None:
    import unimesh

    with pytest.raises(unimesh.ConversionError, match=r"stop_gradient\(\) got .*object.*give a"):
        unimesh.stop_gradient({"w": object()})
    assert unimesh.stop_gradient({"a": 1.5, "b": None}) == {"a": 1.5, "b": None}
