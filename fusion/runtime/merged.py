"""Fused nn.Modules that replace the matched Transformers submodules.

Each holds exactly the state of what it replaces (stacked, never re-initialised) and calls
its kernel through `fusion.kernels.ops` (the backend chosen per call; a registered operator
while `torch.compile` traces), so a backend can be swapped without refusing.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusion.kernels import ops, reference
from fusion.kernels.norm_variant import DEFAULT_VARIANT, NormVariant
from fusion.kernels.policy import POLICY


class MergedLinear(nn.Module):
    """Sibling linears that read one input, computed as one GEMM on one stacked weight
    whose rows *are* their Parameters.

    The children stay where they were (`shards`, held here unregistered: they remain the
    parent's children, under their names), and so do their Parameters: merging allocates
    one stacked weight (and bias) and makes each shard's `weight`/`bias` a view of its rows
    (`Parameter.data`), so parameter identity, names, order, `requires_grad`, attributes,
    optimiser state, `state_dict` and `load_state_dict` are the unfused model's, with no
    translation. Every in-place write to a Parameter (an optimiser step, `load_state_dict`,
    `p.data.copy_`) writes the stacked weight the GEMM reads, so it can never be stale.

    `forward(x)` returns the concatenated outputs; the rewritten forwards call it with
    `layouts` for `pieces` (each shard's output, laid out as the rewrite's alias analysis
    asked) or `outputs` (the merged output, or the shards' outputs where they were computed
    apart), so the reference path never concatenates to split again. The reference is each
    shard's `F.linear` on the shard's current Parameters, exactly the unfused calls (so training computes the unfused gradients, bit
    for bit, into each Parameter's own `.grad`). One product on the stacked weight (one
    `F.linear`, or a CPU decode kernel) runs instead only where the kernel policy chooses
    it (`fusion.kernels.policy`: measured faster on this machine, or pinned by `backend`),
    while `views_hold()` (each shard's current Parameter still views its rows: `p.data =
    other`, a swapped Parameter, `.to()` of one child or `torch.func.functional_call` break
    it) and no gradient is recorded. Under `torch.compile`, where no gradient is recorded
    and a kernel of ours could be eligible, it is one `fusion::stacked_product` node that
    checks the views when the compiled code runs (`ops.stacked_views_hold`: Dynamo guards
    neither the views nor a Parameter's `.data`) and makes the policy's choice then; the
    shards apart otherwise. `stacked_calls` counts calls
    made while the views held (read from the stacked weight or its rows), `shard_calls`
    those that read the shards' own Parameters (views broken, a gradient, a trace).

    A shard without a bias has exact zeros in the stacked bias when another has one:
    adding 0.0 changes no value, and one GEMM with bias stays one GEMM.
    """

    def __init__(self, linears: dict[str, nn.Linear], backend: str = "auto") -> None:
        super().__init__()
        if not linears:
            raise ValueError("MergedLinear needs at least one linear")
        first = next(iter(linears.values()))
        self.in_features = int(first.in_features)
        self.output_sizes = [int(lin.out_features) for lin in linears.values()]
        self.shard_names = tuple(linears)
        self.shard_bias = tuple(lin.bias is not None for lin in linears.values())
        self.backend = backend
        self.kernel_shape = (*self.output_sizes, self.in_features)
        """The policy's key for this module's products (`fusion.kernels.policy`)."""
        # its own quiet lane, answered by `fusion.fuse` and read by compiled code
        # (`ops.traced_stacked_product`)
        POLICY.watch_lane("stacked", self.kernel_shape, backend)
        # A plain tuple: nn.Module registers only Module/Parameter/Tensor attributes, so the
        # children stay the parent's alone (one name each in named_modules/parameters).
        self.shards: tuple[nn.Linear, ...] = tuple(linears.values())
        self.stacked_weight: torch.Tensor | None = None
        self.stacked_bias: torch.Tensor | None = None
        # per shard: (child, weight Parameter, its byte offset into the stacked weight, its
        # shape, bias Parameter or None (a shard without one), its byte offset into the
        # stacked bias, its shape) as `restack` made them views; addresses are derived from
        # the stacked tensors on each check, so a moved storage (`share_memory_`, a reload)
        # still checks
        self._views: tuple[ShardViews, ...] = ()
        self.stacked_calls = 0
        self.shard_calls = 0
        if not self.restack():
            current = self._current()
            reason = (
                restack_refusal(
                    self.shard_names, current, self.output_sizes, self.in_features, self.shard_bias
                )
                or "a shard's weight or bias is not the Parameter registered under its name"
            )
            raise ValueError(f"the linears cannot share one stacked weight: {reason}")

    @classmethod
    def from_linears(cls, linears: dict[str, nn.Linear], backend: str = "auto") -> MergedLinear:
        """Stack `linears` (name -> module, in shard order) into one merged module whose
        products `backend` may compute (`fusion.kernels.policy.allowed`).

        The caller has checked they share in_features, dtype and device."""
        return cls(linears, backend)

    # -- the stacked weight and its views ------------------------------------------------

    def _current(self) -> list[tuple[Any, Any]]:
        """Each shard's current (weight, bias) as `nn.Linear.forward` reads them
        (`self.weight`, `self.bias`): what it computes with. Read from `_parameters` where
        that is what the lookup finds (both names there, neither shadowed by an instance
        attribute; the class is the parent guard's, `fusion.runtime.guards.ChildGuard`), else
        through the attribute lookup itself (a bias registered as a buffer after `del`, an
        instance attribute set through `object.__setattr__`)."""
        current = []
        for lin in self.shards:
            state = lin.__dict__
            params = state["_parameters"]
            if (
                "weight" in state
                or "bias" in state
                or "weight" not in params
                or "bias" not in params
            ):
                current.append((lin.weight, lin.bias))
            else:
                current.append((params["weight"], params["bias"]))
        return current

    def views_hold(self) -> bool:
        """Whether every shard computes exactly with its rows of the stacked weight (bias):
        each shard reads its weight and bias from `_parameters` (`_current`: no instance
        attribute shadows them), its weight (bias) is the same Parameter object the last
        stacking made a view, still at that memory address, with that shape, contiguous, of
        the stacked dtype, with no negative bit (complex weights are never stacked, so no
        conjugate bit), and a shard stacked without a bias still has none (`bias` still
        registered as None: a bias added after fusing would be dropped by the stacked
        product, whose rows for it are zeros). Then the stacked GEMM reads exactly the
        values each shard's own `F.linear` would. (The device is implied: no CPU and CUDA
        allocation share an address.) It runs on every call, so it is attribute reads and
        identity tests only."""
        views = self._views
        weight, bias = self.stacked_weight, self.stacked_bias
        if not views or weight is None:
            return False
        weight_base = weight.data_ptr()
        bias_base = 0 if bias is None else bias.data_ptr()
        dtype = weight.dtype
        missing = _MISSING
        for lin, w, w_offset, w_shape, b, b_offset, b_shape in views:
            state = lin.__dict__
            params = state["_parameters"]
            if (
                "weight" in state
                or "bias" in state
                or params.get("weight") is not w
                or params.get("bias", missing) is not b
                or w.data_ptr() != weight_base + w_offset
                or w.dtype is not dtype
                or w.shape != w_shape
                or not w.is_contiguous()
                or w.is_neg()
            ):
                return False
            if b is not None and (
                b.data_ptr() != bias_base + b_offset
                or b.dtype is not dtype
                or b.shape != b_shape
                or not b.is_contiguous()
                or b.is_neg()
            ):
                return False
        return True

    def restack(self) -> bool:
        """Make the shards' Parameters views of one stacked weight (bias) again, or leave the
        module running its shards apart. Returns whether the views hold afterwards.

        A no-op while they hold. Otherwise it copies each shard's current values into a new
        stacked tensor and points the Parameter's `.data` at its rows, but only where that
        cannot be observed: every Parameter a plain `nn.Parameter` of one dtype and device,
        strided, of its shard's shape, and the *only* user of its memory (no other tensor,
        view, saved-for-backward value or state-dict entry aliases it), so no write through
        anything else can be lost by the move. Anything else: the stacked weight is dropped
        and `forward` computes each shard from its own Parameters (correct, unmerged).
        Called at construction, by `_apply` (after `model.to(...)`, `.half()`, `.cuda()`
        converted the children) and by `fusion.fuse` on an already fused model."""
        if self.views_hold():
            return True
        current = self._current()
        ours = tuple(t for t in (self.stacked_weight, self.stacked_bias) if t is not None)
        refusal = restack_refusal(
            self.shard_names, current, self.output_sizes, self.in_features, self.shard_bias, ours
        )
        self.stacked_weight = self.stacked_bias = None
        self._views = ()
        if refusal is not None or not all(map(_reads_parameters, self.shards)):
            return False
        with torch.no_grad():
            weight = torch.cat([w.detach() for w, _ in current], dim=0)
            bias = None
            if any(self.shard_bias):
                bias = torch.cat(
                    [
                        b.detach() if b is not None else weight.new_zeros(size)
                        for (_, b), size in zip(current, self.output_sizes)
                    ]
                )
            row = 0
            views = []
            item = weight.element_size()
            for lin, (w, b), size in zip(self.shards, current, self.output_sizes):
                w.data = weight[row : row + size]
                if b is not None:
                    b.data = bias[row : row + size]
                views.append(
                    (
                        lin,
                        w,
                        row * self.in_features * item,
                        w.shape,
                        b,
                        row * item,
                        None if b is None else b.shape,
                    )
                )
                row += size
        self.stacked_weight, self.stacked_bias = weight, bias
        self._views = tuple(views)
        return self.views_hold()

    def _apply(self, fn: Any, recurse: bool = True) -> MergedLinear:
        # The parent converts its children first (they were registered before this
        # module): each converted Parameter is a fresh tensor, no longer a view; restack.
        self.restack()
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> MergedLinear:
        # `Parameter.__deepcopy__` clones each Parameter into memory of its own, so the
        # copy's Parameters never view a copied stacked weight: copy everything but the
        # stacked tensors, then restack the copy's (fresh, unaliased) Parameters.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        skip = ("stacked_weight", "stacked_bias", "_views")  # the copy's are made anew
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        new.__dict__.update(copy.deepcopy(state, memo))
        new.stacked_weight = new.stacked_bias = None
        new._views = ()
        new.restack()
        return new

    # -- computing ---------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, layouts: tuple[str, ...] | str | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The concatenated outputs; with `layouts`, what the rewritten forwards take: a
        tuple of `LAYOUTS` gives `pieces(x, layouts)`, `AS_COMPUTED` gives `outputs(x)`.
        The rewrites call the module (not the methods), so its hooks and whatever watches
        module outputs (the harness's dtype oracle) see each call."""
        if layouts is None:
            out = self.outputs(x)
            return out[0] if len(out) == 1 else torch.cat(out, dim=-1)
        if layouts == AS_COMPUTED:
            return self.outputs(x)
        return self.pieces(x, layouts)  # type: ignore[arg-type]

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`(merged,)` where one product on the stacked weight computed every shard's output
        (the policy chose a stacked kernel, the views hold, no gradient is recorded), else
        each shard's own output: its `F.linear` on its current Parameters, exactly the
        unfused call and tensor (fresh, contiguous), with no concatenation to pay for.
        The rewritten forwards take this (or `pieces`) through `forward`, so the reference
        path costs what the unfused calls cost."""
        counts = self.__dict__  # counters: a plain dict write, not `Module.__setattr__`
        compiling = torch.compiler.is_compiling()
        if compiling:
            return self._traced_outputs(x)
        if POLICY.idle("stacked", self.backend):
            # nothing to choose: the reference, asked nothing (see `KernelPolicy.idle`)
            counts["shard_calls"] += 1
            return tuple(F.linear(x, w, b) for w, b in self._current())
        counts["_choice"], kernels = ops.chosen_for(
            counts.get("_choice"), "stacked", self.kernel_shape, self.backend, x, self.in_features
        )
        if not kernels:
            # no kernel chosen for this call: the reference, whose result does not depend on
            # the views (each shard's own Parameters), so they need not be checked
            counts["shard_calls"] += 1
            return self._shards_apart(x, self._current())
        if not self.views_hold() or self._records_grad():
            counts["shard_calls"] += 1
            return self._shards_apart(x, self._current())
        counts["stacked_calls"] += 1
        stacked = ops.first_eligible(kernels, x, self.stacked_weight, self.stacked_bias)
        if stacked is not None:
            return (stacked,)
        # the reference: each shard's own product on its Parameters (views of the rows)
        return self._shards_apart(x, self._current())

    def _traced_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`outputs` while Dynamo traces: the `fusion::stacked_product` operator where a
        kernel of ours could compute the stacked product for this input and no gradient is
        recorded (`ops.traced_stacked_product`: the policy's choice and the views are
        checked when the compiled code runs, since Dynamo guards neither a Parameter's
        `.data` nor an address), as one merged output; else the shards apart."""
        current = self._current()
        stacked = ops.traced_stacked_product(
            self.kernel_shape,
            self.backend,
            x,
            self.stacked_weight,
            self.stacked_bias,
            current,
            self.shard_bias,
        )
        return self._shards_apart(x, current) if stacked is None else (stacked,)

    def pieces(self, x: torch.Tensor, layouts: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """Each shard's output, in shard order, laid out as `layouts` asks (one of
        `LAYOUTS` per shard): where one stacked product computed them, its split views, made
        `.contiguous()` (`contiguous`) or copies of their own with standard strides
        (`fresh`: `t.new_empty(t.shape).copy_(t)`, not a view, as the projection's own
        output was) where the rewrite's alias analysis asked; where each shard computed its
        own, those outputs as they are: already fresh and contiguous, the unfused tensors."""
        out = self.outputs(x)
        if len(out) != 1 or len(self.output_sizes) == 1:
            return out
        split = out[0].split(self.output_sizes, -1)
        return tuple(_laid_out(piece, layout) for piece, layout in zip(split, layouts))

    def _records_grad(self) -> bool:
        """Will autograd record a product with the shards' Parameters? Asked once the views
        hold, so `_views` lists exactly the current Parameters."""
        return torch.is_grad_enabled() and any(
            w.requires_grad or (b is not None and b.requires_grad)
            for _, w, _, _, b, _, _ in self._views
        )

    def _shards_apart(
        self, x: torch.Tensor, current: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> tuple[torch.Tensor, ...]:
        """Each shard's `F.linear` on its own current Parameters: the unfused calls exactly
        (autograd included), eager or traced (the cheapest path: it is the reference of every
        call the policy gives no stacked kernel, and what Inductor compiles best)."""
        return tuple(F.linear(x, weight, bias) for weight, bias in current)

    def extra_repr(self) -> str:
        shards = ", ".join(
            f"{name}={size}" for name, size in zip(self.shard_names, self.output_sizes)
        )
        state = "stacked" if self.views_hold() else "shards apart"
        return (
            f"in_features={self.in_features}, shards=({shards}), "
            f"bias={any(self.shard_bias)}, backend={self.backend}, {state}"
        )


ShardViews = tuple[nn.Linear, torch.Tensor, int, torch.Size, Any, int, Any]
"""One shard's views in a stacked weight (`MergedLinear._views`)."""

_MISSING = object()


def _reads_parameters(lin: nn.Module) -> bool:
    """Whether `lin.weight` and `lin.bias` are what `lin._parameters` holds under those
    names (both registered there, neither shadowed by an instance attribute): the shards
    a stacked weight may stand for."""
    state = lin.__dict__
    params = state.get("_parameters", {})
    return "weight" in params and "bias" in params and not {"weight", "bias"} & state.keys()


def _storage_users(t: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share `t`'s memory, or None where PyTorch
    cannot say (the count is a private API: its absence makes `restack` refuse)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(t.untyped_storage()._cdata))
    except (RuntimeError, AttributeError, TypeError):
        return None


_SOLE_USER = _storage_users(nn.Parameter(torch.empty(1)))
"""`_storage_users` of a Parameter that alone holds its memory (the count includes the
handle the query itself makes), measured once on this PyTorch."""


def _unmovable(
    name: str, p: Any, first: torch.Tensor, shape: tuple[int, ...], ours: list[torch.Tensor]
) -> str | None:
    """Why `p` (named `name`) cannot move into a stacked tensor unobserved, or None: it must
    be a plain, strided Parameter of `shape` and of `first`'s dtype and device, and its
    memory used by nothing but tensors in `ours` (the shards' Parameters and the stacked
    tensors, all of which move or are dropped together); else a write through the other
    user would miss the model."""
    if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
        return f"{name} is a {type(p).__name__}, not a plain nn.Parameter"
    if p.layout != torch.strided or p.is_neg() or p.is_conj() or p.is_complex():
        return f"{name} is not a plain strided real tensor"
    if p.shape != shape:
        return f"{name} has shape {tuple(p.shape)}, not {shape}"
    if p.dtype != first.dtype or p.device != first.device:
        return f"{name} is {p.dtype} on {p.device}, the first shard {first.dtype} on {first.device}"
    if _SOLE_USER is None:
        return "this PyTorch cannot say whether a Parameter's memory is shared"
    storage = p.untyped_storage()._cdata
    expected = _SOLE_USER - 1 + sum(t.untyped_storage()._cdata == storage for t in ours)
    if _storage_users(p) != expected:
        return (
            f"{name} shares its memory with another tensor (a view, a state-dict entry or a "
            "value saved for backward held elsewhere): writes through it would miss the "
            "stacked weight"
        )
    return None


def restack_refusal(
    names: tuple[str, ...],
    current: list[tuple[Any, Any]],
    sizes: list[int],
    in_features: int,
    has_bias: tuple[bool, ...],
    held: tuple[torch.Tensor, ...] = (),
) -> str | None:
    """Why the shards' current (weight, bias) pairs cannot become views of one stacked
    weight and bias, or None (`MergedLinear.restack`; the stacking fusers ask it first).
    `held`: the stacked tensors the caller holds now (dropped by the move)."""
    first = current[0][0]
    ours = [*held, *(t for pair in current for t in pair if isinstance(t, torch.Tensor))]
    if not isinstance(first, torch.Tensor):
        return f"{names[0]}.weight is not a tensor"
    for name, (w, b), size, has in zip(names, current, sizes, has_bias):
        reason = _unmovable(f"{name}.weight", w, first, (size, in_features), ours)
        if reason is None and (b is not None) != has:
            reason = f"{name}.bias was {'added' if b is not None else 'removed'}"
        if reason is None and b is not None:
            reason = _unmovable(f"{name}.bias", b, first, (size,), ours)
        if reason is not None:
            return reason
    return None


LAYOUTS = ("view", "contiguous", "fresh")
"""How `MergedLinear.pieces` hands a piece of a stacked output to the rewritten forward."""

AS_COMPUTED = "as-computed"
"""`MergedLinear.forward`'s `layouts` asking for `outputs` (one merged tensor, or the
shards' own outputs where they were computed apart)."""


def _laid_out(piece: torch.Tensor, layout: str) -> torch.Tensor:
    """`piece` (a split view of a stacked output) in `layout` (`LAYOUTS`)."""
    if layout == "fresh":
        return piece.new_empty(piece.shape).copy_(piece)
    if layout == "contiguous":
        return piece.contiguous()
    return piece


class ActAndMul(nn.Module):
    """`act(x[..., :d]) * x[..., d:]`: the activation on the gate half, times the up half.

    Called with two tensors, `(gate, up)` (a merged projection's shards computed apart,
    `MergedLinear.outputs`), it is `act(gate) * up`: the unfused expression itself, with no
    concatenation first."""

    def __init__(self, activation: str, backend: str = "auto") -> None:
        super().__init__()
        self.activation = activation
        self.backend = backend

    def forward(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is not None:
            return ops.act_and_mul_pair(self.backend, x, up, self.activation)
        return ops.act_and_mul(self.backend, x, self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation}, backend={self.backend}"


DtypePair = tuple[torch.dtype, torch.dtype | None]
"""(input dtype, weight dtype or None for a weightless norm)."""


def uses_float32_aten(variant: NormVariant) -> bool:
    """Whether `torch.rms_norm` computes `variant` on float32 operands: the `rsqrt` spelling
    (`NormVariant.fast`), ATen's composite (`reference.ATEN_RMS_NORM_IS_COMPOSITE`),
    statistics in float32 and no offset (the weight
    order and cast target do not matter when everything is float32). Read once per fused
    norm, so the float32 fast path asks one attribute."""
    return (
        variant.fast
        and variant.upcast
        and not variant.offset
        and reference.ATEN_RMS_NORM_IS_COMPOSITE
    )


def norm_eps(eps: float | None, dtype: torch.dtype) -> float:
    """`eps`, or (None) the float32-or-wider finfo eps of `dtype`, as `torch.nn.RMSNorm`
    and `F.rms_norm(..., eps=None)` use."""
    if eps is not None:
        return eps
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def norm_kernel(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    variant: NormVariant,
    float32_aten: bool,
    backend: str,
) -> torch.Tensor:
    """`x` normalised in `variant` with `weight` and `eps` (None: `norm_eps`), on `backend`:
    the fused norms' one computation. The caller has checked the (input, weight) dtype pair
    is one the variant was proven for, and that the weight is per-channel.

    On CPU with the reference backends, exactly the call the reference backend makes here
    (`TorchKernels.rms_norm`) without the frames between, which on a decode step run from
    caches a GEMV has just emptied: float32 first, decided by one flag (`uses_float32_aten`),
    then `reference.aten_norm` for the other dtypes."""
    eps = norm_eps(eps, x.dtype)
    if x.is_cpu and backend in ("auto", "torch") and not torch.compiler.is_compiling():
        if (
            float32_aten
            and x.dtype == torch.float32
            and weight is not None
            and weight.dtype == torch.float32
            and weight.dim() == 1
            and weight.shape[0] == x.shape[-1]
        ):
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        norm = reference.aten_norm(x, weight, variant)
        if norm is not None:
            return reference.aten_rms_norm(x, norm, eps)
    return ops.rms_norm(backend, x, weight, eps, variant=variant)


def norm_pair_kernel(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    variant: NormVariant,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(a + b, norm_kernel(a + b, ...))` as one `add_rms_norm` kernel call, bit for bit the
    two ops apart (`Kernels.add_rms_norm`); `a` and `b` of one dtype and shape."""
    return ops.add_rms_norm(backend, a, b, weight, norm_eps(eps, a.dtype), variant=variant)


class FusedRMSNorm(nn.Module):
    """An RMSNorm in the exact variant it was matched in, as one kernel call.

    No longer installed by the RMSNorm fuser, which keeps the user's norm module in its slot
    and gives it a fused forward (`fusion.runtime.norm_forward.NormForward`, the same `norm_kernel`);
    kept so that a model fused and pickled by an earlier version loads and runs, and as the
    norm kernel's module for benchmarks and kernel tests.

    `variant` (a frozen `NormVariant`, read-only here) is what `fusion.fusers.rmsnorm` proved
    the replaced module computes; `reference.rms_norm` defines each field. `weight` is the
    replaced module's own Parameter object (never a copy), under the same name, so
    checkpoints, ties and optimiser state map 1:1; a weightless norm has none and normalises
    whatever width it is given.

    `eps=None` reproduces `F.rms_norm(..., eps=None)`: machine epsilon of the float32-or-wider
    compute dtype, resolved per call.

    `verified` lists the (input dtype, weight dtype) pairs for which the match proved the
    function equal (float32, bfloat16 and float16 always; float64 only when the original's
    casts agree there too). Any other pair raises TypeError instead of silently computing
    another function.
    """

    def __init__(
        self,
        weight: nn.Parameter | None,
        eps: float | None,
        *,
        variant: NormVariant = DEFAULT_VARIANT,
        verified: frozenset[DtypePair] = frozenset(),
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.has_weight = weight is not None
        if weight is not None:
            self.weight = weight
        self.eps = eps
        self._set_variant(variant)
        self.verified = frozenset(verified)
        self.backend = backend

    def _set_variant(self, variant: NormVariant) -> None:
        """Hold `variant`, and what `forward`'s float32 fast path asks of it, read once here
        so that path reads one attribute: whether `torch.rms_norm` computes this variant on
        float32 operands (ATen's composite, `reference.ATEN_RMS_NORM_IS_COMPOSITE`;
        statistics in float32 and no offset; the weight order and cast target do not matter
        when everything is float32). The only writer of either, so the two never
        disagree."""
        self._variant = variant
        self._float32_aten = uses_float32_aten(variant)

    @property
    def variant(self) -> NormVariant:
        """The proven variant (read-only: another variant would be another, unproven
        function)."""
        return self._variant

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle, also a `FusedRMSNorm` pickled when it held the variant's fields as
        separate attributes: they are folded into one `NormVariant` (the same function)."""
        old = None
        if "_variant" not in state:
            names = [field.name for field in dataclasses.fields(NormVariant)]
            old = {name: state.pop(name) for name in names if name in state}
        super().__setstate__(state)
        if old is not None:
            self._set_variant(NormVariant(**old))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `_parameters` directly: `nn.Module.__getattr__` would be one more Python frame
        weight = self._parameters["weight"] if self.has_weight else None
        pair = (x.dtype, None if weight is None else weight.dtype)
        if pair not in self.verified:
            raise TypeError(
                f"FusedRMSNorm was proven equal to the module it replaced only for "
                f"(input, weight) dtypes {sorted(map(str, self.verified))}, not {pair}"
            )
        return norm_kernel(x, weight, self.eps, self._variant, self._float32_aten, self.backend)

    def _eps_for(self, dtype: torch.dtype) -> float:
        """The eps the replaced module used (`norm_eps`)."""
        return norm_eps(self.eps, dtype)

    def extra_repr(self) -> str:
        width = tuple(self.weight.shape) if self.has_weight else "any width"
        v = self._variant
        order = "weight after cast" if v.weight_after_cast else "weight before cast"
        if v.weight_after_cast and v.cast_to_weight:
            order += " to the weight's dtype"
        return (
            f"{width}, eps={self.eps}, offset={v.offset}, upcast={v.upcast}, {order}, "
            f"backend={self.backend}"
        )

    def add_forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(s, n)` with `s = a + b` and `n` this norm of `s`: a decoder layer's residual add
        and the norm reading the sum, as one `add_rms_norm` kernel call.

        Returns exactly what `s = a + b; n = self(s)` binds, bit for bit: the kernel forms
        `s` as PyTorch's add does and normalises the rounded `s` with this module's variant,
        eps and backend (`Kernels.add_rms_norm`). It runs only for two tensors of one dtype
        and shape whose (dtype, weight dtype) pair is `verified`; anything else (promotion,
        broadcasting, an unverified pair: `forward` raises TypeError for it) runs the two
        ops apart, through `self(s)`. Bypasses `__call__`: the caller checks this module has
        no hooks and no call path of its own (`fusion.fusers.residual_norm.runtime`).
        """
        weight = self.weight if self.has_weight else None
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and (a.dtype, None if weight is None else weight.dtype) in self.verified
        ):
            total = a + b
            return total, self(total)
        return norm_pair_kernel(a, b, weight, self.eps, self._variant, self.backend)
