"""Unit tests of PartitionSpec, Layout, placements, LayoutMap and AxisRules."""

from __future__ import annotations

import pickle

import pytest

from unimesh import (
    AxisRules,
    Layout,
    LayoutError,
    LayoutMap,
    Mesh,
    P,
    Partial,
    PartitionSpec,
    Replicate,
    Shard,
    StridedShard,
)

pytestmark = pytest.mark.quick  # framework-free and fast: in the quick tier

M24 = Mesh((2, 4), ("dp", "tp"))
PERM = Mesh((2, 2), ("dp", "tp"), [[1, 0], [3, 2]])


def chunk_ref(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk written out: ceil-sized chunks, then empty ones."""
    step = -(-n // parts)
    return [(min(i * step, n), min((i + 1) * step, n)) for i in range(parts)]


def test_partition_spec_basics():
    s = P("dp", None, ("tp", "cp"))
    assert len(s) == 3 and s[0] == "dp" and s[2] == ("tp", "cp")
    assert list(s) == ["dp", None, ("tp", "cp")]
    assert s.axes() == ("dp", "tp", "cp")
    assert P(("x",)) == P("x") and P(()) == P(None)
    assert P("a", partial={"b": "sum"}) != P("a")
    assert P("a", partial={"b": "sum", "c": "max"}) == P("a", partial={"c": "max", "b": "sum"})
    assert hash(P("a", ("b", "c"))) == hash(PartitionSpec("a", ["b", "c"]))
    assert repr(s) == "P('dp', None, ('tp', 'cp'))"
    assert repr(P("a", partial={"b": "avg"})) == "P('a', partial={'b': 'avg'})"
    assert P("a", None) == ("a", None)
    assert pickle.loads(pickle.dumps(P("a", partial={"b": "min"}))) == P("a", partial={"b": "min"})


def test_shard_slices_even():
    lay = Layout(M24, P("dp", "tp"))
    assert lay.shard_slices((4, 8), 0) == (slice(0, 2), slice(0, 2))
    assert lay.shard_slices((4, 8), 6) == (slice(2, 4), slice(4, 6))
    assert lay.shard_shape((4, 8), 7) == (2, 2)
    # a spec shorter than the tensor replicates trailing dims
    assert Layout(M24, P("tp")).shard_slices((8, 5), 3) == (slice(6, 8), slice(0, 5))
    # replicated everywhere
    assert Layout(M24, P()).shard_slices((3,), 5) == (slice(0, 3),)


def test_shard_slices_uneven_follow_torch_chunk():
    lay = Layout(Mesh((4,), ("x",)), P("x"))
    for n in range(11):
        got = [(s[0].start, s[0].stop) for s in (lay.shard_slices((n,), d) for d in range(4))]
        assert got == chunk_ref(n, 4), n
    # 5 over 4: torch.chunk gives 2,2,1 and an empty fourth shard
    assert [lay.shard_shape((5,), d) for d in range(4)] == [(2,), (2,), (1,), (0,)]


def test_tuple_entry_splits_major_axis_first():
    lay = Layout(M24, P(("dp", "tp")))
    # dp first: halves of 16, then tp chunks each half in 4 -> device d holds [2d, 2d+2)
    for d in range(8):
        assert lay.shard_slices((16,), d) == (slice(2 * d, 2 * d + 2),)
    rev = Layout(M24, P(("tp", "dp")))
    for d in range(8):
        c = M24.coords(d)
        start = c["tp"] * 4 + c["dp"] * 2
        assert rev.shard_slices((16,), d) == (slice(start, start + 2),)
    # uneven: 10 over (dp, tp): dp chunks 5,5; tp chunks each 5 as 2,2,1,0
    got = [rev.shard_shape((10,), d) for d in range(8)]
    ref_tp = chunk_ref(10, 4)
    for d in range(8):
        c = M24.coords(d)
        lo, hi = ref_tp[c["tp"]]
        sub = chunk_ref(hi - lo, 2)[c["dp"]]
        assert got[d] == (sub[1] - sub[0],)


def test_permuted_device_ids_use_mesh_coordinates():
    lay = Layout(PERM, P(("dp", "tp")))
    # device 0 sits at (0, 1): the reference gives it elements 2-3 of arange(8)
    assert lay.shard_slices((8,), 0) == (slice(2, 4),)
    assert lay.shard_slices((8,), 1) == (slice(0, 2),)


def test_device_slices_and_bounds():
    lay = Layout(PERM, P("tp", "dp"))
    ds = lay.device_slices((4, 6))
    assert set(ds) == {0, 1, 2, 3}
    for d, sl in ds.items():
        assert sl == lay.shard_slices((4, 6), d)
    lo, hi = lay.shard_bounds((4, 6))
    assert lo.shape == (4, 2) and hi.shape == (4, 2)
    assert [tuple(r) for r in lo.tolist()] == [
        (ds[d][0].start, ds[d][1].start) for d in PERM.device_ids.ravel().tolist()
    ]


def test_shard_counts_and_global_shape():
    assert Layout(M24, P("dp", None, "tp")).shard_counts() == (2, 1, 4)
    assert Layout(M24, P(None, ("tp", "dp"))).shard_counts() == (1, 8)
    assert Layout(M24, P()).shard_counts() == ()
    lay = Layout(M24, P(None, "tp"))
    assert lay.global_shape((3, 2, 5)) == (3, 8, 5)
    for device in lay.device_slices((3, 8, 5)):
        assert lay.shard_shape((3, 8, 5), device) == (3, 2, 5)
    with pytest.raises(LayoutError, match=r"2 entries but the tensor shape \(3,\) has only 1"):
        lay.global_shape((3,))
    with pytest.raises(LayoutError, match="global_shape must be a tuple of ints, got '3'"):
        lay.global_shape("3")


def test_is_even():
    assert Layout(M24, P("dp", "tp")).is_even((4, 8))
    assert not Layout(M24, P("dp", "tp")).is_even((4, 6))
    assert not Layout(M24, P(("dp", "tp"))).is_even((12,))
    assert Layout(M24, P(None, "dp")).is_even((3, 2))


def test_placements_rule():
    m3 = Mesh((2, 3, 4), ("a", "b", "c"))
    assert Layout(m3, P("a", "c")).placements() == (Shard(0), Replicate(), Shard(1))
    assert Layout(m3, P(("a", "c"))).placements() == (Shard(0), Replicate(), Shard(0))
    # c (index 2) before a (index 0): a gets split_factor size(c) = 4
    assert Layout(m3, P(("c", "a"))).placements() == (StridedShard(0, 4), Replicate(), Shard(0))
    assert Layout(m3, P(("c", "b", "a"))).placements() == (
        StridedShard(0, 12),
        StridedShard(0, 4),
        Shard(0),
    )
    assert Layout(m3, P(("b", "c", "a"))).placements() == (StridedShard(0, 12), Shard(0), Shard(0))
    assert Layout(m3, P(None, "b", partial={"c": "max"})).placements() == (
        Replicate(),
        Shard(1),
        Partial("max"),
    )


def test_from_placements_round_trips():
    m3 = Mesh((2, 3, 4), ("a", "b", "c"))
    for spec in [
        P(),
        P("a"),
        P(None, "c"),
        P(("c", "a"), "b"),
        P(("b", "c", "a")),
        P(("c", "b", "a")),
        P(("a", "c"), partial={"b": "avg"}),
        P(None, None, "a"),
        P("a", None, None),
    ]:
        lay = Layout(m3, spec)
        assert Layout.from_placements(m3, lay.placements(), len(spec)) == lay, spec
    assert Layout.from_placements(m3, Layout(m3, P("a")).placements(), 3) == Layout(
        m3, P("a", None, None)
    )
    assert Layout.from_placements(m3, [Shard(-1), Replicate(), Replicate()], 2) == Layout(
        m3, P(None, "a")
    )


def test_from_placements_rejects_inexpressible():
    m3 = Mesh((2, 3, 4), ("a", "b", "c"))
    with pytest.raises(LayoutError, match="no PartitionSpec equivalent"):
        Layout.from_placements(m3, [StridedShard(0, 5), Replicate(), Shard(0)], 1)
    with pytest.raises(LayoutError, match="no PartitionSpec equivalent"):
        Layout.from_placements(m3, [StridedShard(0, 4), Replicate(), Replicate()], 1)


def test_layout_equality_pickle():
    a = Layout(M24, P("dp"))
    assert a == Layout(M24, ("dp",)) == Layout(M24, ["dp"])
    assert a != Layout(M24, P("tp"))
    assert hash(a) == hash(Layout(M24, P("dp")))
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == "Layout(Mesh(dp=2, tp=4), P('dp'))"


def test_layout_map_keras_semantics():
    lm = LayoutMap(
        M24, {"dense.*kernel": (None, "tp"), "dense.*bias": ("tp",), ".*embedding.*": P("tp", None)}
    )
    assert lm.get("dense_1/kernel") == Layout(M24, P(None, "tp"))
    assert lm["dense_2/bias"] == Layout(M24, P("tp"))
    # re.fullmatch, as Keras 3 does: the pattern must cover the whole path
    assert lm.get("model/dense_1/kernel") is None
    assert lm.get("dense_1/kernel_extra") is None
    assert lm.get("model/embedding/embeddings") == Layout(M24, P("tp", None))
    assert lm.get("conv/kernel") is None
    lm["conv/.*"] = P("dp")
    assert lm.get("conv/kernel") == Layout(M24, P("dp"))
    assert len(lm) == 4 and list(lm)[:2] == ["dense.*kernel", "dense.*bias"]
    assert "conv/.*" in lm
    del lm["conv/.*"]
    assert lm.get("conv/kernel") is None
    exact = LayoutMap(M24, [("a.*", P("dp")), ("ab", P("tp")), (".*b", P(None, "dp"))])
    assert exact.get("ab") == Layout(M24, P("tp"))  # an exact key wins over regex matches
    with pytest.raises(
        LayoutError, match=r"matches more than one LayoutMap key: 'a\.\*' and '\.\*b'"
    ):
        exact.get("axb")


def test_axis_rules_first_unused_wins():
    rules = AxisRules(
        [
            ("batch", ("dp", "fsdp")),
            ("embed", "fsdp"),
            ("embed", "tp"),
            ("mlp", "tp"),
            ("heads", "tp"),
            ("kv", None),
        ]
    )
    assert rules.spec(("batch", "embed")) == P(("dp", "fsdp"), "tp")
    assert rules.spec(("embed", "mlp")) == P("fsdp", "tp")
    assert rules.spec(("mlp", "heads")) == P("tp", None)  # tp already used
    assert rules.spec(("kv", None, "unknown")) == P(None, None, None)
    with pytest.raises(LayoutError, match="no rule for logical axis 'unknown'"):
        rules.spec(("unknown",), strict=True)
    mesh = Mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    assert rules.layout(("batch", "mlp"), mesh) == Layout(mesh, P(("dp", "fsdp"), "tp"))
    with pytest.raises(LayoutError, match="names axis 'fsdp', which is not in"):
        rules.spec(("embed",), M24)
    assert AxisRules({"batch": "dp"}).spec(("batch",)) == P("dp")


def test_layout_equality_is_by_meaning():
    """Trailing replicated dims do not change a layout (JAX's NamedSharding compares the same
    way); the spec itself stays exact."""
    m = Mesh((2, 4), ("dp", "tp"))
    assert Layout(m, P()) == Layout(m, P(None)) == Layout(m, P(None, None))
    assert Layout(m, P("dp")) == Layout(m, P("dp", None))
    assert hash(Layout(m, P("dp"))) == hash(Layout(m, P("dp", None)))
    assert Layout(m, P("dp")) != Layout(m, P(None, "dp"))
    assert Layout(m, P("dp")) != Layout(m, P("dp", partial={"tp": "sum"}))
    assert P("dp") != P("dp", None)
    assert len({Layout(m, P()), Layout(m, P(None)), Layout(m, P("tp"))}) == 2
    for shape in [(8, 4), (3, 5, 2)]:
        assert Layout(m, P("dp")).device_slices(shape) == Layout(m, P("dp", None)).device_slices(
            shape
        )


def test_partition_spec_from_string_is_the_config_and_command_line_form():
    from unimesh import LayoutError

    assert P.from_string("dp+fsdp, None,_,tp,") == P(("dp", "fsdp"), None, None, "tp", None)
    assert P.from_string("") == P(None)
    with pytest.raises(LayoutError, match="must be a str like 'dp,None', got 3"):
        P.from_string(3)  # type: ignore[arg-type]
