"""The RMSNorm shape: Transformers' spellings of an RMSNorm and near misses that are not one."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from tests.fuzz.grammar import (
    Draw,
    Part,
    Slot,
    draw_statements,
    ints,
    method,
    weighted,
)

# -- RMSNorm --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Norm:
    """What `rmsnorm_part` drew for one norm, in the order drawn."""

    hidden: int
    eps: float
    busy: int
    eps_attr: str
    upcast: str
    variance: str
    scale: str
    output: str
    near_miss: str | None


def _draw_norm(draw: Draw, part: Part, hidden: int | None) -> Norm:
    """The width, eps, and the spelling of each step (or the near miss that is no RMSNorm)."""
    hidden = hidden if hidden is not None else draw(ints([16, 8, 12]))
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
    busy = draw(weighted([(0, 2), (1, 2), (2, 1)]))  # statements a slot may take
    eps_attr = draw(st.sampled_from(["variance_epsilon", "eps"]))
    upcast = draw(st.sampled_from(["to", "float", "none"]))
    variance = draw(
        st.sampled_from(
            [
                "{h}.pow(2).mean(-1, keepdim=True)",
                "torch.mean({h} * {h}, dim=-1, keepdim=True)",
                "{h}.square().mean(-1, keepdim=True)",
                "{h}.pow(exponent=2).mean(-1, keepdim=True)",
            ]
        )
    )
    scale = draw(st.sampled_from(["rsqrt", "rsqrt", "div_sqrt", "pow_kw", "pow_all_kw"]))
    output = draw(st.sampled_from(["llama", "llama", "gemma", "cast_after", "no_weight"]))
    near_miss = draw(
        weighted(
            [
                (None, 14),
                *((miss, 1) for miss in ("mean_subtracted", "abs_mean", "var", "sum")),
                *((miss, 1) for miss in ("eps_outside", "dim0", "bias")),
            ]
        )
    )
    part.features += [f"upcast:{upcast}", f"scale:{scale}", f"output:{output}"]
    if near_miss:
        part.features.append(f"near_miss:{near_miss}")
    return Norm(hidden, eps, busy, eps_attr, upcast, variance, scale, output, near_miss)


def _norm_init(n: Norm, part: Part) -> list[str]:
    """The body of `__init__`: the weight (Gemma's offset form), a bias for that near miss,
    eps under its drawn name (and the tweak a second instance takes)."""
    init = ["super().__init__()"]
    if n.output == "gemma":
        init.append(f"self.weight = nn.Parameter(torch.randn({n.hidden}) * 0.1)")
    elif n.output != "no_weight":
        init.append(f"self.weight = nn.Parameter(torch.randn({n.hidden}) * 0.1 + 1.0)")
    if n.near_miss == "bias":
        init.append(f"self.bias = nn.Parameter(torch.randn({n.hidden}) * 0.1)")
    init.append(f"self.{n.eps_attr} = {n.eps}")
    part.tweaks.append(f"{{m}}.{n.eps_attr} = {0.1 if n.eps != 0.1 else 1e-6}")
    return init


def _norm_variance(n: Norm, x: str) -> str:
    """The mean of squares (or the near miss's other statistic) of `x`."""
    if n.near_miss == "abs_mean":
        return f"{x}.abs().mean(-1, keepdim=True)"
    if n.near_miss == "var":
        return f"{x}.var(-1, keepdim=True)"
    if n.near_miss == "sum":
        return f"{x}.pow(2).sum(-1, keepdim=True)"
    if n.near_miss == "dim0":
        return f"{x}.pow(2).mean(0, keepdim=True)"
    return n.variance.format(h=x)


def _norm_factor(n: Norm) -> str:
    """The reciprocal root of `variance + eps` in the drawn spelling (or eps outside it)."""
    eps_ref = f"self.{n.eps_attr}"
    if n.near_miss == "eps_outside":
        return f"(torch.rsqrt(variance) + {eps_ref})"
    if n.scale == "rsqrt":
        return f"torch.rsqrt(variance + {eps_ref})"
    if n.scale == "pow_kw":  # vLLM's test spellings (issue 27): keywords, the same call
        return f"torch.pow(variance + {eps_ref}, exponent=-0.5)"
    if n.scale == "pow_all_kw":
        return f"torch.pow(input=variance + {eps_ref}, exponent=-0.5)"
    return f"(1.0 / torch.sqrt(variance + {eps_ref}))"


def _norm_result(n: Norm, x: str) -> str:
    """The returned expression: the weight applied in the drawn order, cast back."""
    if n.output == "llama":
        result = f"self.weight * {x}.to(input_dtype)"
    elif n.output == "cast_after":
        result = f"(self.weight * {x}).to(input_dtype)"
    elif n.output == "gemma":
        result = f"({x} * (1.0 + self.weight.float())).to(input_dtype)"
    else:
        result = f"{x}.to(input_dtype)"
    return f"{result} + self.bias" if n.near_miss == "bias" else result


def _norm_body(draw: Draw, n: Norm, part: Part, safe: bool, x: str) -> list[str]:
    """The forward's body, with statements drawn before and after the normalisation."""
    body = part.add(draw_statements(draw, x, Slot(), [], safe, n.busy))
    body.append(f"input_dtype = {x}.dtype")
    if n.upcast == "to":
        body.append(f"{x} = {x}.to(torch.float32)")
    elif n.upcast == "float":
        body.append(f"{x} = {x}.float()")
    if n.near_miss == "mean_subtracted":
        body.append(f"{x} = {x} - {x}.mean(-1, keepdim=True)")
    body.append(f"variance = {_norm_variance(n, x)}")
    factor = _norm_factor(n)
    inplace = not safe and draw(st.integers(0, 3)) == 0
    if inplace:
        # For a float32 input `.to(torch.float32)` / `.float()` return the input itself, so
        # this writes the caller's tensor: a fused norm must do the same.
        part.hazards.append("inplace_normalise")
        body.append(f"{x} *= {factor}")
    else:
        body.append(f"{x} = {x} * {factor}")
    body += part.add(draw_statements(draw, x, Slot(), [], safe, min(n.busy, 1)))
    body.append(f"return {_norm_result(n, x)}")
    return body


def rmsnorm_part(
    draw: Draw, safe: bool, name: str = "GeneratedRMSNorm", hidden: int | None = None
) -> Part:
    """An RMSNorm in one of Transformers' spellings (Llama, Gemma, no weight), or a near
    miss that is not an RMSNorm at all (mean-subtracting, eps outside the root, ...)."""
    part = Part(name, [])
    n = _draw_norm(draw, part, hidden)
    x = "hidden_states"
    init = _norm_init(n, part)
    body = _norm_body(draw, n, part, safe, x)
    part.lines = [
        f"class {name}(nn.Module):",
        *method("__init__", "self", init),
        "",
        *method("forward", f"self, {x}", body),
    ]
    if not safe and draw(st.integers(0, 5)) == 0:
        part.snippets.append("hooks")
        part.hooks.append("{m}.register_forward_hook(halve_output_hook)")
        part.hazards.append("hook:norm")
    part.inputs = [
        f"args.append(torch.randn({draw(ints([2, 1]))}, {draw(ints([3, 1]))}, {n.hidden}, generator=generator) * 2.0)"
    ]
    return part
