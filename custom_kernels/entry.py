"""What the two launchers of a kernel's CUDA text as a function of its own share (:mod:`.cubin` on the GPU,
:mod:`.sim` on the CPU): a specialization's parameter list and template constants, and the call's checks."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

#: C++ parameter type of each input/output dtype (MLX-CUDA's names; sim.h defines the half types).
C_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.int16: "int16_t", mx.uint16: "uint16_t", mx.int8: "int8_t", mx.uint8: "uint8_t",
    mx.int64: "int64_t", mx.uint64: "uint64_t", mx.bool_: "bool",
}  # fmt: skip


def parameters(input_names: Sequence[str], output_names: Sequence[str], in_dtypes, out_dtypes) -> str:
    """The kernel function's parameter list: a const pointer per input, a pointer per output."""
    params = [f"const {C_TYPES[d]}* {n}" for n, d in zip(input_names, in_dtypes)]
    params += [f"{C_TYPES[d]}* {n}" for n, d in zip(output_names, out_dtypes)]
    return ", ".join(params)


def constants(template) -> str:
    """The template's ``(name, value)`` pairs as ``constexpr`` lines, as MLX's cuda_kernel writes them."""
    out = []
    for name, value in template:
        if isinstance(value, (bool, np.bool_)):
            out.append(f"constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, (int, np.integer)):
            out.append(f"constexpr int {name} = {int(value)};\n")
        else:
            raise TypeError(f"kernel templates take int/bool values, got {name}={value!r}")
    return "".join(out)


def checked_inputs(name: str, input_names: Sequence[str], output_names: Sequence[str], inputs,
                   output_shapes) -> list[mx.array]:  # fmt: skip
    """``inputs`` as MLX arrays, after checking the call has one per input name and a shape per output."""
    if len(inputs) != len(input_names) or len(output_shapes) != len(output_names):
        raise ValueError(f"{name}: expected {len(input_names)} inputs and {len(output_names)} outputs")
    return [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
