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

from .support.torch_fake import fake_torch_world


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
    with pytest.raises(LayoutError, match=r"'attn' is .*ReplicateComputation.*skips Prepare"):
        layout_map_from_plan(Block(), {"attn": _NotAStyle()}, mesh)
    with pytest.raises(LayoutError, match=r"under='blocks\.\*' names no submodule"):
        layout_map_from_plan(Block(), {"wq": ColwiseParallel()}, mesh, under="blocks.*")
    with pytest.raises(LayoutError, match=r"names=.*'jax'.*pick 'torch', 'flax' or 'keras'"):
        layout_map_from_plan(Block(), PLAN, mesh, names="jax")
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
    """docs/porting.md's plan example, run as written with the tutorial's Llama model."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "porting.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    (code,) = [b for b in blocks if "layer_plan = {" in b]
    ns: dict = {"model": Llama()}
    exec(compile(code, "porting.md", "exec"), ns)  # noqa: S102 - our own docs
    assert ns["layouts"] == _llama_map(Llama(), ns["mesh"])
    assert ns["layouts"].get("layers.0.attention.wq.weight").spec == P("tp", None)
    assert ns["layouts"].get("layers.0.attention_norm.weight").spec == P()
    assert type(ns["plan_again"]["tok_embeddings"]).__name__ == "RowwiseParallel"
    assert type(ns["plan_again"]["layers.1.attention.wo"]).__name__ == "RowwiseParallel"
    assert ns["fsdp_tp"].get("layers.0.attention.wq.weight").spec == P(("tp", "dp"), None)
    assert ns["fsdp_tp"].get("layers.0.attention.wo.weight").spec == P("dp", "tp")
    assert ns["flax_layouts"].get("layers/0/attention/wq/kernel").spec == P(None, "tp")
    assert ns["flax_layouts"].get("params/output/kernel").spec == P(None, "tp")


def _merged(*maps: LayoutMap) -> LayoutMap:
    out = LayoutMap(maps[0].mesh)
    for m in maps:
        out.update(m)
    return out


class _NotAStyle:
    """Stands for a plan value unimesh does not read (named as torch's FSDP internals are)."""

    def __repr__(self) -> str:
        return "ReplicateComputation()"


# The PyTorch TP tutorial's and torchtitan's Llama plans, written as they write them: a
# model-level plan and a per-block plan with PrepareModuleInput entries (facts from
# pytorch/tutorials intermediate_source/TP_tutorial.rst and torchtitan's parallelize_llama)
class Llama(nn.Module):
    class Attention(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
            self.wo = nn.Linear(dim, dim, bias=False)

    class FeedForward(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.w1, self.w3 = (
                nn.Linear(dim, 4 * dim, bias=False),
                nn.Linear(dim, 4 * dim, bias=False),
            )
            self.w2 = nn.Linear(4 * dim, dim, bias=False)

    class Layer(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
            self.attention = Llama.Attention(dim)
            self.feed_forward = Llama.FeedForward(dim)

    def __init__(self, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, dim)
        self.layers = nn.ModuleDict({str(i): Llama.Layer(dim) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, 32, bias=False)


def _llama_plans() -> tuple[dict[str, object], dict[str, object]]:
    from torch.distributed.tensor import Replicate, Shard

    model_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    layer_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(use_local_output=False),
        "attention.wk": ColwiseParallel(use_local_output=False),
        "attention.wv": ColwiseParallel(use_local_output=False),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return model_plan, layer_plan


def _llama_map(model: nn.Module, mesh: Mesh, names: str = "torch") -> LayoutMap:
    """The per-block plan over every block (``under=``), then the model plan, as one map."""
    model_plan, layer_plan = _llama_plans()
    return _merged(
        layout_map_from_plan(model, layer_plan, mesh, under="layers.*", names=names),
        layout_map_from_plan(model, model_plan, mesh, names=names),
    )


def _parallelized(mesh: Mesh, fsdp: bool) -> tuple[nn.Module, nn.Module]:
    """The tutorial's model, and a copy parallelized as torchtitan does it (each block with the
    per-block plan, then the model plan; FSDP2 over ``dp`` on top when ``fsdp``)."""
    model_plan, layer_plan = _llama_plans()
    torch.manual_seed(0)
    model = Llama()
    native = unimesh.to_native(mesh, "torch")
    done = copy.deepcopy(model)
    for block in done.layers.values():
        parallelize_module(block, native["tp"], layer_plan)
    parallelize_module(done, native["tp"], model_plan)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in done.layers.values():
            fully_shard(block, mesh=native["dp"])
        fully_shard(done, mesh=native["dp"])
    return model, done


def _layouts_agree(done: nn.Module, lm: LayoutMap, mesh: Mesh) -> int:
    sharded = 0
    for path, param in done.named_parameters():
        want = lm.get(path)
        assert want is not None, path
        assert isinstance(param, DTensor), path
        got = Layout.from_placements(mesh, param.placements, param.ndim)
        assert got == want, (path, param.placements, want.spec)
        sharded += bool(want.spec.axes())
    return sharded


def test_the_tutorials_plans_as_written_give_what_parallelize_module_does():
    """Issue 40: a real sequence-parallel plan (PrepareModuleInput entries) is read as
    written; a per-block plan applies to each block through ``under=``."""
    mesh = Mesh((2, 4), ("dp", "tp"))
    model, done = _parallelized(mesh, fsdp=False)
    lm = _llama_map(model, mesh)
    assert len(lm) == len(list(model.named_parameters()))
    tp = mesh.submesh("tp", containing=1)  # this process is rank 1 of the fake world
    for path, param in done.named_parameters():
        got = Layout.from_placements(tp, param.placements, param.ndim)
        assert got == Layout(tp, lm.get(path).spec), (path, param.placements)
    assert lm.get("layers.1.attention.wq.weight").spec == P("tp", None)
    assert lm.get("layers.0.feed_forward.w2.weight").spec == P(None, "tp")
    assert lm.get("layers.0.attention_norm.weight").spec == P()
    # the same plan with torch's own wildcard keys instead of under=
    _, layer_plan = _llama_plans()
    wild = {f"layers.*.{k}": v for k, v in layer_plan.items()}
    assert layout_map_from_plan(model, wild, mesh) == layout_map_from_plan(
        model, layer_plan, mesh, under="layers.*"
    )


def test_with_fsdp_gives_what_fully_shard_over_the_tp_plan_does():
    """FSDP2 over TP: every parameter's dim 0 split over ``dp`` again (``_StridedShard`` on
    the TP-split dims), exactly as fully_shard leaves the parameters."""
    mesh = Mesh((2, 4), ("dp", "tp"))
    model, done = _parallelized(mesh, fsdp=True)
    lm = _llama_map(model, mesh)
    both = lm.with_fsdp("dp", params=[n for n, _ in model.named_parameters()])
    assert _layouts_agree(done, both, mesh) == len(list(model.named_parameters()))
    assert both.get("layers.0.attention.wq.weight").spec == P(("tp", "dp"), None)
    assert both.get("layers.0.attention.wo.weight").spec == P("dp", "tp")
    assert both.get("norm.weight").spec == P("dp")
    with pytest.raises(LayoutError, match=r"axis 'pp' is not an axis"):
        lm.with_fsdp("pp")
    with pytest.raises(LayoutError, match=r"already uses axis 'tp'"):
        lm.with_fsdp("tp")
    with pytest.raises(LayoutError, match=r"iterable of parameter paths, got 'abc'"):
        lm.with_fsdp("dp", params="abc")


def test_flax_names_lay_out_the_same_model_written_in_flax():
    """names='flax': the torch plan's layouts on the flax (nnx) twin of the model, kernels
    transposed ([in, out]); the torch-named map on the flax tree is refused with the fix."""
    pytest.importorskip("jax")
    from flax import nnx

    class Attention(nnx.Module):
        def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
            self.wq, self.wk, self.wv, self.wo = (
                nnx.Linear(dim, dim, use_bias=False, rngs=rngs) for _ in range(4)
            )

    class FeedForward(nnx.Module):
        def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
            self.w1 = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
            self.w3 = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
            self.w2 = nnx.Linear(4 * dim, dim, use_bias=False, rngs=rngs)

    class Layer(nnx.Module):
        def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
            self.attention_norm = nnx.RMSNorm(dim, rngs=rngs)
            self.ffn_norm = nnx.RMSNorm(dim, rngs=rngs)
            self.attention = Attention(dim, rngs)
            self.feed_forward = FeedForward(dim, rngs)

    class FlaxLlama(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.tok_embeddings = nnx.Embed(32, 8, rngs=rngs)
            self.layers = nnx.List([Layer(8, rngs) for _ in range(2)])
            self.norm = nnx.RMSNorm(8, rngs=rngs)
            self.output = nnx.Linear(8, 32, use_bias=False, rngs=rngs)

    mesh = Mesh((2, 4), ("dp", "tp"))
    torch_model = Llama()
    lm = _llama_map(torch_model, mesh, names="flax")
    flax_model = FlaxLlama(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(flax_model, nnx.Param))
    placed = unimesh.shard_params(params, lm, backend="jax")
    torch_lm = _llama_map(torch_model, mesh)
    pairs = {
        "layers/1/attention/wq/kernel": "layers.1.attention.wq.weight",
        "layers/0/feed_forward/w2/kernel": "layers.0.feed_forward.w2.weight",
        "tok_embeddings/embedding": "tok_embeddings.weight",
        "output/kernel": "output.weight",
        "norm/scale": "norm.weight",
    }
    flat = {"/".join(map(str, k)): v for k, v in _flatten(placed)}
    for flax_path, torch_path in pairs.items():
        spec = torch_lm.get(torch_path).spec
        if flax_path.endswith("kernel"):
            spec = P(spec[1], spec[0])  # torch [out, in] -> flax [in, out]
        want = unimesh.to_native(Layout(mesh, spec), "jax")
        assert flat[flax_path].sharding.is_equivalent_to(want, 2 if spec else 1), flax_path
    # the torch-named map on the flax tree matched nothing: refused, naming the way out
    refused = r"21 of 21 .*match no parameter.*closest: 'layers/0/attention_norm/scale'.*flax'"
    with pytest.raises(LayoutError, match=refused):
        unimesh.shard_params(params, torch_lm, backend="jax")
    with pytest.warns(UserWarning, match=r"match no parameter"):
        unimesh.shard_params(params, torch_lm, backend="jax", strict=False)


def _flatten(
    tree: object, prefix: tuple[object, ...] = ()
) -> list[tuple[tuple[object, ...], object]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flatten(v, (*prefix, k))]
    return [(prefix, tree)]
