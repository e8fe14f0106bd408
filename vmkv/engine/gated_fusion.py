"""A compiled model's gated MLP activation, `silu(gate(x)) * up(x)`, moved into the GEMM.

cpu_linear.py runs an MLP's gate and up linears as one `vmkv::packed_linear` call (their
weights stacked), and the model's own code then takes SiLU of one half and multiplies it by the
other: a pointwise kernel that reads the GEMM's whole [tokens, 2 x intermediate] output back from
memory and writes half of it again. This inductor pass (post-grad, so the model's code stays
unmodified) finds that pattern in the graph and puts one call of `vmkv::packed_gated_linear` in
its place, whose GEMM on weights in pairs writes silu(gate) * up as it writes its sums
(gemv_kernel.py), rounding where the model's ops round: the outputs are the same bits but for a
rare last one.

Measured on a 2-core AMX Xeon (the default model's gate/up weight [3072, 576], 30 of them from
memory, ms per layer, unfused = the GEMM plus the compiled activation): on the tile unit 2,048
rows 4.67 -> 3.39, 1,024 rows 2.42 -> 1.77, 64 rows 0.25 -> 0.17; on `vdpbf16ps` alone 0.94-0.95x
at 16-2,048 rows but level at 64.

The pass is installed where the operator computes it in one GEMM (`gemv_kernel.gated_gemm`);
elsewhere the graph stays as it was.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

aten, prims = torch.ops.aten, torch.ops.prims


class FuseGatedLinears(CustomGraphPass):
    """Replaces `mul(silu(split(L)[0]), split(L)[1])`, L a `vmkv::packed_linear` call used only
    by that split into two equal halves, with `vmkv::packed_gated_linear` of L's arguments.
    SiLU is matched as aten's op or as the decomposition inductor leaves in post-grad graphs:
    `to(x / (1 + exp(-x)), dtype)` of `x = to(g, float32)`."""

    def __init__(self) -> None:
        self.fused = 0  # calls replaced, over every graph this pass saw

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            linear = _gated_linear(node)
            if linear is None:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.vmkv.packed_gated_linear.default, linear.args)
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            self.fused += 1
        graph.eliminate_dead_code()

    def uuid(self) -> bytes:
        """Inductor's cache key for the pass: this file's contents."""
        return get_hash_for_files((__file__,))


def _gated_linear(mul: Node) -> Node | None:
    """The packed_linear call whose halves `mul` multiplies as silu(first) * second, or None."""
    if mul.op != "call_function" or mul.target is not aten.mul.Tensor or len(mul.args) != 2:
        return None
    for silu, up in (mul.args, reversed(mul.args)):
        gate = _silu_input(silu)
        if gate is None or not isinstance(up, Node):
            continue
        halves = _halves(gate, up)
        if halves is not None and len(silu.users) == 1 and len(up.users) == 1:
            return halves
    return None


def _silu_input(node: object) -> Node | None:
    """x where `node` is silu(x), used only by that SiLU; else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target is aten.silu.default:
        x = node.args[0]
        return x if isinstance(x, Node) and len(x.users) == 1 else None
    # to(x32 / (1 + exp(-x32)), dtype), x32 = to(x, float32)
    if node.target is not prims.convert_element_type.default:
        return None
    div = node.args[0]
    if not _is(div, aten.div.Tensor) or len(div.users) != 1:
        return None
    x32, denominator = div.args
    if not _is(x32, prims.convert_element_type.default) or x32.args[1] != torch.float32:
        return None
    if len(x32.users) != 2:  # the division and the negation
        return None
    if not _is(denominator, aten.add.Tensor) or denominator.args[1] != 1:
        return None
    exp = denominator.args[0]
    if not _is(exp, aten.exp.default) or not _is(exp.args[0], aten.neg.default):
        return None
    if exp.args[0].args[0] is not x32:
        return None
    x = x32.args[0]
    value = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != node.args[1] or len(x.users) != 1:
        return None
    return x


def _halves(gate: Node, up: Node) -> Node | None:
    """The packed_linear call L when gate, up = split(L, [h, h], -1)[0], [1]; else None."""
    if not (_is(gate, operator.getitem) and _is(up, operator.getitem)):
        return None
    split = gate.args[0]
    if up.args[0] is not split or (gate.args[1], up.args[1]) != (0, 1):
        return None
    if not _is(split, aten.split_with_sizes.default) or len(split.users) != 2:
        return None
    linear, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else 0
    if len(sizes) != 2 or sizes[0] != sizes[1] or dim not in (-1, _last_dim(linear)):
        return None
    if not _is(linear, torch.ops.vmkv.packed_linear.default) or len(linear.users) != 1:
        return None
    return linear


def _last_dim(node: Node) -> int | None:
    value = node.meta.get("val")
    return value.dim() - 1 if isinstance(value, torch.Tensor) else None


def _is(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target
