"""torch TP plans <-> LayoutMaps, on a real transformer block, against what parallelize_module
itself does to the parameters (under the fake process group)."""

from __future__ import annotations

import copy

import pytest

import unimesh
from unimesh import Layout, LayoutError, LayoutMap, Mesh, P

torch = pytest.importorskip("torch")
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from unimesh_torch import layout_map_from_plan, plan_from_layout_map

from .torch_fake import fake_torch_world


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(32, dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)
        self.out = nn.Linear(dim, 32, bias=False)


PLAN = {
    "tok": RowwiseParallel(),
    "attn_norm": SequenceParallel(),
    "attn.w*": ColwiseParallel(),  # torch's wildcard; wo is overridden below
    "attn.wo": RowwiseParallel(),
    "ffn_norm": SequenceParallel(),
    "mlp.w1": ColwiseParallel(),
    "mlp.w2": RowwiseParallel(),
    "out": ColwiseParallel(),
}


@pytest.fixture(autouse=True)
def fake_world():
    with fake_torch_world(1, 8):
        yield


def test_layouts_are_what_parallelize_module_does():
    mesh = Mesh((2, 4), ("dp", "tp"))
    tp = mesh.submesh("tp", containing=1)
    torch.manual_seed(0)
    model = Block()
    plan = {k: v for k, v in PLAN.items() if k != "attn.w*"}
    plan |= {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel()}
    plan |= {"attn.wv": ColwiseParallel()}
    lm = layout_map_from_plan(model, plan, mesh, "tp")
    parallelized = parallelize_module(copy.deepcopy(model), unimesh.to_native(tp, "torch"), plan)
    seen = 0
    for path, param in parallelized.named_parameters():
        want = lm.get(path)
        if isinstance(param, DTensor):
            got = Layout.from_placements(tp, param.placements, param.ndim)
            assert want is not None, path
            assert Layout(tp, want.spec) == got, (path, want.spec, got.spec)
            seen += 1
        else:  # parallelize_module left it alone: no rule, or a replicated one
            assert want is None or not want.spec.axes(), (path, want)
    assert seen == 15  # tok, norms (2 each), q, k, v, wo (+bias), w1 (+b), w2 (+b), out
    assert lm.get("attn.wq.weight").spec == P("tp", None)  # torch Linear.weight is [out, in]
    assert lm.get("mlp.w2.weight").spec == P(None, "tp")
    assert lm.get("mlp.w2.bias").spec == P()
    assert lm.get("tok.weight").spec == P("tp", None)  # Rowwise on an Embedding: vocab rows


def test_wildcard_keys_match_as_torch_matches_them():
    mesh = Mesh((4,), ("tp",))
    lm = layout_map_from_plan(Block(), {"attn.w*": ColwiseParallel()}, mesh)
    want = [rf"attn\.{n}\.weight" for n in ("wq", "wk", "wv", "wo")] + [r"attn\.wo\.bias"]
    assert sorted(lm) == sorted(want)


def test_plan_round_trips_through_the_layout_map():
    mesh = Mesh((4,), ("tp",))
    model = Block()
    lm = layout_map_from_plan(model, PLAN, mesh)
    plan = plan_from_layout_map(model, lm)
    want = {
        "tok": "RowwiseParallel",
        "attn.wq": "ColwiseParallel",
        "attn.wk": "ColwiseParallel",
        "attn.wv": "ColwiseParallel",
        "attn.wo": "RowwiseParallel",
        "mlp.w1": "ColwiseParallel",
        "mlp.w2": "RowwiseParallel",
        "out": "ColwiseParallel",
    }
    assert {k: type(v).__name__ for k, v in plan.items()} == want  # norms: no parameter split
    again = layout_map_from_plan(model, plan, mesh)
    assert dict(again.items()) == {k: v for k, v in lm.items() if "_norm" not in k}


def test_bad_plans_and_maps_name_the_entry():
    mesh = Mesh((4,), ("tp",))
    with pytest.raises(LayoutError, match=r"'nope' names no submodule of Block"):
        layout_map_from_plan(Block(), {"nope": ColwiseParallel()}, mesh)
    with pytest.raises(LayoutError, match=r"ColwiseParallel on 'attn_norm' \(LayerNorm\)"):
        layout_map_from_plan(Block(), {"attn_norm": ColwiseParallel()}, mesh)
    with pytest.raises(LayoutError, match=r"'attn' is PrepareModuleInput.*leave them out"):
        layout_map_from_plan(Block(), {"attn": PrepareModuleInput()}, mesh)
    with pytest.raises(LayoutError, match=r"axis 'model' is not in Mesh\(tp=4\)"):
        layout_map_from_plan(Block(), PLAN, mesh, axis="model")
    with pytest.raises(LayoutError, match=r"a TP plan is a dict"):
        layout_map_from_plan(Block(), [("tok", RowwiseParallel())], mesh)
    with pytest.raises(LayoutError, match=r"needs a unimesh.LayoutMap, got \{'mlp'"):
        plan_from_layout_map(Block(), {"mlp": P("tp")})
    odd = LayoutMap(mesh, {r"mlp\.w1\.weight": P(None, None, "tp")})
    with pytest.raises(LayoutError, match=r"layouts of 'mlp.w1' \(Linear\).*no torch TP style"):
        plan_from_layout_map(Block(), odd)


def test_the_porting_guide_example_runs():
    """docs/porting.md's plan example, run as written with the test's transformer block."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "porting.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.DOTALL) if "plan = {" in b]
    ns: dict = {"model": Block()}
    exec(compile(code, "porting.md", "exec"), ns)  # noqa: S102 - our own docs
    assert ns["layouts"].get("attn.wq.weight").spec == P("tp", None)
    assert ns["layouts"].get("mlp.w2.bias").spec == P()
    assert type(ns["plan_again"]["tok"]).__name__ == "RowwiseParallel"
    assert type(ns["plan_again"]["attn.wo"]).__name__ == "RowwiseParallel"
