"""AxisRules against flax's own ``logical_to_mesh_axes`` (the resolver MaxText uses)."""

from __future__ import annotations

import pytest
from flax.linen import logical_to_mesh_axes
from hypothesis import given, settings
from hypothesis import strategies as st

from unimesh import AxisRules, LayoutError, Mesh, P

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

MESH_AXES = ("data", "fsdp", "tp", "ep")
LOGICAL = ("batch", "embed", "mlp", "heads", "kv", "vocab")

target = st.one_of(
    st.none(),
    st.sampled_from(MESH_AXES),
    st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=3, unique=True).map(tuple),
)
rule_lists = st.lists(st.tuples(st.sampled_from(LOGICAL), target), max_size=10)
tensor_axes = st.lists(st.one_of(st.none(), st.sampled_from(LOGICAL)), max_size=4).filter(
    lambda names: len([n for n in names if n]) == len({n for n in names if n})
)


def flax_spec(rules: list[tuple[str, object]], names: tuple[str | None, ...]) -> P:
    """flax's answer, normalised the way unimesh spells entries (("tp",) is "tp")."""
    return P(*logical_to_mesh_axes(names, rules))


@settings(max_examples=1500, deadline=None)
@given(rule_lists, tensor_axes)
def test_matches_flax_on_random_rules(rules: list[tuple[str, object]], names: list) -> None:
    names_t = tuple(names)
    assert AxisRules(rules).spec(names_t) == flax_spec(rules, names_t)


def test_issue_example_keeps_the_tensor_parallel_split() -> None:
    rules = [("mlp", "tp"), ("embed", ("fsdp", "tp")), ("embed", "fsdp")]
    assert flax_spec(rules, ("embed", "mlp")) == P("fsdp", "tp")
    assert AxisRules(rules).spec(("embed", "mlp")) == P("fsdp", "tp")


def test_maxtext_style_fallbacks() -> None:
    """Names with several rules, tuple mesh axes and None rules, as MaxText's defaults have."""
    rules = [
        ("activation_batch", ("data", "fsdp")),
        ("activation_heads", ("tp", "ep")),
        ("activation_heads", "tp"),
        ("activation_embed", "tp"),
        ("mlp", ("tp", "ep")),
        ("vocab", "tp"),
        ("embed", ("fsdp", "ep")),
        ("embed", "fsdp"),
        ("heads", "tp"),
        ("kv", None),
        ("kv", "tp"),
        ("norm", None),
    ]
    cases = [
        ("activation_batch", "activation_heads", "kv"),
        ("embed", "mlp"),
        ("mlp", "embed"),
        ("embed", "heads", "kv"),
        ("vocab", "embed"),
        ("activation_heads", "activation_embed"),
        ("norm", None, "heads"),
    ]
    ours = AxisRules(rules)
    for names in cases:
        assert ours.spec(names) == flax_spec(rules, names), names
    mesh = Mesh((1, 2, 2, 2), ("data", "fsdp", "tp", "ep"))
    assert ours.spec(("embed", "mlp"), mesh) == P("fsdp", ("tp", "ep"))


def test_bad_logical_axes() -> None:
    rules = AxisRules([("embed", "tp")])
    with pytest.raises(LayoutError, match=r"logical axis 'embed' names more than one dim"):
        rules.spec(("embed", "embed"))
    with pytest.raises(ValueError, match="more than once"):  # flax refuses it as well
        logical_to_mesh_axes(("embed", "embed"), [("embed", "tp")])
    with pytest.raises(LayoutError, match=r"logical axis 3 must be a str or None"):
        rules.spec(("embed", 3))  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"no rule for logical axis 'mlp'"):
        rules.spec(("embed", "mlp"), strict=True)
