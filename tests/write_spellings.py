"""Every spelling of an in-place write to a tensor: the one hazard table of the test suite.

A write the engine must see can be spelled in dozens of ways (augmented assignment, `_`
methods, `out=`, `inplace=`, item stores, through views, containers, closures, helpers,
`exec`...). Three test families need them and used to keep three tables that drifted: the
fuzzer writes them to a projection's input and to its output (tests/fuzz/grammar.py), the
piece-write tests write them to each split piece of a merged GEMM
(tests/fusion/analysis/test_piece_writes_spellings.py), and the alias unit tests write them to the
input between two projections (tests/fusion/analysis/test_alias.py). They all draw from `WRITES`, so
a spelling added for one (say, from a fuzz finding) is tested by every family.

Each spelling's lines write `{t}`; a host formats them with its tensor's name. `needs` names
what the lines use besides `torch` and `F`, so each host takes only the spellings it can run.
"""

from __future__ import annotations

from dataclasses import dataclass

HELPERS = '''\
def bump(t):
    """Writes its argument, with no in-place spelling at the call site."""
    t.mul_(0.5)
    return t


def rotate_in_place(t):
    """Rotary embedding written in place: the first half is replaced."""
    half = t.shape[-1] // 2
    t[..., :half] = t[..., half : 2 * half] * 0.5
    return t
'''
"""Module-level helpers some spellings call (`needs` "bump" / "rotate_in_place")."""


@dataclass(frozen=True)
class Spelling:
    """One way of writing `{t}` in place."""

    label: str
    lines: tuple[str, ...]
    needs: frozenset[str] = frozenset()
    """What the lines use besides `torch` and `F`: "operator", the HELPERS "bump" and
    "rotate_in_place", "flag" (a `self.flag` attribute that is None where the module is
    traced), "wide" (a last dimension of at least 4, even), "contiguous" (a `.view`) or
    "no_grad" (`out=` raises on a tensor that requires grad)."""

    def on(self, name: str) -> tuple[str, ...]:
        """The lines writing the tensor called `name`."""
        return tuple(line.format(t=name) for line in self.lines)

    def template(self, field: str) -> tuple[str, ...]:
        """The lines as a `str.format` template of another host, `{t}` renamed to
        `{field}` (literal braces stay doubled)."""
        return tuple(line.replace("{t}", "{" + field + "}") for line in self.lines)


def _w(label: str, *lines: str, needs: tuple[str, ...] = ()) -> Spelling:
    return Spelling(label, lines, frozenset(needs))


WRITES: tuple[Spelling, ...] = (
    _w("augassign_mul", "{t} *= 0.5"),
    _w("augassign_add", "{t} += 0.25"),
    _w("augassign_slice", "{t}[..., :1] -= 0.25"),
    _w("inplace_method", "{t}.mul_(0.5)"),
    _w("inplace_add", "{t}.add_(0.25)"),
    _w("inplace_copy", "{t}.copy_({t} * 0.5)"),
    _w("inplace_sigmoid", "{t}.sigmoid_()"),
    _w("clamp_", "{t}.clamp_(min=-0.5, max=0.5)"),
    _w("masked_fill_", "{t}.masked_fill_({t} > 0.5, 0.5)"),
    _w("out_keyword", "torch.mul({t}, 0.5, out={t})", needs=("no_grad",)),
    _w("inplace_keyword", "F.relu({t}, inplace=True)"),
    _w("inplace_keyword_assigned", "_z_r = F.hardtanh({t}, -0.5, 0.5, inplace=True)"),
    _w("inplace_positional", "F.leaky_relu({t}, 0.1, True)"),
    _w("torch_underscore", "torch.relu_({t})"),
    _w("functional_underscore", "F.relu_({t})"),
    _w("unbound_method", "torch.Tensor.mul_({t}, 0.5)"),
    _w("dunder", "{t}.__imul__(0.5)"),
    _w("operator_function", "operator.imul({t}, 0.5)", needs=("operator",)),
    _w("item_assign", "{t}[..., 0] = 0.0"),
    _w("item_assign_row", "{t}[0] = {t}[0] * 0.5"),
    _w("view_item_write", "{t}.view(-1)[0] = 1.0", needs=("contiguous",)),
    _w("view_write", "_z_v = {t}.view(-1)", "_z_v.mul_(0.5)", needs=("contiguous",)),
    _w("slice_write", "_z_s = {t}[..., :1]", "_z_s.zero_()"),
    _w("chained_slice_write", "{t}[..., :1].zero_()"),
    _w("rotary_copy_", "{t}[..., :2].copy_({t}[..., 2:4] * 0.5)", needs=("wide",)),
    _w("slice_copy", "{t}[..., :1].copy_({t}[..., -1:] * 0.5)"),
    _w(
        "rotary_setitem",
        "_z_half = {t}.shape[-1] // 2",
        "{t}[..., :_z_half] = {t}[..., _z_half : 2 * _z_half] * 0.5",
    ),
    _w(
        "derived_view_augassign",
        "_z_dv = {t}.unflatten(-1, (2, -1)).transpose(0, 1)",
        "_z_dv *= 0.5",
        needs=("wide",),
    ),
    _w("derived_view_chain", "{t}.view(-1, 2)[:, :1].mT.mul_(0.5)", needs=("contiguous", "wide")),
    _w("transposed_view_write", "_z_ov = {t}.unsqueeze(0).transpose(0, 1)", "_z_ov *= 0.5"),
    _w(
        "ternary_view",
        "_z_tv = {t}.unflatten(-1, (2, -1)) if self.flag is None else None",
        "_z_tv *= 0.5",
        needs=("flag", "wide"),
    ),
    _w(
        "boolop_view",
        "_z_bv = self.flag or {t}.transpose(0, 1)",
        "_z_bv.mul_(0.5)",
        needs=("flag",),
    ),
    _w("walrus_write", "(_z_w := {t}[..., :1]).add_(0.25)"),
    _w("detach_write", "{t}.detach().mul_(0.5)"),
    _w("data_write", "{t}.data.mul_(0.5)"),
    _w("float_cast_write", "{t}.float().mul_(0.5)"),
    _w("list_container", "_z_box = [{t}]", "_z_box[0].mul_(0.5)"),
    _w("dict_container", "_z_d = {{'h': {t}}}", "_z_d['h'] += 0.25"),
    _w(
        "set_container",
        "_z_set = set()",
        "_z_set.add({t})",
        "for _z_e in _z_set:",
        "    _z_e.mul_(0.5)",
    ),
    _w("tuple_unpack", "_z_a, _z_b = {t}, None", "_z_a.mul_(0.5)"),
    _w("for_loop", "for _z_e in ({t},):", "    _z_e.mul_(0.5)"),
    _w("loop_inplace", "for _ in range(2):", "    {t}.mul_(0.5)"),
    _w("comprehension", "[_z_e.mul_(0.5) for _z_e in [{t}]]"),
    _w("bound_method", "_z_f = {t}.mul_", "_z_f(0.5)"),
    _w("lambda_called", "(lambda: {t}.mul_(0.5))()"),
    _w("lambda_assigned", "_z_l = lambda: {t}.mul_(0.5)", "_z_l()"),
    _w("nested_def", "def _z_g():", "    {t}.mul_(0.5)", "_z_g()"),
    _w("helper_discarded", "bump({t})", needs=("bump",)),
    _w("helper_assigned", "_z_h = bump({t})", needs=("bump",)),
    _w("helper_rotary", "{t} = rotate_in_place({t})", needs=("rotate_in_place", "wide")),
    _w("self_attribute", "self._z_saved = {t}", "self._z_saved.mul_(0.5)"),
    _w("setattr_write", "setattr(self, '_z_saved', {t})", "self._z_saved.mul_(0.5)"),
    _w("conditional_write", "if {t}.shape[0] > 0:", "    {t}.mul_(0.5)"),
    _w("guarded_write", "if {t} is not None:", "    {t}.mul_(0.5)"),
    _w("branch_not_traced", "if self.flag is not None:", "    {t}.mul_(0.5)", needs=("flag",)),
    _w(
        "helper_branch_not_traced",
        "if self.flag is not None:",
        "    bump({t})",
        needs=("flag", "bump"),
    ),
    _w("exec", "exec('{t}.mul_(0.5)')"),
    # Writes with no in-place spelling at all (issue 24): a numpy view's methods (`put`,
    # `sort`), torch functions that write what they are given (`swap_tensors`,
    # `vector_to_parameters` rebinds `.data`, the deprecated `nn.init.*` without `_`), and
    # options that make a function write (`max_norm=` renormalises the embedding rows,
    # `training=True` updates the running statistics).
    _w("numpy_put", "{t}.detach().numpy().put(0, 4.0)"),
    _w("numpy_put_kept", "_z_np = {t}.detach().numpy()", "_z_put = _z_np.put(0, 4.0)"),
    _w("numpy_sort", "_z_sorted = {t}.detach().numpy().sort(axis=-1)"),
    _w("numpy_item_store", "{t}.detach().numpy()[..., 0] = 4.0"),
    _w(
        "swap_tensors",
        "_z_sw = torch.utils.swap_tensors({t}, {t}.detach() * 0.5)",
        needs=("no_grad",),
    ),
    _w(
        "vector_to_parameters",
        "_z_v2p = nn.utils.vector_to_parameters({t}.detach().flatten() * 0.5, [{t}])",
    ),
    _w("init_deprecated", "_z_init = nn.init.constant({t}, 0.5)"),
    _w(
        "embedding_max_norm",
        "_z_e = F.embedding(torch.zeros(1, dtype=torch.long), {t}.flatten(0, -2), max_norm=0.01)",
        needs=("contiguous",),
    ),
    _w(
        "batch_norm_training",
        "_z_rows = {t}.flatten(0, -2)",
        "_z_bn = F.batch_norm(torch.ones(2, _z_rows.shape[-1], dtype={t}.dtype), _z_rows[0],"
        " _z_rows[1], training=True)",
        needs=("contiguous",),
    ),
)
"""Every in-place write spelling, each writing `{t}` (and nothing else)."""


def spellings(provided: frozenset[str] | set[str]) -> tuple[Spelling, ...]:
    """The spellings a host providing `provided` (see `Spelling.needs`) can run."""
    return tuple(spelling for spelling in WRITES if spelling.needs <= provided)


def by_label() -> dict[str, Spelling]:
    """`WRITES` by label (labels are unique)."""
    return {spelling.label: spelling for spelling in WRITES}
